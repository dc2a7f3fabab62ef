"""Issue 24's Done-when, replayed on this machine: hostile servers, one bad value, a
half-open PostgreSQL and a skewed clock, against real processes.

    python scripts/check_hostile.py [--only rss,malformed,n,requeue,halfopen,heartbeat,skew]

1. ``rss``: ``synthq run`` (embedded) against a server whose 500 answers carry a 3 GB
   body (``synthq.testing.hostile`` in its own process): peak RSS <= 300 MB, the
   sample fails with a class, after at most ``max_attempts`` calls;
2. ``malformed``: ``synthq run`` against a server whose stream chunks have the wrong
   shape (``"delta": "str"``): calls <= ``max_attempts`` per sample and the run ends;
3. ``n``: ``synthq run --extra-body '{"n": 100}'`` refused with one line, no call made;
4. ``requeue``: ``POST /api/jobs/{job}/requeue {"max_attempts": 10**12}`` to a real
   ``synthq api`` answered 422; the row the API stored before it was bounded (a
   running sample past its lease with that override) is written anyway, and a canary
   job on a real worker and beat still finishes;
5. ``halfopen``: every PostgreSQL connection of a worker and beat stranded by a TCP
   proxy, one holding the dispatch lock (``synthq.testing.chaos.postgres_half_open``):
   the job moves again within 60 s and finishes, nothing lost, nothing paid twice
   beyond the calls in flight;
   ``heartbeat`` (issue 30): two workers, beat, ``--inflight 16``, 300 samples, every
   connection stranded past the workers' timeout (``chaos.stranded_heartbeat``), then
   only the heartbeats': prompts generated twice <= 16, and 0;
6. ``skew``: a worker 120 s behind under libfaketime (``chaos.clock_skew``): 0 answers
   paid twice, the in-flight limit exact.

Checks 4-6 run on a private PostgreSQL and Redis each (``initdb``, ``redis-server``),
like ``bench/chaos.py``; 6 needs Debian's ``faketime``. Prints one line per check,
PASS or FAIL with its figures, and exits 1 if any failed. Takes 3-5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from synthq.testing import chaos  # noqa: E402
from synthq.testing.hostile import GOOD_CHUNKS, MALFORMED, HostileProcess, run_measured  # noqa: E402
from synthq.testing.procs import ApiServer  # noqa: E402

TOKEN = "check-hostile-token-8d1f3a"


def env(data: Path | None = None, **extra: str) -> dict[str, str]:
    """A child's environment: embedded mode in ``data`` (no database, no broker)."""
    out = dict(os.environ, PYTHONPATH=str(REPO), **extra)
    if data is not None:
        out.update(SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="")
    return out


def dataset(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]})
                            + "\n" for i in range(n)))
    return path


def run_cmd(data_file: Path, url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "synthq.cli", "run", "-d", str(data_file), "-s", url,
            "-m", "hostile", "--max-tokens", "16", "--backoff-base", "0.1",
            "--backoff-cap", "0.2", "--json", *args]


def summary_of(stdout: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


# -- the checks: each returns (passed, figures) -------------------------------------------


def check_rss(tmp: Path) -> tuple[bool, str]:
    server = HostileProcess(tmp / "hostile-rss.log", env(), "--error-status", "500",
                            "--error-bytes", "3e9")
    try:
        done, peak = run_measured(run_cmd(dataset(tmp / "rss.jsonl", 1), server.url,
                                          "--max-attempts", "2"),
                                  env(tmp / "rss-data"), timeout=300)
        calls = server.calls()
    finally:
        server.stop()
    s = summary_of(done.stdout)
    failures = s.get("failures", {})
    ok = peak <= 300 and failures == {"server_error": 1} and calls <= 2 and \
        done.returncode == 1
    return ok, (f"peak RSS {peak:.0f} MB (<= 300), failures {failures}, calls {calls} "
                f"(max_attempts 2), exit {done.returncode}")


def check_malformed(tmp: Path) -> tuple[bool, str]:
    n, attempts = 5, 2
    chunks = json.dumps([*MALFORMED["delta-str"], *GOOD_CHUNKS])
    server = HostileProcess(tmp / "hostile-malformed.log", env(), "--chunks", chunks)
    t0 = time.monotonic()
    try:
        done, _ = run_measured(run_cmd(dataset(tmp / "malformed.jsonl", n), server.url,
                                       "--max-attempts", str(attempts)),
                               env(tmp / "malformed-data"), timeout=300)
        calls = server.calls()
    finally:
        server.stop()
    took = time.monotonic() - t0
    s = summary_of(done.stdout)
    failures = s.get("failures", {})
    ok = calls <= n * attempts and failures == {"server_error": n}
    return ok, (f"{calls} calls for {n} samples at max_attempts {attempts} (<= "
                f"{n * attempts}); the run ended in {took:.1f} s, exit {done.returncode}, "
                f"failures {failures}")


def check_n(tmp: Path) -> tuple[bool, str]:
    server = HostileProcess(tmp / "hostile-n.log", env())
    try:
        done = subprocess.run(run_cmd(dataset(tmp / "n.jsonl", 1), server.url,
                                      "--extra-body", '{"n": 100}'),
                              env=env(tmp / "n-data"), cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        calls = server.calls()
    finally:
        server.stop()
    lines = done.stderr.strip().splitlines()
    ok = done.returncode != 0 and len(lines) == 1 and calls == 0
    said = lines[0] if len(lines) == 1 else f"{len(lines)} lines: {done.stderr[-300:]!r}"
    return ok, f"exit {done.returncode}, {calls} calls, stderr: {said}"


def check_requeue(tmp: Path) -> tuple[bool, str]:
    from datetime import timedelta

    import httpx
    from sqlalchemy import update

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample

    (tmp / "requeue").mkdir(exist_ok=True)
    with chaos.cluster(tmp=tmp / "requeue") as c:
        sim = c.simulator("--latency", "0.05", "--capacity", "64")
        bad = chaos.create_job(["bad 1", "bad 2"], [sim.url], name="bad", inflight_limit=4)
        with session_scope() as s:
            ids = [i for (i,) in s.query(Sample.id).filter(Sample.job_id == bad)]
            s.execute(update(Sample).where(Sample.id == ids[0]).values(
                state="failed", error_class="timeout", error_message="a timeout"))
        api = ApiServer(c.tmp / "api.log", c.child_env(SYNTHQ_API_TOKEN=TOKEN,
                                                       SYNTHQ_ALLOWED_SERVERS="127.0.0.1"))
        c.procs.append(api)
        r = httpx.post(f"{api.url}/api/jobs/{bad}/requeue", json={"max_attempts": 10**12},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        detail = r.json().get("detail", "") if r.headers.get("content-type", "").startswith(
            "application/json") else r.text
        # What the API stored before its settings were bounded: that override on a
        # running sample whose lease has passed (the sweep's cast stopped every tick).
        past = utcnow() - timedelta(seconds=30)
        with session_scope() as s:
            s.execute(update(Sample).where(Sample.id == ids[1]).values(
                state="running", claim="gone", worker="gone@host", server=sim.url,
                attempts=1, started_at=past, expires_at=past,
                overrides={"max_attempts": 10**12}))
        n = 20
        canary = chaos.create_job(chaos.prompts(n, "canary"), [sim.url], name="canary",
                                  inflight_limit=8)
        c.worker(concurrency=8)
        c.beat()
        t0 = time.monotonic()
        try:
            chaos.wait_until(lambda: chaos.counts(canary)["done"] >= n, 90, "the canary done",
                             interval=0.25, logs=c.logs)
            moved = True
        except TimeoutError:
            moved = False
        took = time.monotonic() - t0
        done = chaos.counts(canary)["done"]
    ok = r.status_code == 422 and moved
    return ok, (f"requeue answered {r.status_code} ({str(detail)[:160]}); canary {done}/{n} "
                f"done in {took:.1f} s beside the stored 10**12")


def check_halfopen(tmp: Path) -> tuple[bool, str]:
    (tmp / "halfopen").mkdir(exist_ok=True)
    with chaos.cluster(tmp=tmp / "halfopen") as c:
        r = chaos.postgres_half_open(c)
    limit = r.figures["limit"]
    ok = r.recovery_s < 60 and r.lost == 0 and r.doubled <= limit and \
        r.extra_requests <= limit and r.figures["stranded"] >= 2
    return ok, (f"{r.figures['stranded']} connections stranded; moved again after "
                f"{r.recovery_s:.1f} s (< 60); lost {r.lost}; doubled {r.doubled}, extra "
                f"requests {r.extra_requests} (calls in flight <= {limit})")


def check_heartbeat(tmp: Path) -> tuple[bool, str]:
    """Issue 30 item 5: two workers, beat, --inflight 16, 300 samples; every connection
    stranded, then only the heartbeats' (``chaos.stranded_heartbeat``)."""
    figures = []
    ok = True
    for only in (False, True):
        where = tmp / f"heartbeat-{int(only)}"
        where.mkdir(exist_ok=True)
        with chaos.cluster(tmp=where) as c:
            r = chaos.stranded_heartbeat(c, heartbeat_only=only)
        limit = r.figures["limit"]
        twice = max(r.extra_requests, r.doubled)
        ok = ok and r.lost == 0 and (twice == 0 if only else twice <= limit)
        figures.append(f"{'heartbeat only' if only else 'every connection'}: "
                       f"{r.figures['stranded']} stranded, generated twice {r.extra_requests}, "
                       f"doubled {r.doubled}, lost {r.lost}")
    return ok, "; ".join(figures) + " (goal: <= 16, and 0 with the heartbeat only)"


def check_skew(tmp: Path) -> tuple[bool, str]:
    why = chaos.has_libfaketime()
    if why:
        return False, why
    (tmp / "skew").mkdir(exist_ok=True)
    with chaos.cluster(tmp=tmp / "skew") as c:
        r = chaos.clock_skew(c, offset="-120s")
    f = r.figures
    ok = abs(abs(f["skew_s"]) - 120) < 5 and r.lost == 0 and r.doubled == 0 and \
        r.extra_requests == 0 and f["max_active"] <= f["limit"]
    warned = any("behind" in w for w in f["status_warnings"])
    return ok, (f"clock {f['skew_s']:+.0f} s; answers paid twice {r.doubled}, extra requests "
                f"{r.extra_requests} ({f['planned_errors']} planned errors); max in flight "
                f"{f['max_active']} (limit {f['limit']}); lost {r.lost}; status warns: {warned}")


CHECKS: dict[str, tuple[str, Callable[[Path], tuple[bool, str]]]] = {
    "rss": ("1 a 3 GB error body", check_rss),
    "malformed": ("3 malformed stream chunks", check_malformed),
    "n": ('4 extra_body {"n": 100}', check_n),
    "requeue": ("7 requeue max_attempts 10**12", check_requeue),
    "halfopen": ("12 PostgreSQL half-open", check_halfopen),
    "heartbeat": ("12b a stranded heartbeat (issue 30)", check_heartbeat),
    "skew": ("14 a worker 120 s behind", check_skew),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(CHECKS))
    args = ap.parse_args()
    only = [x for x in args.only.split(",") if x] or list(CHECKS)
    unknown = set(only) - set(CHECKS)
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="synthq-check-hostile-") as root:
        for key in only:
            title, check = CHECKS[key]
            t0 = time.monotonic()
            try:
                ok, figures = check(Path(root))
            except Exception as exc:  # noqa: BLE001 - a check that crashes fails, the rest run
                ok, figures = False, f"crashed: {exc!r}"
                traceback.print_exc()
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {title}: {figures}  "
                  f"[{time.monotonic() - t0:.0f} s]", flush=True)
    print(f"{len(only) - failed}/{len(only)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Chaos benchmark: each issue-10 scenario once, with its own PostgreSQL and Redis processes.

Runs the scenarios of :mod:`synthq.testing.chaos` (the ones ``tests/chaos``
asserts on): a private PostgreSQL cluster (``initdb``, stopped and started)
and a private ``redis-server`` (killed, restarted empty) per scenario, real
Celery workers and beat, the simulator. Unlike the other benchmarks it needs no
shared PostgreSQL or Redis; it needs PostgreSQL's server binaries and
``redis-server`` (as root it runs PostgreSQL as the ``postgres`` user).

How to read the figures, per scenario:

* ``recovery_s``: what ``recovery`` says. For the database outage, from
  PostgreSQL's return until more samples were done than the answers held in
  memory (target < 15 s); for ``kill -9``, until none of the dead worker's
  running or queued samples was still held (target < 30 s); for SIGTERM,
  until the worker exited (target: the grace period); for the Redis restart,
  until every sample queued before it moved again (target < 60 s); for the
  hanging server and the payloads, the job's duration.
* ``lost``: samples not done at the end (0 everywhere: nothing is lost).
* ``doubled``: samples with more than one ``ok`` attempt (answers paid twice).
* ``extra_requests``: server requests beyond one per sample. Expected: the
  calls killed by ``kill -9`` (32), the hanging first calls of the SIGTERM run
  (8), the payload retries (12); zero for the outage and the broker wipe.

Issue 18's scenarios:

* ``overload``: 100 samples, default job settings, every call answered 503 +
  ``Retry-After: 5`` for 30 s (``/health`` 200). Recovery: from the end of the
  overload until every sample is done (target: all done; before, all failed).
  ``overload_answers``: the first wave (64) plus about one probe per 5 s.
* ``broker_refuses_writes``: Redis at ``maxmemory`` under ``noeviction`` for
  20 s mid-run. Recovery: from Redis accepting writes until every sample is
  done, on the same worker process (``worker_alive``; before, it exited).
* ``silent_worker``: a worker SIGSTOPped past its worker timeout (3 s) with its
  calls hanging, then SIGCONTed. Recovery: from SIGCONT until every sample is
  done; ``lost_rows`` must equal ``cut_calls`` (before: twice as many).
* ``disk_full``: ``synthq run`` on a 12 MB tmpfs that a filler file fills
  mid-run (needs root to mount; skipped otherwise). Recovery: from the volume
  filling until ``synthq run`` exited with its one line (target < 60 s);
  ``extra_requests``: at most the calls in flight (16) once the rerun finished.

Settings: the product's defaults for what each scenario measures (the 15 s
worker timeout, the 30 s queued deadline, a 30 s outage); dispatch and
heartbeat every 0.5 s; the SIGTERM grace 3 s (not the 60 s default).

    .venv/bin/python bench/chaos.py [--only dead_worker,broker_wipe] [--keep-logs]

Takes about 7 minutes. Ends with a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import REPO, summary

assert str(REPO) in sys.path

from synthq.testing import chaos  # noqa: E402


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    reason = chaos.unavailable()
    if reason:
        print(f"bench/chaos.py cannot run here: {reason}", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or list(chaos.SCENARIOS)
    unknown = set(names) - set(chaos.SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {list(chaos.SCENARIOS)}")
    # `timeout` and a closed terminal: run the clusters' cleanup (their `finally`).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    figures: dict[str, Any] = {}
    failed: list[str] = []
    for name in names:
        needs = chaos.REQUIRES.get(name)
        missing = needs() if needs else None
        if missing:
            print(f"[bench] {name} skipped: {missing}", file=sys.stderr)
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f"synthq-chaos-{name}-"))
        started = time.monotonic()
        try:
            with chaos.cluster(tmp=tmp) as cluster:
                try:
                    result = chaos.SCENARIOS[name](cluster)
                except Exception as exc:  # noqa: BLE001 - reported, the others still run
                    failed.append(name)
                    print(f"[bench] {name} FAILED after {time.monotonic() - started:.0f} s: "
                          f"{str(exc)[:2000]}", file=sys.stderr)
                    continue
        finally:
            if args.keep_logs:
                print(f"[bench] logs of {name} kept in {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        print(result.line(), flush=True)
        figures[name] = {"recovery_s": round(result.recovery_s, 1), "lost": result.lost,
                         "doubled": result.doubled, "extra_requests": result.extra_requests,
                         **{k: round(v, 1) if isinstance(v, float) else v
                            for k, v in result.figures.items()
                            if isinstance(v, int | float) and not isinstance(v, bool)}}
    summary("chaos", {"scenarios": figures, "failed": failed})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

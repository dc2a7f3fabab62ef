"""The seed's scenario, 60x compressed: synthq against a plain asyncio script, in one run.

A simulated server that serves 128 requests at once (``--capacity 128``),
2,000 prompts, 40-word answers streamed at 80 tokens/s. Three runs against the
same simulator, one after the other (its counters reset in between):

1. **script, non-streaming**: ``bench/plain_asyncio.py`` (asyncio + openai,
   semaphore 128, retries, append-as-you-go): what users run today;
2. **script, streaming**: the same script with ``stream=True`` through the
   openai client: like for like, since synthq streams;
3. **synthq**: a job with ``--inflight 128``, one ``celery worker -c 128``
   (synthq's worker), beat, PostgreSQL and Redis.

Figures per run: done/s end to end (first request to last answer) and steady
(10th-90th percentile of completion times), CPU per sample over every process
but the server's (the script alone; for synthq the worker, beat, every
PostgreSQL backend and Redis), and the most requests the server saw at once.
Ratios: synthq / streaming script (the like-for-like goal: done/s >= 0.9x,
CPU per sample <= 1.5x) and synthq / non-streaming script.

``--runs N`` repeats the three runs N times, interleaved (the order alternates
between rounds), and prints each figure and each ratio as median (min-max)
over the rounds; ratios are taken within a round. ``--no-stream`` makes
synthq's job non-streaming (``synthq enqueue/run --no-stream``: compare it with
the non-streaming script). ``--mode embedded`` runs ``synthq run`` (one
process, its own SQLite file, no broker; CPU and wall time from the server's
first request, as the script's are counted after its imports) instead of the
worker and beat; ``--mode distributed,embedded`` runs both.

Run: ``python bench/seed_scenario.py`` (``--samples``, ``--concurrency``,
``--tokens-per-second``, ``--response-tokens``, ``--runs``, ``--no-stream``,
``--mode``, ``--skip-scripts``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from _harness import (
    REPO,
    Bench,
    cpu_seconds,
    create_job,
    done_times,
    prompts,
    service_cpu_seconds,
    summary,
    wait_done,
    wait_until,
    window_rate,
)


def run_script(sim_url: str, n: int, concurrency: int, stream: bool) -> dict[str, float]:
    cmd = [sys.executable, str(REPO / "bench" / "plain_asyncio.py"), "--url", sim_url,
           "--n", str(n), "--concurrency", str(concurrency), "--tag", "bench"]
    if stream:
        cmd.append("--stream")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_embedded(b: Bench, sim: Any, n: int, concurrency: int, stream: bool,
                 timeout: float) -> dict[str, float]:
    """``synthq run`` as users run it: one process, its SQLite file, no broker.

    CPU and wall time are counted from the server's first request (the script's
    are counted after its imports too), so the import and enqueue cost is left out.
    """
    run_dir = b.tmp / f"embedded-{time.monotonic_ns()}"
    run_dir.mkdir()
    dataset = run_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                               for p in prompts(n)))
    env = b.child_env()
    for key in ("SYNTHQ_BROKER_URL", "SYNTHQ_DATABASE_URL"):
        env.pop(key, None)
    env["SYNTHQ_DATA_DIR"] = str(run_dir / "data")
    cmd = [sys.executable, "-m", "synthq.cli", "run", "--dataset", str(dataset), "--server",
           sim.url, "--model", "sim-model", "--inflight", str(concurrency), "--max-tokens", "256",
           "--job", "seed-embedded", "--json", "--stream" if stream else "--no-stream"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + timeout
    cpu0 = None
    while cpu0 is None and proc.poll() is None:
        if sim.stats().get("requests", 0) > 0:
            cpu0 = cpu_seconds(proc.pid)
        else:
            time.sleep(0.01)
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("synthq run did not start calling the server")
    cpu1 = cpu0 or 0.0
    while proc.poll() is None:  # the last reading before it exits
        cpu1 = cpu_seconds(proc.pid)
        time.sleep(0.02)
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("synthq run did not finish")
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"synthq run exited {proc.returncode}: {err[-2000:]}")
    import sqlite3

    db = sqlite3.connect(run_dir / "data" / "synthq.db")
    try:
        first = db.execute("SELECT min(started_at) FROM attempts").fetchone()[0]
        rows = db.execute("SELECT finished_at FROM samples WHERE state = 'done' "
                          "ORDER BY finished_at").fetchall()
        failed = db.execute("SELECT count(*) FROM samples WHERE state = 'failed'").fetchone()[0]
    finally:
        db.close()
    from datetime import datetime

    def ts(v: str) -> float:
        return datetime.fromisoformat(v).timestamp()

    times = [ts(r[0]) for r in rows]
    wall = times[-1] - ts(first)
    steady, _ = window_rate(times)
    cpu = cpu1 - (cpu0 or 0.0)
    return {"done": len(times), "failed": failed, "wall_s": wall,
            "done_per_s": len(times) / wall, "steady_done_per_s": steady, "cpu_s": cpu,
            "cpu_ms_per_sample": 1000 * cpu / max(1, len(times)),
            "max_active": sim.stats()["max_active"]}


def run_distributed(b: Bench, sim: Any, n: int, concurrency: int, stream: bool,
                    timeout: float, index: int) -> dict[str, float]:
    """One job on a Celery worker ``-c concurrency`` and beat (both started for it)."""
    from synthq.jobs.enqueue import JobSpec

    worker = b.worker(concurrency)
    beat = b.beat()
    procs = [worker, beat]
    try:
        b.wait_ready([worker])

        def registered() -> bool:
            from sqlalchemy import func, select

            from synthq.store.db import session_scope
            from synthq.store.models import Worker

            with session_scope() as s:
                return bool(s.scalar(select(func.count()).select_from(Worker)))

        wait_until(registered, 30, "the worker's row", procs=[worker])
        time.sleep(1.0)  # beat's first ticks
        spec = JobSpec(name=f"seed-scenario-{index}", model="sim-model", servers=[sim.url],
                       inflight_limit=concurrency, max_tokens=256, stream=stream)

        def cpu_now() -> dict[str, float]:
            return {"worker": cpu_seconds(worker.pid), "beat": cpu_seconds(beat.pid),
                    "postgres": service_cpu_seconds("postgres"),
                    "redis": service_cpu_seconds("redis-server")}

        cpu0 = cpu_now()
        t0 = time.time()
        report = create_job(spec, prompts(n, tag=f"bench{index}"))
        c = wait_done(report.job_id, n, timeout, procs=[*procs, sim], bench=b)
        times = done_times(report.job_id)
        wall = times[-1] - t0
        first = times[0] - t0
        cpu1 = cpu_now()
    finally:
        for p in procs:
            p.stop()
            b.procs.remove(p)
    with contextlib.suppress(Exception):  # the next run's worker registers anew
        from sqlalchemy import delete

        from synthq.store.db import session_scope
        from synthq.store.models import Worker

        with session_scope() as s:
            s.execute(delete(Worker))
    parts = {k: 1000 * (cpu1[k] - cpu0[k]) / max(1, c["done"]) for k in cpu0}
    cpu = sum(cpu1.values()) - sum(cpu0.values())
    steady, _ = window_rate(times)
    return {"done": c["done"], "failed": c["failed"], "wall_s": wall, "first_done_s": first,
            "done_per_s": c["done"] / wall, "steady_done_per_s": steady, "cpu_s": cpu,
            "cpu_ms_per_sample": 1000 * cpu / max(1, c["done"]),
            **{f"{k}_cpu_ms_per_sample": v for k, v in parts.items()},
            "max_active": sim.stats()["max_active"]}


def _stats(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
            if len(values) > 1 else f"{values[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens-per-second", type=float, default=80)
    ap.add_argument("--response-tokens", type=int, default=40)
    ap.add_argument("--redis-db", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--runs", type=int, default=1,
                    help="rounds of (scripts, synthq), interleaved; figures: median (min-max)")
    ap.add_argument("--no-stream", action="store_true",
                    help="synthq's job does not stream (compare with the plain script)")
    ap.add_argument("--mode", default="distributed",
                    help="synthq as: distributed (worker + beat), embedded (`synthq run`), "
                    "or both, comma-separated")
    ap.add_argument("--skip-scripts", action="store_true", help="run synthq only")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if not modes or set(modes) - {"distributed", "embedded"}:
        ap.error("--mode takes distributed, embedded or both (comma-separated)")
    stream = not args.no_stream

    runs: list[dict[str, dict[str, float]]] = []
    with Bench("seed_scenario", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", "0", "--capacity", str(args.concurrency),
                          "--tokens-per-second", str(args.tokens_per_second),
                          "--response-tokens", str(args.response_tokens))
        for index in range(args.runs):
            results: dict[str, dict[str, float]] = {}
            order: list[str] = [] if args.skip_scripts else ["script", "script_stream"]
            order += [f"synthq_{m}" for m in modes]
            if index % 2:  # alternate who goes first: a load change hits both sides
                order.reverse()
            for name in order:
                sim.http.post("/sim/reset")
                if name.startswith("script"):
                    r = run_script(sim.url, args.samples, args.concurrency,
                                   name == "script_stream")
                    r["max_active"] = sim.stats()["max_active"]
                    r["done_per_s"] = r["done"] / r["wall_s"]
                    r["cpu_ms_per_sample"] = 1000 * r["cpu_s"] / max(1, r["done"])
                elif name == "synthq_embedded":
                    r = run_embedded(b, sim, args.samples, args.concurrency, stream,
                                     args.timeout)
                else:
                    r = run_distributed(b, sim, args.samples, args.concurrency, stream,
                                        args.timeout, index)
                results[name] = r
                print(f"[bench] run {index + 1}/{args.runs} {name}: "
                      f"{json.dumps({k: round(v, 2) for k, v in r.items()})}", file=sys.stderr)
            runs.append(results)
        alarms = b.report_alarms()

    names = list(runs[0])
    print(f"synthq's job streams: {stream}; {args.runs} run(s); median (min-max)")
    print(f"{'run':<19} {'done/s':>22} {'steady/s':>22} {'CPU ms/sample':>22}")
    figures: dict[str, object] = {"stream": stream, "runs": args.runs}
    for name in names:
        col = {k: [r[name][k] for r in runs] for k in
               ("done_per_s", "steady_done_per_s", "cpu_ms_per_sample")}
        print(f"{name:<19} {_stats(col['done_per_s']):>22} {_stats(col['steady_done_per_s']):>22}"
              f" {_stats(col['cpu_ms_per_sample']):>22}")
        figures[name] = {k: round(statistics.median(v), 2) for k, v in col.items()}
        if name == "synthq_distributed":
            print("  CPU ms/sample by process (median): " + ", ".join(
                f"{k} {statistics.median(r[name][f'{k}_cpu_ms_per_sample'] for r in runs):.2f}"
                for k in ("worker", "beat", "postgres", "redis")))
        if name.startswith("synthq"):
            all_done = all(r[name]["done"] == args.samples for r in runs)
            print(f"  all {args.samples} done in every run: {all_done}")
    for name in (n for n in names if n.startswith("synthq")):
        for peer in ("script_stream", "script"):
            if peer not in names:
                continue
            per_run = {
                "done_per_s": [r[name]["done_per_s"] / r[peer]["done_per_s"] for r in runs],
                "steady_done_per_s": [r[name]["steady_done_per_s"] / r[peer]["steady_done_per_s"]
                                      for r in runs],
                "cpu_per_sample": [r[name]["cpu_ms_per_sample"] / r[peer]["cpu_ms_per_sample"]
                                   for r in runs]}
            print(f"{name} / {peer:<13}: done/s {_stats(per_run['done_per_s'])}x  steady "
                  f"{_stats(per_run['steady_done_per_s'])}x  CPU per sample "
                  f"{_stats(per_run['cpu_per_sample'])}x")
            figures[f"{name}_vs_{peer}"] = {
                k: [round(x, 2) for x in v] for k, v in per_run.items()}
    figures["log_alarms"] = len(alarms)
    summary("seed_scenario", figures)

if __name__ == "__main__":
    main()

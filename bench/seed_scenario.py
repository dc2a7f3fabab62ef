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

Run: ``python bench/seed_scenario.py`` (``--samples``, ``--concurrency``,
``--tokens-per-second``, ``--response-tokens``, ``--skip-scripts``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens-per-second", type=float, default=80)
    ap.add_argument("--response-tokens", type=int, default=40)
    ap.add_argument("--redis-db", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--skip-scripts", action="store_true", help="run synthq only")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.enqueue import JobSpec

    results: dict[str, dict[str, float]] = {}
    with Bench("seed_scenario", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", "0", "--capacity", str(args.concurrency),
                          "--tokens-per-second", str(args.tokens_per_second),
                          "--response-tokens", str(args.response_tokens))
        if not args.skip_scripts:
            for name, stream in (("script", False), ("script_stream", True)):
                sim.http.post("/sim/reset")
                r = run_script(sim.url, args.samples, args.concurrency, stream)
                r["max_active"] = sim.stats()["max_active"]
                r["done_per_s"] = r["done"] / r["wall_s"]
                r["cpu_ms_per_sample"] = 1000 * r["cpu_s"] / max(1, r["done"])
                results[name] = r
                print(f"[bench] {name}: {json.dumps(r)}", file=sys.stderr)

        sim.http.post("/sim/reset")
        worker = b.worker(args.concurrency)
        beat = b.beat()
        b.wait_ready([worker])

        def registered() -> bool:
            from sqlalchemy import func, select

            from synthq.db import session_scope
            from synthq.models import Worker

            with session_scope() as s:
                return bool(s.scalar(select(func.count()).select_from(Worker)))

        wait_until(registered, 30, "the worker's row", procs=[worker])
        time.sleep(1.0)  # beat's first ticks
        spec = JobSpec(name="seed-scenario", model="sim-model", servers=[sim.url],
                       inflight_limit=args.concurrency, max_tokens=256)
        procs = [worker, beat]

        def cpu_now() -> dict[str, float]:
            return {"worker": cpu_seconds(worker.pid), "beat": cpu_seconds(beat.pid),
                    "postgres": service_cpu_seconds("postgres"),
                    "redis": service_cpu_seconds("redis-server")}

        cpu0 = cpu_now()
        t0 = time.time()
        report = create_job(spec, prompts(args.samples))
        c = wait_done(report.job_id, args.samples, args.timeout, procs=[*procs, sim], bench=b)
        times = done_times(report.job_id)
        wall = times[-1] - t0
        cpu1 = cpu_now()
        parts = {k: 1000 * (cpu1[k] - cpu0[k]) / max(1, c["done"]) for k in cpu0}
        cpu = sum(cpu1.values()) - sum(cpu0.values())
        steady, _ = window_rate(times)
        results["synthq"] = {
            "done": c["done"], "failed": c["failed"], "wall_s": wall,
            "done_per_s": c["done"] / wall, "steady_done_per_s": steady, "cpu_s": cpu,
            "cpu_ms_per_sample": 1000 * cpu / max(1, c["done"]),
            **{f"{k}_cpu_ms_per_sample": v for k, v in parts.items()},
            "max_active": sim.stats()["max_active"]}
        alarms = b.report_alarms()

    print(f"{'run':<15} {'done':>5} {'done/s':>8} {'steady/s':>9} {'CPU ms/sample':>14} "
          f"{'max in flight':>14}")
    for name, r in results.items():
        print(f"{name:<15} {r['done']:>5.0f} {r['done_per_s']:>8.1f} "
              f"{r['steady_done_per_s']:>9.1f} {r['cpu_ms_per_sample']:>14.2f} "
              f"{r['max_active']:>14.0f}")
    figures: dict[str, object] = {
        name: {k: round(v, 2) for k, v in r.items()} for name, r in results.items()}
    s = results["synthq"]
    for peer in ("script_stream", "script"):
        if peer in results:
            p = results[peer]
            ratios = {"done_per_s": s["done_per_s"] / p["done_per_s"],
                      "steady_done_per_s": s["steady_done_per_s"] / p["steady_done_per_s"],
                      "cpu_per_sample": s["cpu_ms_per_sample"] / p["cpu_ms_per_sample"]}
            print(f"synthq / {peer:<13}: done/s {ratios['done_per_s']:.2f}x  steady "
                  f"{ratios['steady_done_per_s']:.2f}x  CPU per sample "
                  f"{ratios['cpu_per_sample']:.2f}x")
            figures[f"vs_{peer}"] = {k: round(v, 2) for k, v in ratios.items()}
    print("synthq CPU ms/sample by process: " + ", ".join(
        f"{k} {s[f'{k}_cpu_ms_per_sample']:.2f}" for k in ("worker", "beat", "postgres", "redis"))
        + f"; all {args.samples} done: {s['done'] == args.samples}")
    figures["log_alarms"] = len(alarms)
    summary("seed_scenario", figures)


if __name__ == "__main__":
    main()

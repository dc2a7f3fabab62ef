"""Worker memory and CPU with 128 slow streams in flight.

Setup: a fresh PostgreSQL database, Redis db 11, the simulator with
``--latency 0 --tokens-per-second 5 --response-tokens 100 --capacity 256``
(each answer streams 100 chunks over ~20 s, so requests stay open), one job
with ``inflight_limit`` 128 and 128 samples, one real Celery worker (threads
pool, ``-c 128``) and beat.

Steps:

1. start the worker and beat, wait for the worker's ``ready.``, sample its RSS
   for ~2 s: the **idle RSS**;
2. insert the samples, wait until the simulator's ``active`` gauge reaches 128
   (every request open at once), then sample the worker's RSS (VmRSS of the
   worker process plus any children, from /proc/<pid>/status) every 0.5 s for
   ``--sample-seconds`` (5 s): **RSS at 128 in flight** (max and mean), and the
   worker's CPU% over that window (utime + stime delta ÷ wall; 100 % = one
   core). Those 5 s stream 128 × 5 = 640 chunks/s, so CPU% ÷ 640 is the
   worker's CPU per streamed chunk;
3. cancel the job and stop the processes (the remaining streams are cut).

Figures printed: idle RSS MiB, in-flight RSS MiB (max, mean), the growth per
request in flight (KiB), worker threads, CPU % and µs per chunk, and the
simulator's ``max_active`` (must be <= 128).

Run: ``python bench/worker_rss.py`` (options: ``--inflight``, ``--concurrency``,
``--tokens-per-second``, ``--response-tokens``, ``--sample-seconds``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _harness import (
    Bench,
    counts,
    cpu_seconds,
    create_job,
    prompts,
    rss_kb,
    set_job_state,
    summary,
    thread_count,
    wait_until,
)


def sample_rss(pid: int, seconds: float, every: float = 0.5) -> list[int]:
    out = []
    end = time.monotonic() + seconds
    while True:
        out.append(rss_kb(pid))
        if time.monotonic() >= end:
            return out
        time.sleep(every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inflight", type=int, default=128, help="job inflight_limit = samples")
    ap.add_argument("--concurrency", type=int, default=128, help="worker threads (-c)")
    ap.add_argument("--tokens-per-second", type=float, default=5.0)
    ap.add_argument("--response-tokens", type=int, default=100)
    ap.add_argument("--sample-seconds", type=float, default=5.0)
    ap.add_argument("--redis-db", type=int, default=11)
    ap.add_argument("--timeout", type=float, default=60, help="wait this long for full load")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.jobs.enqueue import JobSpec

    target = args.inflight
    with Bench("worker_rss", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", "0", "--tokens-per-second", str(args.tokens_per_second),
                          "--response-tokens", str(args.response_tokens), "--capacity", "256")
        worker = b.worker(args.concurrency)
        beat = b.beat()
        b.wait_ready([worker])
        time.sleep(1.0)
        idle = sample_rss(worker.pid, 2.0)
        idle_threads = thread_count(worker.pid)

        spec = JobSpec(name="worker-rss", model="sim-model", servers=[sim.url],
                       inflight_limit=args.inflight, max_tokens=args.response_tokens + 50)
        t0 = time.monotonic()
        report = create_job(spec, prompts(target, "rss"))
        wait_until(lambda: sim.stats()["active"] >= target, args.timeout,
                   f"simulator active == {target}", interval=0.1, procs=[worker, beat, sim])
        ramp = time.monotonic() - t0
        c_cpu0, w0 = cpu_seconds(worker.pid), time.monotonic()
        loaded = sample_rss(worker.pid, args.sample_seconds)
        cpu = cpu_seconds(worker.pid) - c_cpu0
        wall = time.monotonic() - w0
        active_after = sim.stats()["active"]
        loaded_threads = thread_count(worker.pid)
        c = counts(report.job_id)
        stats = sim.stats()
        set_job_state(report.job_id, "cancelled")
        alarms = b.report_alarms()

    idle_mib = max(idle) / 1024
    peak_mib = max(loaded) / 1024
    mean_mib = statistics.mean(loaded) / 1024
    cpu_pct = 100 * cpu / wall
    chunks_per_s = target * args.tokens_per_second
    us_per_chunk = 1e6 * cpu / (chunks_per_s * wall) if chunks_per_s else 0.0
    growth_kib = (max(loaded) - max(idle)) / target
    print(f"in flight         {target}  (simulator active {active_after} after sampling; "
          f"max_active {stats['max_active']}; ramp {ramp:.1f} s)")
    print(f"worker threads    idle {idle_threads}, loaded {loaded_threads}")
    print(f"idle RSS          {idle_mib:.1f} MiB")
    print(f"RSS at {target:<3d}        {peak_mib:.1f} MiB max, {mean_mib:.1f} MiB mean "
          f"(+{growth_kib:.0f} KiB per request in flight)")
    print(f"worker CPU        {cpu_pct:.1f} % of a core over {wall:.1f} s "
          f"(~{chunks_per_s:.0f} chunks/s -> {us_per_chunk:.0f} us/chunk)")
    print("sample states     " + " ".join(f"{k}={v}" for k, v in c.items() if v))
    summary("worker_rss", {
        "inflight": target, "concurrency": args.concurrency,
        "idle_rss_mib": round(idle_mib, 1), "loaded_rss_mib_max": round(peak_mib, 1),
        "loaded_rss_mib_mean": round(mean_mib, 1), "kib_per_request": round(growth_kib),
        "worker_cpu_pct": round(cpu_pct, 1), "us_per_chunk": round(us_per_chunk),
        "threads_idle": idle_threads, "threads_loaded": loaded_threads,
        "max_active": stats["max_active"], "ramp_s": round(ramp, 1),
        "log_alarms": len(alarms)})


if __name__ == "__main__":
    main()

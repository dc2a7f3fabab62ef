"""Orchestration throughput: samples/s and worker CPU per sample when the server costs ~nothing.

Setup: a fresh PostgreSQL database, Redis db 13, the simulator with
``--latency 0 --response-tokens 8`` (an 8-word streamed answer, sent at once),
one job with ``inflight_limit`` 64, ``--workers`` real Celery workers (threads
pool, ``-c 64`` each) and beat; 3,000 samples are inserted and the script waits
until all are done.

With a server that answers at once, what is left is synthq's own work per
sample: the claim, the HTTP call and stream parsing, recording the result, the
dispatch that refills the slot, the broker round trip, Celery's own bookkeeping.

Figures printed:

* ``samples_per_s``: samples / (insert to last done), end to end; ``steady_per_s``
  the rate between the 10th and 90th percentile of ``finished_at``.
* ``worker_cpu_ms_per_sample``: utime + stime of the worker processes (from
  /proc/<pid>/stat, before and after) ÷ samples: the orchestration overhead.
  One core is 1000 ms/s, so 1000 / this is the most one worker process can
  do per second, GIL-bound, whatever the server.
* ``beat_cpu_ms_per_sample`` and ``sim_cpu_ms_per_sample`` for context (on a
  2-core machine all of them share the cores).

Run: ``python bench/throughput.py`` (options: ``--samples``, ``--workers``,
``--concurrency``, ``--limit``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import time

from _harness import (
    Bench,
    cpu_seconds,
    create_job,
    done_times,
    prompts,
    summary,
    wait_done,
    window_rate,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=1, help="worker processes")
    ap.add_argument("--concurrency", type=int, default=64, help="threads per worker (-c)")
    ap.add_argument("--limit", type=int, default=64, help="job inflight_limit")
    ap.add_argument("--response-tokens", type=int, default=8)
    ap.add_argument("--redis-db", type=int, default=13)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.jobs.enqueue import JobSpec

    with Bench("throughput", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", "0", "--response-tokens", str(args.response_tokens),
                          "--capacity", str(max(256, args.limit)))
        workers = [b.worker(args.concurrency) for _ in range(args.workers)]
        beat = b.beat()
        b.wait_ready(workers)
        spec = JobSpec(name="throughput", model="sim-model", servers=[sim.url],
                       inflight_limit=args.limit, max_tokens=64)
        watched = [*workers, beat, sim]
        cpu0 = {p.name: cpu_seconds(p.pid) for p in watched}
        t0 = time.time()
        report = create_job(spec, prompts(args.samples, "tp"))
        c = wait_done(report.job_id, args.samples, args.timeout, procs=watched, bench=b)
        wall = time.time() - t0
        cpu = {p.name: cpu_seconds(p.pid) - cpu0[p.name] for p in watched}
        stats = sim.stats()
        times = done_times(report.job_id)
        steady, window = window_rate(times)
        alarms = b.report_alarms()

    n = max(1, c["done"])
    worker_cpu = sum(v for k, v in cpu.items() if k.startswith("w"))
    per = 1000 * worker_cpu / n
    rate = c["done"] / wall
    print(f"samples           {args.samples}  (done {c['done']}, failed {c['failed']})")
    print(f"workers           {args.workers} x -c {args.concurrency}, limit {args.limit}")
    print(f"end to end        {rate:.1f} samples/s  ({wall:.1f} s insert to last done)")
    print(f"steady            {steady:.1f} samples/s  (10th-90th percentile, {window:.1f} s)")
    print(f"worker CPU        {worker_cpu:.1f} s = {per:.2f} ms/sample "
          f"({100 * worker_cpu / wall:.0f} % of one core)")
    print(f"beat CPU          {1000 * cpu['beat'] / n:.2f} ms/sample")
    print(f"simulator CPU     {1000 * cpu['simulator'] / n:.2f} ms/sample")
    print(f"max_active        {stats['max_active']}  (limit {args.limit})")
    summary("throughput", {
        "samples": args.samples, "done": c["done"], "failed": c["failed"],
        "workers": args.workers, "concurrency": args.concurrency, "limit": args.limit,
        "samples_per_s": round(rate, 1), "steady_per_s": round(steady, 1),
        "wall_s": round(wall, 1), "worker_cpu_ms_per_sample": round(per, 2),
        "worker_cpu_pct_of_core": round(100 * worker_cpu / wall),
        "beat_cpu_ms_per_sample": round(1000 * cpu["beat"] / n, 2),
        "sim_cpu_ms_per_sample": round(1000 * cpu["simulator"] / n, 2),
        "max_active": stats["max_active"], "log_alarms": len(alarms)})


if __name__ == "__main__":
    main()

"""Little's-law efficiency of the Celery path: how close to limit / latency it runs.

Setup: a fresh PostgreSQL database, Redis db 14, the simulator answering every
request after ``--latency`` seconds (default 0.5 s, capacity 256, the default
32-word answer sent at once), one job with ``inflight_limit`` 64, one real
Celery worker (threads pool, ``-c 64``) and beat. Then 2,000 samples are
inserted and the script waits until all are done.

By Little's law a server kept at exactly L requests in flight, each taking W
seconds, completes L / W per second: 64 / 0.5 s = 128/s. Whatever the queue
adds between one request's end and the next one's start (recording the result,
dispatching, the broker round trip, claiming) lowers the rate.

Figures printed:

* ``steady_done_per_s``: done/s between the 10th and 90th percentile of the
  samples' ``finished_at`` (ramp-up and tail excluded); ``first_to_last`` is the
  same from the first to the last done sample.
* ``efficiency_pct``: steady done/s ÷ (limit / latency). 100 % is the ceiling;
  the reference measured here for bare Celery sleep tasks is ~96 %.
* ``max_active``: the simulator's peak of concurrent requests: must be <= the
  limit (invariant 5), else the limit was broken.
* ``wall_s``: insert of the samples to the last done.
* ``worker_cpu_s``: CPU the worker process used during the run.

Run: ``python bench/littles_law.py`` (options: ``--samples``, ``--latency``,
``--limit``, ``--concurrency``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import sys
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


def cycle_gaps(job_id: int) -> dict[str, float]:
    """Medians (ms) of where a sample's time goes outside the server: queued -> claimed
    (the broker and the claim), claimed -> call end minus the latency (the HTTP call's own
    overhead), call end -> committed (the batch writer)."""
    import statistics

    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    with session_scope() as s:
        rows = s.execute(select(Sample.queued_at, Sample.started_at, Attempt.started_at,
                                Attempt.ended_at, Attempt.latency_s, Sample.finished_at)
                         .join(Attempt, Attempt.sample_id == Sample.id)
                         .where(Sample.job_id == job_id, Attempt.outcome == "ok")).all()
    if not rows:
        return {}

    def ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    return {"queued->claimed": ms([(r[1] - r[0]).total_seconds() for r in rows]),
            "call": ms([r[4] for r in rows]),
            "call end->committed": ms([(r[5] - r[3]).total_seconds() for r in rows])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--latency", type=float, default=0.5, help="simulator latency, s")
    ap.add_argument("--capacity", type=int, default=256, help="simulator capacity")
    ap.add_argument("--limit", type=int, default=64, help="job inflight_limit")
    ap.add_argument("--concurrency", type=int, default=64,
                    help="worker threads (-c), split over --workers processes")
    ap.add_argument("--workers", type=int, default=1, help="worker processes")
    ap.add_argument("--redis-db", type=int, default=14)
    ap.add_argument("--timeout", type=float, default=300, help="give up after this many s")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.jobs.enqueue import JobSpec

    ideal = args.limit / args.latency if args.latency > 0 else float("inf")
    with Bench("littles_law", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", str(args.latency), "--capacity", str(args.capacity))
        workers = [b.worker(max(1, args.concurrency // args.workers))
                   for _ in range(args.workers)]
        beat = b.beat()
        b.wait_ready(workers)
        spec = JobSpec(name="littles-law", model="sim-model", servers=[sim.url],
                       inflight_limit=args.limit, max_tokens=256)
        cpu0 = sum(cpu_seconds(w.pid) for w in workers)
        t0 = time.time()
        report = create_job(spec, prompts(args.samples, "ll"))
        c = wait_done(report.job_id, args.samples, args.timeout, procs=[*workers, beat, sim],
                      bench=b)
        wall = time.time() - t0
        cpu = sum(cpu_seconds(w.pid) for w in workers) - cpu0
        stats = sim.stats()
        gaps = cycle_gaps(report.job_id)
        times = done_times(report.job_id)
        steady, window = window_rate(times)
        overall, span = window_rate(times, 0.0, 1.0)
        eff = 100 * steady / ideal
        alarms = b.report_alarms()

    print(f"samples           {args.samples}  (done {c['done']}, failed {c['failed']})")
    print(f"ideal rate        {ideal:.1f}/s  (limit {args.limit} / latency {args.latency} s)")
    print(f"steady done/s     {steady:.1f}/s  (10th-90th percentile, {window:.1f} s window)")
    print(f"first-to-last     {overall:.1f}/s  over {span:.1f} s")
    print(f"efficiency        {eff:.1f} %")
    print(f"max_active        {stats['max_active']}  (limit {args.limit}; "
          f"{'OK' if stats['max_active'] <= args.limit else 'LIMIT EXCEEDED'})")
    print(f"sim requests      {stats['requests']}  completed {stats['completed']}")
    print(f"wall time         {wall:.1f} s  (insert to last done)")
    print(f"workers           {args.workers} x -c {max(1, args.concurrency // args.workers)}")
    print(f"worker CPU        {cpu:.1f} s  ({1000 * cpu / max(1, c['done']):.1f} ms/sample)")
    print("per sample, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in gaps.items()))
    summary("littles_law", {
        "samples": args.samples, "workers": args.workers, "done": c["done"], "failed": c["failed"],
        "ideal_per_s": round(ideal, 1), "steady_done_per_s": round(steady, 1),
        "first_to_last_per_s": round(overall, 1), "efficiency_pct": round(eff, 1),
        "max_active": stats["max_active"], "limit": args.limit,
        "sim_requests": stats["requests"], "wall_s": round(wall, 1),
        "worker_cpu_s": round(cpu, 1), "log_alarms": len(alarms)})
    sys.exit(0)


if __name__ == "__main__":
    main()

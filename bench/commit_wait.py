"""How long a finished answer waits for its commit (the batch writer, DESIGN: <= 50 ms).

An answer that has arrived but is not committed is lost at a ``kill -9`` and paid
for again: at a kill of a worker mid-run (2 workers, limit 32, 0.1 s answers) 17
of the 29 calls lost had been answered in full (issue 24). Each worker measures,
for every answer, the time from its last byte to the commit of the write that
stores it (``synthq.serving.writer.Writer.wait_figures``) and logs the figures when it
stops; this script runs that load and prints them.

Setup: a fresh PostgreSQL database, Redis db 12, the simulator with ``--latency
0.1``, one job with ``inflight_limit`` 32, ``--workers`` real Celery workers
(``-c 32``) and beat; ``--samples`` samples; then the workers are stopped
(SIGTERM) and their log lines read. ``--hog N`` keeps N busy-looping processes
running meanwhile (load).

Run: ``python bench/commit_wait.py [--samples 3000] [--workers 2] [--hog 2]``.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

from _harness import Bench, create_job, prompts, summary, wait_done

_LINE = re.compile(r"writer: (\d+) answers waited for their commit: median ([0-9.]+) ms, "
                   r"p95 ([0-9.]+) ms, p99 ([0-9.]+) ms, max ([0-9.]+) ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes meanwhile")
    ap.add_argument("--redis-db", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.jobs.enqueue import JobSpec

    hogs: list[subprocess.Popen[bytes]] = []
    with Bench("commit_wait", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", str(args.latency), "--capacity", "256")
        workers = [b.worker(args.limit) for _ in range(args.workers)]
        beat = b.beat()
        b.wait_ready(workers)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.hog)]
        try:
            spec = JobSpec(name="commit-wait", model="sim-model", servers=[sim.url],
                           inflight_limit=args.limit, max_tokens=64)
            t0 = time.time()
            report = create_job(spec, prompts(args.samples, "cw"))
            c = wait_done(report.job_id, args.samples, args.timeout,
                          procs=[*workers, beat, sim], bench=b)
            wall = time.time() - t0
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        for w in workers:  # a warm shutdown: each logs its figures as it closes
            w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.proc.wait(60)
        found = [m for w in workers for m in _LINE.finditer(w.log())]
    if not found:
        sys.exit("no worker logged its commit waits (see --keep-logs)")
    figures = [tuple(float(g) for g in m.groups()) for m in found]
    worst = max(figures, key=lambda f: f[3])
    print(f"samples        {args.samples} (done {c['done']}) in {wall:.1f} s = "
          f"{c['done'] / wall:.0f}/s; {args.workers} workers, limit {args.limit}, "
          f"{args.latency:g} s answers, {args.hog} CPU hogs")
    for i, (n, p50, p95, p99, mx) in enumerate(figures):
        print(f"worker {i}       {int(n)} answers: commit wait median {p50:.1f} ms, "
              f"p95 {p95:.1f} ms, p99 {p99:.1f} ms, max {mx:.1f} ms")
    summary("commit_wait", {"samples": args.samples, "done": c["done"], "hog": args.hog,
                            "per_s": round(c["done"] / wall), "workers": args.workers,
                            "limit": args.limit, "worst_p50_ms": max(f[1] for f in figures),
                            "worst_p95_ms": max(f[2] for f in figures),
                            "worst_p99_ms": worst[3], "max_ms": max(f[4] for f in figures)})


if __name__ == "__main__":
    main()

"""Every turn regenerated (``--regenerate all``): done turns/s against Little's law.

Setup as ``bench/littles_law.py``: a fresh PostgreSQL database, Redis db 14, the
simulator answering after ``--latency`` seconds (default 0.5 s, capacity 256),
one real Celery worker (threads pool, ``-c 64``) and beat. Two jobs run one
after the other, each with ``inflight_limit`` 64:

* ``single``: ``3 × --conversations`` one-turn prompts (the reference, measured
  in the same run on the same machine);
* ``turns``: ``--conversations`` rows of three user/assistant exchanges with
  ``regenerate=all``: each answered turn sends the sample back to ``pending``
  for its next turn, so the turns of different conversations interleave.

The same number of calls either way. By Little's law a server kept at L calls
in flight, each W seconds long, answers L / W per second: 64 / 0.5 s = 128/s.
Between two turns of one conversation a sample goes through the writer, the
dispatcher, the broker and the claim again: that gap lowers the rate. Figures:

* ``steady_turns_per_s``: answered turns (``attempts`` rows with outcome ok)
  per second between the 10th and 90th percentile of their end times;
* ``efficiency_pct``: that ÷ (limit / latency); goal ≥ 85 %, as single turns;
* ``ratio_to_single``: the turns job's steady rate ÷ the single job's;
* ``max_active``: the simulator's peak of concurrent requests (must be ≤ the limit).

Run: ``python bench/turns.py`` (options: ``--conversations``, ``--latency``,
``--limit``, ``--concurrency``, ``--no-single``, ``--keep-logs``).
"""

from __future__ import annotations

import argparse
import sys
import time

from _harness import Bench, create_job, prompts, summary, wait_done, window_rate


def call_end_times(job_id: int) -> list[float]:
    """End times (epoch s, sorted) of the job's answered calls."""
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    with session_scope() as s:
        rows = s.scalars(select(Attempt.ended_at).join(Sample, Sample.id == Attempt.sample_id)
                         .where(Sample.job_id == job_id, Attempt.outcome == "ok")
                         .order_by(Attempt.ended_at))
        return [t.timestamp() for t in rows if t is not None]


def medians(job_id: int) -> dict[str, float]:
    """Median ms of a call (``attempts.latency_s``: claim to answer) and of a sample's
    wait between the end of one call and the start of its next (0 for one-turn jobs)."""
    import statistics

    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    with session_scope() as s:
        rows = s.execute(select(Attempt.sample_id, Attempt.started_at, Attempt.ended_at,
                                Attempt.latency_s)
                         .join(Sample, Sample.id == Attempt.sample_id)
                         .where(Sample.job_id == job_id, Attempt.outcome == "ok")
                         .order_by(Attempt.sample_id, Attempt.id)).all()
    gaps = [(b[1] - a[2]).total_seconds() for a, b in zip(rows, rows[1:], strict=False)
            if a[0] == b[0]]
    return {"call_ms": 1000 * statistics.median(r[3] for r in rows) if rows else 0.0,
            "between_turns_ms": 1000 * statistics.median(gaps) if gaps else 0.0}


def conversations(n: int) -> list[list[dict[str, str]]]:
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Answer briefly."}]
        for t in range(3):
            messages += [{"role": "user", "content": f"conversation {i} question {t}"},
                         {"role": "assistant", "content": f"dataset answer {t}"}]
        rows.append(messages)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=700)
    ap.add_argument("--latency", type=float, default=0.5, help="simulator latency, s")
    ap.add_argument("--capacity", type=int, default=256, help="simulator capacity")
    ap.add_argument("--limit", type=int, default=64, help="job inflight_limit")
    ap.add_argument("--concurrency", type=int, default=64, help="worker threads (-c)")
    ap.add_argument("--redis-db", type=int, default=14)
    ap.add_argument("--timeout", type=float, default=300, help="give up after this many s")
    ap.add_argument("--no-single", action="store_true", help="skip the one-turn reference")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()

    from synthq.data.dataset import Row
    from synthq.jobs.enqueue import EnqueueReport, JobSpec, get_or_create_job
    from synthq.jobs.samplecopy import insert_rows
    from synthq.store.db import session_scope

    ideal = args.limit / args.latency if args.latency > 0 else float("inf")
    calls = 3 * args.conversations
    figures: dict[str, dict[str, float]] = {}
    with Bench("turns", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        sim = b.simulator("--latency", str(args.latency), "--capacity", str(args.capacity))
        worker = b.worker(args.concurrency)
        beat = b.beat()
        b.wait_ready([worker])
        if not args.no_single:
            spec = JobSpec(name="single", model="sim-model", servers=[sim.url],
                           inflight_limit=args.limit, max_tokens=256)
            report = create_job(spec, prompts(calls, "single"))
            wait_done(report.job_id, calls, args.timeout, procs=[worker, beat, sim], bench=b)
            rate, window = window_rate(call_end_times(report.job_id))
            figures["single"] = {"steady_per_s": rate, "window_s": window,
                                 **medians(report.job_id)}
        spec = JobSpec(name="turns", model="sim-model", servers=[sim.url],
                       inflight_limit=args.limit, max_tokens=256, regenerate="all")
        t0 = time.time()
        with session_scope() as s:
            job, _, _ = get_or_create_job(s, spec)
            job_id, settings = job.id, job.generation_settings()
        report = EnqueueReport(job_id=job_id, job_name=spec.name, created=True)
        insert_rows(job_id, settings, [Row(i, m) for i, m in
                                       enumerate(conversations(args.conversations))],
                    report, regenerate="all")
        c = wait_done(job_id, args.conversations, args.timeout, procs=[worker, beat, sim],
                      bench=b)
        wall = time.time() - t0
        times = call_end_times(job_id)
        steady, window = window_rate(times)
        parts = medians(job_id)
        stats = sim.stats()
        alarms = b.report_alarms()

    eff = 100 * steady / ideal
    single = figures.get("single", {}).get("steady_per_s")
    print(f"conversations     {args.conversations} x 3 turns  (done {c['done']}, "
          f"failed {c['failed']}; {len(times)} turns answered)")
    print(f"Little's law      {ideal:.1f} calls/s  (limit {args.limit} / latency "
          f"{args.latency} s)")
    print(f"steady turns/s    {steady:.1f}/s  (10th-90th percentile, {window:.1f} s window)")
    print(f"efficiency        {eff:.1f} %  (goal >= 85 %)")
    if single:
        print(f"single-turn ref   {single:.1f}/s  ({100 * single / ideal:.1f} %); turns / "
              f"single = {steady / single:.2f}")
    print(f"median call       {parts['call_ms']:.0f} ms (single: "
          f"{figures.get('single', {}).get('call_ms', 0):.0f} ms); between a sample's turns "
          f"{parts['between_turns_ms']:.0f} ms")
    print(f"max_active        {stats['max_active']}  (limit {args.limit}; "
          f"{'OK' if stats['max_active'] <= args.limit else 'LIMIT EXCEEDED'})")
    print(f"wall time         {wall:.1f} s  (insert to last done)")
    summary("turns", {
        "conversations": args.conversations, "turns_answered": len(times),
        "ideal_per_s": round(ideal, 1), "steady_turns_per_s": round(steady, 1),
        "efficiency_pct": round(eff, 1),
        "single_steady_per_s": round(single, 1) if single else None,
        "ratio_to_single": round(steady / single, 3) if single else None,
        "call_ms": round(parts["call_ms"]), "between_turns_ms": round(parts["between_turns_ms"]),
        "max_active": stats["max_active"], "limit": args.limit, "wall_s": round(wall, 1),
        "log_alarms": len(alarms)})
    sys.exit(0)


if __name__ == "__main__":
    main()

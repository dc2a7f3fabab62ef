"""Scale: one job of 1M samples with 1M attempt rows; the SQL of a dispatch tick,
``status --json`` and a ``/metrics`` scrape.

Setup: a fresh PostgreSQL database; one job on 8 servers (limit 128 each), and
``--samples`` (1,000,000) samples written by SQL (``generate_series``, not the
enqueue path: see ``enqueue.py`` for that): 60 % done, 30 % pending and due,
5 % failed, 5 % skipped, the done ones with an example (the job has a tokenizer);
``--attempts`` rows (1,000,000) spread over the done and
failed samples, with a latency, a time to first token and tokens; then
``VACUUM ANALYZE``.

Each figure is the median (and max) of ``--repeats`` (5) timings of the real
function, in this process, against that database:

* **dispatch tick**: :func:`synthq.queue.dispatch.dispatch` with a publisher that
  drops the samples and room for 64, then those samples put back to pending
  (not timed), so every tick finds the same work;
* **status --json**: :func:`synthq.views.report.job_status` (what ``synthq status
  JOB --json`` prints, without the process start), and ``status_no_cost``
  without the cost report (:mod:`synthq.store.cost`); the statements of one call
  that took longest are printed first;
* **/metrics**: :func:`synthq.views.query.metrics_snapshot` (the SQL behind a scrape),
  warm (this process scraped before: only the attempts since its last safe
  point are read), ``metrics_first`` (a fresh process: the whole table once),
  and ``metrics_full_scan`` (the attempts queries over the whole table: what
  every scrape cost before).

Run: ``python bench/scale.py`` (``--samples``, ``--attempts``, ``--repeats``).
It takes a few minutes (most of it writing the rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _harness import Bench, summary

SERVERS = [f"http://gpu{i}:8000/v1" for i in range(8)]


def populate(n: int, attempts: int) -> int:
    from sqlalchemy import text

    from synthq.jobs.enqueue import JobSpec, get_or_create_job
    from synthq.store.db import session_scope

    with session_scope() as s:
        job, _, _ = get_or_create_job(s, JobSpec(name="scale", model="m", servers=SERVERS,
                                                 inflight_limit=128))
        job_id = job.id
    with session_scope() as s:
        s.execute(text("""
            INSERT INTO samples (job_id, content_key, dataset_index, prompt, state, attempts,
                                 next_attempt_at, created_at, updated_at, finished_at,
                                 server, error_class, response_content, completion_tokens,
                                 num_tokens, num_supervised, tokenize_version)
            SELECT :job, md5(i::text), i,
                   jsonb_build_array(jsonb_build_object('role', 'user',
                                                        'content', 'question ' || i)),
                   CASE WHEN i % 20 < 12 THEN 'done' WHEN i % 20 < 18 THEN 'pending'
                        WHEN i % 20 = 18 THEN 'failed' ELSE 'skipped' END,
                   CASE WHEN i % 20 < 12 OR i % 20 = 18 THEN 1 ELSE 0 END,
                   CASE WHEN i % 20 BETWEEN 12 AND 17 THEN now() - interval '1 hour' END,
                   now() - interval '2 hours', now(),
                   CASE WHEN i % 20 < 12 OR i % 20 >= 18
                        THEN now() - (i % 3600) * interval '1 second' END,
                   CASE WHEN i % 20 < 12 OR i % 20 = 18 THEN 'http://gpu' || (i % 8) || :tail
                   END,
                   CASE WHEN i % 20 = 18 THEN 'timeout' WHEN i % 20 = 19 THEN 'invalid_input'
                   END,
                   CASE WHEN i % 20 < 12 THEN 'an answer' END,
                   CASE WHEN i % 20 < 12 THEN 40 END,
                   CASE WHEN i % 20 < 12 THEN 300 + i % 100 END,
                   CASE WHEN i % 20 < 12 THEN 40 END,
                   CASE WHEN i % 20 < 12 THEN 1 END
            FROM generate_series(0, :n - 1) AS i"""), {"job": job_id, "n": n, "tail": ":8000/v1"})
        # A tokenized job: status also sums the examples' tokens and counts stale ones.
        s.execute(text("UPDATE jobs SET tokenizer = 'bench/tokenizer' WHERE id = :job"),
                  {"job": job_id})
        s.execute(text("""
            INSERT INTO attempts (sample_id, server, worker, started_at, ended_at, outcome,
                                  latency_s, ttft_s, completion_tokens)
            SELECT id, server, 'w', finished_at - interval '3 seconds', finished_at,
                   CASE WHEN state = 'done' THEN 'ok' ELSE 'timeout' END,
                   3.0 + (id % 100) / 10.0, 0.2 + (id % 10) / 10.0,
                   CASE WHEN state = 'done' THEN 40 END
            FROM samples CROSS JOIN generate_series(1, :k) AS k
            WHERE job_id = :job AND state IN ('done', 'failed')
            ORDER BY k, id LIMIT :a"""), {"job": job_id, "a": attempts,
                                          "k": -(-attempts // max(1, n * 13 // 20))})
    from synthq.store.db import get_engine

    with get_engine().connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
    return job_id


def timed(fn: Callable[[], Any], repeats: int, after: Callable[[], None] | None = None
          ) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
        if after:
            after()
    return statistics.median(times), max(times)


def slowest(fn: Callable[[], Any], what: str, after: Callable[[], None] | None = None,
            top: int = 4) -> None:
    """Print the statements of one ``fn()`` call that took longest (where the time goes)."""
    from sqlalchemy import event

    from synthq.store.db import get_engine

    fn()  # warm
    if after:
        after()
    spent: list[tuple[float, str]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        conn.info["bench_t0"] = time.perf_counter()

    def done(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        spent.append((1000 * (time.perf_counter() - conn.info.pop("bench_t0")),
                      " ".join(statement.split())[:110]))

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", done)
    try:
        fn()
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", done)
        if after:
            after()
    total = sum(ms for ms, _ in spent)
    print(f"{what}: {len(spent)} statements, {total:.1f} ms of SQL; slowest:", file=sys.stderr)
    for ms, statement in sorted(spent, reverse=True)[:top]:
        print(f"  {ms:8.1f} ms  {statement}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--attempts", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--redis-db", type=int, default=9, help="flushed; nothing else uses it")
    args = ap.parse_args()
    figures: dict[str, Any] = {"samples": args.samples}
    with Bench("scale", redis_db=args.redis_db, env={"SYNTHQ_BROKER_URL": ""}):
        from sqlalchemy import func, select, update

        from synthq.queue.dispatch import Dispatched, dispatch
        from synthq.store.db import session_scope
        from synthq.store.models import Attempt, Job, Sample
        from synthq.views.query import metrics_snapshot
        from synthq.views.report import job_status

        t0 = time.monotonic()
        job_id = populate(args.samples, args.attempts)
        with session_scope() as s:
            figures["attempt_rows"] = s.scalar(select(func.count()).select_from(Attempt))
        print(f"[bench] {args.samples:,} samples, {figures['attempt_rows']:,} attempts written "
              f"in {time.monotonic() - t0:.0f} s", file=sys.stderr)

        taken: list[Dispatched] = []

        def tick() -> None:
            dispatch(taken.extend, capacity=64)

        def put_back() -> None:
            with session_scope() as s:
                s.execute(update(Sample).where(Sample.id.in_([d.sample_id for d in taken]))
                          .values(state="pending", claim=None, server=None))
            taken.clear()

        def status() -> None:
            with session_scope() as s:
                job_status(s, s.get_one(Job, job_id))

        def status_no_cost() -> None:  # the same without the cost report (synthq.store.cost)
            with session_scope() as s:
                job_status(s, s.get_one(Job, job_id), cost=False)

        def metrics() -> None:
            with session_scope() as s:
                metrics_snapshot(s)

        def metrics_first() -> None:  # a new API process: sums the whole table once
            from synthq.views import query

            query._rollups.clear()
            metrics()

        def full_scan() -> None:  # what every scrape cost before the rollup
            from synthq.views.query import _AttemptFigures

            with session_scope() as s:
                _AttemptFigures.read(s, 0, None)

        slowest(status, "status")
        slowest(tick, "dispatch tick", put_back)
        for name, fn, after in (("dispatch_tick", tick, put_back), ("status", status, None),
                                ("status_no_cost", status_no_cost, None),
                                ("metrics_full_scan", full_scan, None),
                                ("metrics_first", metrics_first, None),
                                ("metrics", metrics, None)):
            fn()  # warm: caches, compiled statements
            if after:
                after()
            median, worst = timed(fn, args.repeats, after)
            figures[f"{name}_ms"] = round(median, 1)
            figures[f"{name}_ms_max"] = round(worst, 1)
            print(f"{name:<14} {median:8.1f} ms median, {worst:8.1f} ms max", file=sys.stderr)
    summary("scale", figures)


if __name__ == "__main__":
    main()

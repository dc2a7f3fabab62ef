"""Enqueue speed: dataset rows per second into PostgreSQL, and the cost of a no-op re-enqueue.

Setup: a fresh PostgreSQL database; a JSONL file of ``--rows`` (default
100,000) short, distinct prompts written to a temp dir, rotating through the
three row forms synthq reads (OpenAI ``messages`` with a system turn and a
trailing assistant answer to drop, ShareGPT ``conversations`` with
``from``/``value``, and a plain ``prompt``).

Phases, each timed end to end on the real code path:

1. ``enqueue``: :func:`synthq.jobs.enqueue.enqueue` (read + parse + normalise +
   content hash + a binary ``COPY`` per batch of 5,000, streamed while the rows
   are read) into a new job. Figure: rows/s; ``inserted`` should equal
   ``--rows``. Beside it, the CPU it took per row: this process's (reading,
   hashing, formatting) and every PostgreSQL process's (inserting: the heap,
   six indexes, the foreign key, WAL); whichever is larger bounds the rate.
   On a shared machine the PostgreSQL figure includes other sessions' work.
2. ``re-enqueue``: the same call again with the same file and job: every row
   is a duplicate (invariant 9), ``inserted`` must be 0. Figure: rows/s and
   seconds — what a user pays for re-running an enqueue command.
3. breakdown: ``parse`` is :func:`synthq.data.dataset.iter_rows` alone into a list;
   ``hash`` is :func:`synthq.data.dataset.content_key` over those rows;
   ``insert`` is :func:`synthq.jobs.samplecopy.insert_rows` on the pre-parsed rows into
   another new job (it hashes too: insert ≈ hash + SQL).

For scale: the reference figures measured on this machine are ``COPY`` 143,000
rows/s and psycopg ``executemany`` with ``ON CONFLICT DO NOTHING`` 62,000
rows/s (100k short prompts, one index).

Run: ``python bench/enqueue.py`` (options: ``--rows``, ``--keep-logs``,
``--redis-db``; ``--sqlite``: the same into a fresh SQLite file, where the
figure to compare is the enqueue process's CPU per row).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _harness import Bench, summary


def write_dataset(path: Path, n: int) -> int:
    """``n`` distinct short rows in mixed forms; returns the file size in bytes."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            form = i % 3
            row: dict[str, Any]
            if form == 0:
                row = {"messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Question {i}: what is {i} times seven?"},
                    {"role": "assistant", "content": f"It is {i * 7}."}]}
            elif form == 1:
                row = {"conversations": [
                    {"from": "human", "value": f"Item {i}: name a colour and a fruit."},
                    {"from": "gpt", "value": "Red, apple."}]}
            else:
                row = {"prompt": f"Prompt {i}: write one short sentence about the sea."}
            f.write(json.dumps(row) + "\n")
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--redis-db", type=int, default=12, help="unused; flushed for symmetry")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--sqlite", action="store_true",
                    help="into a fresh SQLite file (synthq run's database) instead")
    args = ap.parse_args()

    from _harness import service_cpu_seconds

    from synthq.data.dataset import content_key, iter_rows
    from synthq.jobs.enqueue import EnqueueReport, JobSpec, enqueue
    from synthq.jobs.samplecopy import insert_rows

    def spec(name: str) -> JobSpec:
        return JobSpec(name=name, model="sim-model", servers=["http://127.0.0.1:9/v1"],
                       max_tokens=512)

    with Bench("enqueue", redis_db=args.redis_db, keep_logs=args.keep_logs) as b:
        if args.sqlite:
            import os

            from synthq.store.migrate import upgrade

            (b.tmp / "data").mkdir(exist_ok=True)
            url = f"sqlite:///{b.tmp / 'data' / 'synthq.db'}"
            os.environ["SYNTHQ_DATABASE_URL"] = url  # Bench puts the variable back
            upgrade(url)
            b._reset_process_state()
        path = b.tmp / "prompts.jsonl"
        size = write_dataset(path, args.rows)
        n = args.rows

        pg_cpu, cpu, t = service_cpu_seconds("postgres"), time.process_time(), time.perf_counter()
        first = enqueue(spec("bench-enqueue"), str(path))
        t_first = time.perf_counter() - t
        cpu = time.process_time() - cpu
        pg_cpu = service_cpu_seconds("postgres") - pg_cpu

        t = time.perf_counter()
        again = enqueue(spec("bench-enqueue"), str(path))
        t_again = time.perf_counter() - t

        t = time.perf_counter()
        rows = list(iter_rows(str(path)))
        t_parse = time.perf_counter() - t

        settings = spec("x").generation_settings()
        t = time.perf_counter()
        for row in rows:
            if row.messages is not None:
                content_key(row.messages, settings)
        t_hash = time.perf_counter() - t

        from synthq.jobs.enqueue import get_or_create_job
        from synthq.store.db import session_scope

        with session_scope() as s:
            job, _, _ = get_or_create_job(s, spec("bench-insert-only"))
            job_id, job_settings = job.id, job.generation_settings()
        report = EnqueueReport(job_id=job_id, job_name="bench-insert-only", created=True)
        t = time.perf_counter()
        insert_rows(job_id, job_settings, rows, report)
        t_insert = time.perf_counter() - t

    def rate(sec: float) -> float:
        return n / sec if sec > 0 else float("inf")

    print(f"dataset           {n:,} rows, {size / 1e6:.1f} MB JSONL (messages/sharegpt/prompt)")
    print(f"enqueue           {t_first:6.2f} s  {rate(t_first):9,.0f} rows/s  "
          f"inserted {first.inserted:,} skipped {first.skipped:,}")
    print(f"  CPU per row     enqueue process {cpu / n * 1e6:5.1f} us, PostgreSQL "
          f"{pg_cpu / n * 1e6:5.1f} us")
    print(f"re-enqueue        {t_again:6.2f} s  {rate(t_again):9,.0f} rows/s  "
          f"inserted {again.inserted:,} duplicates {again.duplicates:,}"
          f"{'' if again.inserted == 0 else '  <-- EXPECTED 0'}")
    print(f"  parse only      {t_parse:6.2f} s  {rate(t_parse):9,.0f} rows/s  (iter_rows)")
    print(f"  hash only       {t_hash:6.2f} s  {rate(t_hash):9,.0f} rows/s  (content_key)")
    print(f"  insert_rows     {t_insert:6.2f} s  {rate(t_insert):9,.0f} rows/s  "
          f"(pre-parsed rows, new job; includes hashing; inserted {report.inserted:,})")
    summary("enqueue", {
        "rows": n, "enqueue_s": round(t_first, 2), "enqueue_rows_per_s": round(rate(t_first)),
        "inserted": first.inserted, "skipped": first.skipped,
        "enqueue_cpu_us_per_row": round(cpu / n * 1e6, 1),
        "postgres_cpu_us_per_row": round(pg_cpu / n * 1e6, 1),
        "reenqueue_s": round(t_again, 2), "reenqueue_rows_per_s": round(rate(t_again)),
        "reenqueue_inserted": again.inserted,
        "parse_rows_per_s": round(rate(t_parse)), "hash_rows_per_s": round(rate(t_hash)),
        "insert_rows_per_s": round(rate(t_insert)), "insert_only_inserted": report.inserted})


if __name__ == "__main__":
    main()

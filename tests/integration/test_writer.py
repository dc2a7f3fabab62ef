"""The batch writer against real PostgreSQL: batching, isolation, and abandoned waiters."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import text

from synthq.serving.writer import Writer

pytestmark = pytest.mark.integration


def test_writes_queued_during_a_commit_share_the_next_transaction(pg: str) -> None:
    writer = Writer(threads=1)
    try:
        slow = writer.submit(lambda s, now: s.execute(text("SELECT pg_sleep(0.3)")) and 1)
        time.sleep(0.05)
        rest = [writer.submit(lambda s, now, i=i: i) for i in range(20)]
        assert slow.result(5) == 1
        assert [f.result(5) for f in rest] == list(range(20))
        assert writer.commits == 2 and writer.writes == 21
    finally:
        writer.close()


def test_an_answer_does_not_wait_for_a_commit_under_way(pg: str) -> None:
    """Issue 24 item 17: an answer that arrives while a commit runs is committed at once
    by the second thread, not after that commit (with one thread it waits the 3 s);
    its measured wait is what wait_figures reports. Events, not speed: the slow commit is
    still under way when the answer's is done (a fixed bound of 0.3 s failed at a
    loaded suite's start, the second thread's first connection included)."""
    writer = Writer()
    try:
        slow = writer.submit(lambda s, now: s.execute(text("SELECT pg_sleep(3)")) and 1)
        time.sleep(0.05)
        t0 = time.monotonic()
        quick = writer.submit(lambda s, now: s.execute(text("SELECT 2")).scalar(),
                              since=time.monotonic())
        assert quick.result(5) == 2
        took = time.monotonic() - t0
        assert not slow.done(), "the quick write waited for the slow commit"
        figures = writer.wait_figures()
        assert figures["answers"] == 1 and figures["max_ms"] <= took * 1000 + 1, (figures, took)
        assert slow.result(10) == 1
    finally:
        writer.close()


def test_an_idle_writer_commits_an_answer_within_50_ms(pg: str) -> None:
    """No linger: on an idle writer each answer's wait is one short transaction."""
    writer = Writer()
    try:
        writer.submit(lambda s, now: 0).result(5)  # the pool's first connection
        for i in range(20):
            assert writer.submit(lambda s, now, i=i: s.execute(text(f"SELECT {i}")).scalar(),
                                 since=time.monotonic()).result(5) == i
            time.sleep(0.01)
        figures = writer.wait_figures()
        assert figures["answers"] == 20 and figures["p50_ms"] < 50, figures
    finally:
        writer.close()


def test_a_write_the_database_refuses_fails_alone(pg: str) -> None:
    writer = Writer()
    try:
        good = writer.submit(lambda s, now: s.execute(text("SELECT 1")).scalar())
        bad = writer.submit(lambda s, now: s.execute(text("SELECT 1/0")))
        also_good = writer.submit(lambda s, now: 2)
        assert good.result(5) == 1 and also_good.result(5) == 2
        with pytest.raises(Exception, match="division by zero"):
            bad.result(5)
    finally:
        writer.close()


def test_a_waiter_that_gave_up_does_not_stop_the_writer(pg: str) -> None:
    """A cancelled await (a worker shutting down) must not kill the writer thread."""
    writer = Writer()
    try:
        blocker = writer.submit(lambda s, now: s.execute(text("SELECT pg_sleep(0.3)")))
        time.sleep(0.05)
        abandoned = writer.submit(lambda s, now: "nobody reads this")
        assert abandoned.cancel()
        blocker.result(5)
        after: Any = writer.submit(lambda s, now: "still writing")
        assert after.result(5) == "still writing"
    finally:
        writer.close()


def test_a_batchs_answers_are_one_merged_compare_and_set(
        pg: str, job_factory: Any) -> None:
    """Issue 32: the answers committed in one transaction are one ``UPDATE ... FROM
    unnest(...)`` per shape (synthq.queue.ledger.Move), with each row's own values and token:
    the winners are done with their own columns (text, bytes, JSON), a stale token loses
    and its row is untouched, and each call's attempt row says which."""
    from sqlalchemy import select, update

    from synthq.queue import ledger, states
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Attempt, Sample

    report = job_factory([f"q{i}" for i in range(6)], servers=["http://127.0.0.1:9/v1"])
    with session_scope() as s:
        ids = list(s.scalars(select(Sample.id).where(Sample.job_id == report.job_id)
                             .order_by(Sample.id)))
        for i in ids:
            s.execute(update(Sample).where(Sample.id == i).values(
                state="running", claim=f"tok{i}", server="http://127.0.0.1:9/v1"))
    before = ledger._merged_statement.cache_info()
    writer = Writer(threads=1)
    try:
        slow = writer.submit(lambda s, now: s.execute(text("SELECT pg_sleep(0.3)")) and 1)
        time.sleep(0.05)
        futures = []
        for n, i in enumerate(ids):
            token = "stale" if n == 2 else f"tok{i}"
            attempt = dict(sample_id=i, server="http://127.0.0.1:9/v1", worker="w",
                           started_at=utcnow(), ended_at=utcnow(), outcome="ok", error_message=None,
                           latency_s=0.1, ttft_s=None, completion_tokens=3, turn=None)
            futures.append(writer.submit(states.completion(
                i, token, attempt=attempt, response_content=f"answer {i}",
                completion_token_ids=bytes([n, 1, 2, 3]), tool_calls=[{"id": f"c{i}"}],
                finish_reason="stop")))
        assert slow.result(5) == 1
        assert [f.result(5) for f in futures] == [n != 2 for n in range(len(ids))]
        assert writer.commits == 2, "the answers were not one transaction"
    finally:
        writer.close()
    after = ledger._merged_statement.cache_info()
    assert after.hits + after.misses == before.hits + before.misses + 1, "not merged"
    with session_scope() as s:
        rows = {r.id: r for r in s.scalars(select(Sample).where(Sample.id.in_(ids)))}
        outcomes = dict(s.execute(select(Attempt.sample_id, Attempt.outcome)
                                  .where(Attempt.sample_id.in_(ids))).all())
    for n, i in enumerate(ids):
        r = rows[i]
        if n == 2:
            assert (r.state, r.claim, r.response_content) == ("running", f"tok{i}", None)
            assert outcomes[i] == "lost"
            continue
        assert (r.state, r.claim, r.response_content, r.finish_reason) == (
            "done", None, f"answer {i}", "stop")
        assert bytes(r.completion_token_ids) == bytes([n, 1, 2, 3])
        assert r.tool_calls == [{"id": f"c{i}"}] and r.finished_at is not None
        assert outcomes[i] == "ok"

"""The batch writer against real PostgreSQL: batching, isolation, and abandoned waiters."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import text

from synthq.writer import Writer

pytestmark = pytest.mark.integration


def test_writes_queued_during_a_commit_share_the_next_transaction(pg: str) -> None:
    writer = Writer()
    try:
        slow = writer.submit(lambda s, now: s.execute(text("SELECT pg_sleep(0.3)")) and 1)
        time.sleep(0.05)
        rest = [writer.submit(lambda s, now, i=i: i) for i in range(20)]
        assert slow.result(5) == 1
        assert [f.result(5) for f in rest] == list(range(20))
        assert writer.commits == 2 and writer.writes == 21
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

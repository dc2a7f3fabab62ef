"""The scheduler tick's expiry is a Redis key that Redis times (issue 41, item 8).

Celery's ``expires`` is a time on the sender's clock that the receiving worker checks
against its own: a worker 120 s ahead discarded every tick. A tick is now worth running
while its key (``synthq:tick:<id>``, set before it is sent) is there; the worker takes
the key, so a redelivered copy or a backlog of late ticks is not run again.
(tests/chaos/test_clock_skew.py runs it with a real worker whose clock is ahead.)
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration]


def test_a_tick_runs_once_while_its_key_lives(redis_url: str) -> None:
    import redis

    from synthq.queue.broker import TICK_KEY, mark_tick, take_tick, tick_ttl

    client = redis.Redis.from_url(redis_url)
    try:
        mark_tick("t1")
        ttl = client.pttl(TICK_KEY + "t1")
        assert 0 < ttl <= tick_ttl() * 1000  # Redis deletes it: no other clock is read
        assert take_tick("t1") is True
        assert take_tick("t1") is False  # a redelivered copy, or a late one: skipped
        assert take_tick("never-marked") is False
        assert take_tick(None) is True  # called outside Celery
    finally:
        client.close()


def test_a_late_tick_does_nothing(pg: str, redis_url: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The task itself: a tick whose key is gone returns at once without a scheduler
    tick; one whose key is there runs it."""
    from worker import tasks

    ran: list[int] = []
    monkeypatch.setattr(tasks, "_tick", lambda: ran.append(1) or 7)
    from synthq.queue.broker import mark_tick

    assert tasks.dispatch_tick.apply(task_id="late").result == 0
    mark_tick("fresh")
    assert tasks.dispatch_tick.apply(task_id="fresh").result == 7
    assert ran == [1]


def test_beat_marks_its_ticks(redis_url: str) -> None:
    """Beat's tick carries no ``expires``; the message is marked live before it is sent.

    It is sent to a queue of its own: a worker still draining ``control`` on this Redis
    database (another test's) would take the message and its key before they are read
    (CI: ``not enough values to unpack (expected 1, got 0)``)."""
    import uuid

    import redis

    from synthq.queue.broker import CONTROL_ROUTE, TICK_KEY, TICK_TASK
    from worker.app import app

    client = redis.Redis.from_url(redis_url)
    try:
        entry = app.conf.beat_schedule["dispatch"]
        assert "expires" not in entry["options"]
        assert entry["options"]["queue"] == CONTROL_ROUTE["queue"]
        queue = f"tick-test-{uuid.uuid4().hex[:8]}"
        app.send_task(TICK_TASK, **{**entry["options"], "queue": queue, "routing_key": queue})
        [message] = [json.loads(m) for m in client.lrange(queue, 0, -1)]
        assert not message["headers"].get("expires")
        assert client.exists(TICK_KEY + message["headers"]["id"])
        client.delete(queue, TICK_KEY + message["headers"]["id"])
    finally:
        client.close()

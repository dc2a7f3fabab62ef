"""The cost report's projection counts the calls a job has left: with --regenerate all,
the turns its open samples have left, not the samples (PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from synthq.data.dataset import Row
from synthq.store.cost import job_cost
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, Job, Sample

pytestmark = pytest.mark.integration

CONVERSATION = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]


def test_multi_turn_projection_counts_the_turns_left(job_factory: Callable[..., Any]) -> None:
    rows = [Row(i, [{**m, "content": f"{m['content']} #{i}"} for m in CONVERSATION])
            for i in range(3)]
    report = job_factory(rows=rows, regenerate="all", gpu_hour_price=2.0)
    now = utcnow()
    with session_scope() as s:
        ids = s.scalars(select(Sample.id).where(Sample.job_id == report.job_id)
                        .order_by(Sample.id)).all()
        assert s.scalars(select(Sample.turn_count).where(Sample.id.in_(ids))).all() == [3] * 3
        # One sample done; one with all 3 turns to go; one with its last turn to go.
        s.execute(update(Sample).where(Sample.id == ids[0]).values(state="done", turn=3))
        s.execute(update(Sample).where(Sample.id == ids[2]).values(turn=2))
        # Four calls of 50 tokens, 2 s each, back to back over the last 8 s.
        for k, sid in enumerate([ids[0], ids[0], ids[0], ids[2]]):
            start = now - timedelta(seconds=8 - 2 * k)
            s.add(Attempt(sample_id=sid, server="http://sim/v1", started_at=start,
                          ended_at=start + timedelta(seconds=2), outcome="ok",
                          latency_s=2.0, completion_tokens=50, turn=k % 3))
    with session_scope() as s:
        cost = job_cost(s, s.get_one(Job, report.job_id), remaining=2, now=now)
    assert cost.mean_tokens_per_sample == 50  # per call: per turn
    assert cost.remaining_calls == 3 + 1  # turns left, not the 2 samples
    # The last minute's tokens over the time since its first call ended (6 s).
    assert cost.current_tokens_per_s == pytest.approx(200 / 6.0)
    assert cost.remaining_s == pytest.approx(4 * 50 / (200 / 6.0))


def test_busy_time_folded_once_a_minute_equals_the_union_of_every_call(
        job_factory: Callable[..., Any]) -> None:
    """The busy time a status reads (a fold plus the calls ended since) equals the
    union of all the job's call intervals, as the fold moves past calls that overlap,
    a call running across it, and calls added after it."""
    from synthq.store.cost import busy_intervals, measure

    report = job_factory(["a", "b", "c", "d", "e"])
    t0 = utcnow()
    server = "http://sim/v1"

    def at(seconds: float) -> Any:
        return t0 + timedelta(seconds=seconds)

    with session_scope() as s:
        ids = s.scalars(select(Sample.id).where(Sample.job_id == report.job_id)
                        .order_by(Sample.id)).all()

    def call(sid: int, start: float, end: float) -> None:
        with session_scope() as s:
            s.add(Attempt(sample_id=sid, server=server, started_at=at(start), ended_at=at(end),
                          outcome="ok", latency_s=end - start, completion_tokens=10))

    def busy(now: Any) -> float:
        with session_scope() as s:
            return job_cost(s, s.get_one(Job, report.job_id), remaining=1, now=now).busy_s

    def union(now: Any) -> float:
        with session_scope() as s:
            return measure(busy_intervals(s, report.job_id, now)[server])

    def folded_until() -> Any:
        with session_scope() as s:
            return s.get_one(Job, report.job_id).busy_until

    call(ids[0], -300, -250)
    call(ids[1], -260, -200)  # overlaps the first: counted once
    call(ids[2], -100, -40)
    with session_scope() as s:  # running since -30: the fold stops at its start
        s.execute(update(Sample).where(Sample.id == ids[3]).values(
            state="running", server=server, started_at=at(-30)))
    assert busy(at(0)) == pytest.approx(100 + 60 + 30) == union(at(0))
    assert folded_until() == at(-30)
    assert busy(at(20)) == pytest.approx(100 + 60 + 50)  # within the minute: no new fold
    assert folded_until() == at(-30)
    # The running call ends at +20, another runs +30..+90; a status at +100 folds to +90.
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.id == ids[3]).values(state="done"))
    call(ids[3], -30, 20)
    call(ids[4], 30, 90)
    call(ids[4], 80, 95)  # straddles the next fold (+90): its part before it is folded
    assert busy(at(100)) == pytest.approx(100 + 60 + 50 + 65) == union(at(100))
    assert folded_until() == at(90)
    call(ids[4], 93, 105)  # written after that fold: the calls ended since are added
    assert busy(at(110)) == pytest.approx(100 + 60 + 50 + 75) == union(at(110))

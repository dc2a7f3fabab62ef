"""The cost report's projection counts the calls a job has left: with --regenerate all,
the turns its open samples have left, not the samples (PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from synthq.cost import job_cost
from synthq.dataset import Row
from synthq.db import session_scope, utcnow
from synthq.models import Attempt, Job, Sample

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

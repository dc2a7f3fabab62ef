"""``/metrics`` reads the attempts since its last safe point, not the whole table, and
still counts a row whose transaction commits after newer rows were scraped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from support import wait_for

from synthq.store.db import get_engine, session_scope, utcnow
from synthq.store.models import Attempt
from synthq.views.query import _AttemptFigures, metrics_snapshot

pytestmark = pytest.mark.integration


def _rows(sample_id: int, n: int, outcome: str = "ok") -> list[dict[str, Any]]:
    now = utcnow()
    return [dict(sample_id=sample_id, server="http://gpu:8000/v1", worker="w", started_at=now,
                 ended_at=now, outcome=outcome, latency_s=0.5 + i, ttft_s=0.1,
                 completion_tokens=10) for i in range(n)]


def _scrape() -> tuple[dict[tuple[str, str], int], dict[str, int], int]:
    with session_scope() as s:
        snap = metrics_snapshot(s)
    latency = snap.latency["http://gpu:8000/v1"][1] if snap.latency else 0
    return snap.calls, snap.generated_tokens, latency


def _recount() -> tuple[dict[tuple[str, str], int], dict[str, int], int]:
    with session_scope() as s:
        full = _AttemptFigures.read(s, 0, None)
    return full.calls, full.tokens, full.latency["http://gpu:8000/v1"][1] if full.latency else 0


def test_metrics_count_a_late_commit_and_scan_only_new_rows(
        pg: str, sample_factory: Callable[..., int]) -> None:
    from synthq.views import query

    sid = sample_factory("done")
    with session_scope() as s:
        s.execute(insert(Attempt), _rows(sid, 3))
    assert _scrape() == _recount()
    # A writer takes an id and has not committed yet; a newer row commits meanwhile.
    late = get_engine().connect()
    tx = late.begin()
    late.execute(insert(Attempt), _rows(sid, 1, outcome="timeout"))
    with session_scope() as s:
        s.execute(insert(Attempt), _rows(sid, 2))
    for _ in range(3):  # the open transaction holds the safe point back
        assert _scrape() == _recount()
    tx.commit()
    late.close()
    assert _scrape() == _recount()  # the late row is visible, and counted
    calls, _, _ = _scrape()
    assert calls[("http://gpu:8000/v1", "timeout")] == 1 and \
        calls[("http://gpu:8000/v1", "ok")] == 5
    # The rows up to a safe point are summed once: later scrapes read only what follows.
    # The safe point passes a position once every transaction older than the scrape that
    # noted it has ended, in the whole PostgreSQL cluster: another test process's open
    # transaction (another database, the same transaction ids) holds it back a moment (a
    # CI run read upto 3 of 6 here). Each scrape meanwhile must still count every row.
    with session_scope() as s:
        newest = s.scalar(select(func.max(Attempt.id)))

    def folded() -> bool:
        assert _scrape() == _recount()
        return query._rollups[get_engine()].upto == newest

    wait_for(folded, 60, lambda: f"the safe point stayed at "
             f"{query._rollups[get_engine()]} below {newest}", interval=0.1)
    with session_scope() as s:
        s.execute(insert(Attempt), _rows(sid, 4))
    assert _scrape() == _recount()
    assert _scrape()[0][("http://gpu:8000/v1", "ok")] == 9

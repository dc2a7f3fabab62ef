"""The capture claim reads the one "server is down" rule (synthq.queue.outage) from SQL
(issue 42, item 2): a capture server's calls are rows (``capture_calls``), so every
capture process sees it down alike, and its room is the rule's, as generation's is."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from synthq.queue import capture_states
from synthq.queue.outage import PROBE_INTERVAL, TRIP_AFTER
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Capture, Sample

pytestmark = [pytest.mark.integration]

SERVER = "http://127.0.0.1:9/capture"


def test_a_down_capture_server_gets_one_probe_at_a_time_whoever_claims(
        pg: str, job_factory: Callable[..., Any]) -> None:
    job_id = job_factory(["a", "b", "c", "d"]).job_id
    t0 = utcnow()
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.job_id == job_id).values(
            state="done", input_ids=b"\x01\x00\x00\x00", num_tokens=1, tokenize_version=1))
        capture_states.add_missing(s, job_id, now=t0)
    with session_scope() as s:
        first = s.scalars(select(Capture.id).where(Capture.job_id == job_id)
                          .order_by(Capture.id)).first()
        assert first is not None
        for i in range(TRIP_AFTER):  # another process's calls, refused
            assert not capture_states.server_down(s, SERVER)
            capture_states.record_call(s, first, server=SERVER, outcome="connection",
                                       error_message="connection refused",
                                       now=t0 + timedelta(seconds=i))
        assert capture_states.server_down(s, SERVER)
    last = t0 + timedelta(seconds=TRIP_AFTER - 1)

    def claim(token: str, at: Any) -> int:
        with session_scope() as s:
            return len(capture_states.claim(s, job_id, server=SERVER, limit=4, most=4,
                                            worker="w", token=token, lease=60.0, now=at))

    assert claim("early", last + timedelta(seconds=PROBE_INTERVAL / 2)) == 0  # not due
    due = last + timedelta(seconds=PROBE_INTERVAL)
    assert claim("probe", due) == 1  # the probe
    assert claim("second", due) == 0  # and only one
    with session_scope() as s:
        assert capture_states.next_probe_s(s, [SERVER], now=due) == 0.0
        probe = s.scalars(select(Capture.id).where(Capture.claim == "probe")).one()
        capture_states.record_call(s, probe, server=SERVER, outcome="ok", error_message=None,
                                   now=due)
        assert not capture_states.server_down(s, SERVER)
        assert capture_states.next_probe_s(s, [SERVER], now=due) is None
    assert claim("back", due) == 3  # its whole limit: 4, one still running

"""A server that stops serving (synthq.queue.outage, the one rule of generation's dispatch
and the capture claim): after TRIP_AFTER refused, timed-out or 5xx calls in a row it gets
one probe at a time, and the first call through gives its limit back.

(These scenarios tested the capture stage's in-memory ``Outages`` until the rule read
its calls from SQL for both stages, issue 42 item 2: the same assertions, over the
server's latest calls as the rule reads them. tests/integration/test_capture_queue.py
runs them through the capture claim against PostgreSQL.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from synthq.queue.outage import PROBE_INTERVAL, TRIP_AFTER, is_down, next_probe_s, room

T0 = datetime(2026, 12, 6, tzinfo=UTC)


def newest_first(*calls: tuple[str, str], start: datetime = T0) -> list[Any]:
    """The calls (outcome, message), oldest first, one a second: the rule's rows."""
    rows = [(o, m, start + timedelta(seconds=i)) for i, (o, m) in enumerate(calls)]
    return rows[::-1][:TRIP_AFTER]


def test_a_down_server_is_probed_one_call_at_a_time() -> None:
    refused = ("connection", "connection refused")
    calls = [refused] * (TRIP_AFTER - 1)
    latest = newest_first(*calls)
    now = latest[0][2]
    assert not is_down(latest)
    assert room(4, 0, latest, now, most=4) == 4  # not down yet
    calls.append(refused)
    latest = newest_first(*calls)
    now = latest[0][2]
    assert is_down(latest)
    assert room(4, 0, latest, now, most=4) == 0  # the probe is not due yet
    assert room(4, 0, [], now, most=4) == 4  # another server is not
    due = now + timedelta(seconds=PROBE_INTERVAL)  # its time has come
    assert room(4, 1, latest, due, most=4) == 0  # one already in flight
    assert room(4, 0, latest, due, most=4) == 1  # the probe
    assert room(4, 1, latest, due, most=4) == 0  # and only one (it is in flight now)
    assert 0 < next_probe_s(latest, now + timedelta(seconds=0.5)) <= PROBE_INTERVAL
    calls.append(("server_error", "HTTP 503: loading"))
    assert is_down(newest_first(*calls))  # still down
    calls.append(("ok", ""))
    latest = newest_first(*calls)
    assert not is_down(latest) and room(4, 0, latest, latest[0][2], most=4) == 4


def test_a_failure_that_is_not_the_servers_ends_the_run() -> None:
    slow = ("timeout", "read timed out")
    calls = [slow] * (TRIP_AFTER - 1) + [("capture_mismatch", "token ids differ")]
    assert not is_down(newest_first(*calls))
    calls.append(slow)
    assert not is_down(newest_first(*calls))  # a new run of 1
    # A broken answer (server_error without an HTTP 5xx) says nothing of the server.
    assert not is_down(newest_first(*[("server_error", "RuntimeError: bug")] * TRIP_AFTER))


def test_a_retry_after_spaces_the_probes() -> None:
    latest = newest_first(*[("server_error", "HTTP 503 (Retry-After 5 s): busy")] * TRIP_AFTER)
    assert is_down(latest)
    assert next_probe_s(latest, latest[0][2]) == 5.0
    assert room(4, 0, latest, latest[0][2] + timedelta(seconds=PROBE_INTERVAL), most=4) == 0
    assert room(4, 0, latest, latest[0][2] + timedelta(seconds=5), most=4) == 1

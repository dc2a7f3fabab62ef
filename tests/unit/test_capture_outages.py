"""A capture server that stops serving (synthq.capture.stage.Outages): after TRIP_AFTER
refused, timed-out or 5xx calls in a row it gets one probe at a time, its failures are
the server's (not charged), and the first call through gives its limit back."""

from __future__ import annotations

import time

from synthq.capture.stage import Outages
from synthq.queue.dispatch import PROBE_INTERVAL, TRIP_AFTER


def test_a_down_server_is_probed_one_capture_at_a_time() -> None:
    said: list[str] = []
    o = Outages(said.append)
    for _ in range(TRIP_AFTER - 1):
        assert o.failed("A", "connection", "connection refused") is False
    assert o.room("A", 4, 0) == 4  # not down yet
    assert o.failed("A", "connection", "connection refused") is True
    assert len(said) == 1 and "server A is down" in said[0]
    assert o.room("A", 4, 0) == 0  # the probe is not due yet
    assert o.room("B", 4, 0) == 4  # another server is not
    o._probe_at["A"] = time.monotonic() - 0.01  # its time has come
    assert o.room("A", 4, 1) == 0  # one already in flight
    assert o.room("A", 4, 0) == 1  # the probe
    assert o.room("A", 4, 0) == 0  # and only one
    assert 0 < (o.next_probe_s() or 0) <= PROBE_INTERVAL
    assert o.failed("A", "server_error", "HTTP 503: loading") is True  # still down
    o.ok("A")
    assert o.room("A", 4, 0) == 4 and o.next_probe_s() is None
    assert "answers again" in said[-1]


def test_a_failure_that_is_not_the_servers_ends_the_run() -> None:
    o = Outages(lambda _: None)
    for _ in range(TRIP_AFTER - 1):
        o.failed("A", "timeout", "read timed out")
    assert o.failed("A", "capture_mismatch", "token ids differ") is False
    assert o.failed("A", "timeout", "read timed out") is False  # a new run of 1
    # A broken answer (server_error without an HTTP 5xx) says nothing of the server.
    for _ in range(TRIP_AFTER):
        assert o.failed("B", "server_error", "RuntimeError: bug") is False

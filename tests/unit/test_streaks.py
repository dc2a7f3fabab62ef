"""Identical failures in a row per server (synthq.queue.streaks): what counts as identical,
what ends a run."""

from __future__ import annotations

from synthq.queue.streaks import CAPTURE_CLASSES, Streaks, shape


def test_the_shape_blanks_what_varies_per_call() -> None:
    a = ("the server answered the file 'cmpl-1.safetensors', not this request's "
         "synthq-1-2-ab12cd34ef56.safetensors")
    b = ("the server answered the file 'cmpl-9.safetensors', not this request's "
         "synthq-1-7-0011223344ff.safetensors")
    assert shape(a) == shape(b)
    assert shape("HTTP 400: model 'x' not found") != shape("HTTP 400: temperature out of range")


def test_five_identical_failures_in_a_row_stop_a_server() -> None:
    s = Streaks(CAPTURE_CLASSES, after=5)
    for i in range(4):
        assert s.failed("A", "bad_request", f"file 'r{i}'") is None
    assert s.failed("B", "bad_request", "file 'x'") is None  # another server counts apart
    stop = s.failed("A", "bad_request", "file 'r4'")
    assert stop is not None and (stop.server, stop.count) == ("A", 5)
    assert s.failed("A", "bad_request", "file 'r5'") is None  # stopped once
    assert "server A failed 5 captures in a row with bad_request" in stop.line(
        "capture", "RESUME")


def test_a_success_another_cause_or_class_starts_again() -> None:
    s = Streaks(CAPTURE_CLASSES, after=3)
    s.failed("A", "bad_request", "x")
    s.failed("A", "bad_request", "x")
    s.ok("A")
    assert s.failed("A", "bad_request", "x") is None
    s.failed("A", "bad_request", "x")
    assert s.failed("A", "bad_request", "another cause") is None  # a new run of 1
    s.failed("A", "bad_request", "x")
    s.failed("A", "timeout", "slow")  # not a class that names the configuration: ends it
    assert s.failed("A", "bad_request", "x") is None
    assert Streaks(CAPTURE_CLASSES, after=0).failed("A", "bad_request", "x") is None


def test_a_stop_holds_back_what_was_claimed_before_its_pause_committed() -> None:
    """Samples claimed before the pause committed are not sent (the calls in flight are
    all a stop costs); a claim begun after the commit saw the job paused, so its sample
    means the job was resumed: the stop ends there, and a success alone does not end it."""
    s = Streaks(CAPTURE_CLASSES, after=2)
    s.failed("A", "bad_request", "x")
    assert s.holds("A", 0.0) is None  # no stop yet
    stop = s.failed("A", "bad_request", "x")
    assert stop is not None
    assert s.holds("A", 5.0) is stop  # the pause is not committed: nothing is sent
    s.ok("A")  # a call in flight that went through does not end the stop
    s.failed("A", "timeout", "slow")  # nor does another failure
    s.settled("A", 10.0)
    assert s.holds("A", 9.0) is not None  # claimed before the commit
    assert s.holds("B", 9.0) is None  # another server
    assert s.holds("A", 11.0) is None  # claimed after it: the job was resumed
    assert s.holds("A", 9.0) is None  # and the stop is over
    assert s.failed("A", "bad_request", "x") is None  # counting starts again


def test_a_failure_that_names_the_servers_settings_stops_it_at_once() -> None:
    """A file of other layers than the job's (synthq.capture.ingest.OtherLayers) is the
    engine's settings: the first stops the server, once; the line says one capture."""
    s = Streaks(CAPTURE_CLASSES, after=5)
    stop = s.failed("A", "capture_mismatch", "the engine captures layers [1]", at_once=True)
    assert stop is not None and (stop.server, stop.count) == ("A", 1)
    assert s.failed("A", "capture_mismatch", "the engine captures layers [1]",
                    at_once=True) is None  # stopped once
    assert "server A failed a capture with capture_mismatch: the engine" in stop.line(
        "capture", "RESUME")
    off = Streaks(CAPTURE_CLASSES, after=0)  # SYNTHQ_STOP_AFTER=0 never stops
    assert off.failed("A", "capture_mismatch", "x", at_once=True) is None

"""Identical failures in a row per server (synthq.streaks): what counts as identical,
what ends a run."""

from __future__ import annotations

from synthq.streaks import CAPTURE_CLASSES, Streaks, shape


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

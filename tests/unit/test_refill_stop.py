"""A stopping worker's refill: nothing starts after SIGTERM, and the exit waits for the
dispatch under way to publish what it queued (else those samples sat queued without a
message until the queued deadline: tests/chaos' warm shutdown failed 1 run in 4)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest


def test_stop_waits_for_the_dispatch_under_way_and_nothing_starts_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.tasks as tasks

    started = threading.Event()
    calls: list[str] = []

    def slow_dispatch(publish: Any, *, local: Any = None) -> int:
        calls.append("begun")
        started.set()
        time.sleep(0.3)  # between its commit and its publish
        calls.append("published")
        return 1

    monkeypatch.setattr(tasks, "dispatch", slow_dispatch)
    monkeypatch.setattr(tasks, "_executor", None)
    refill = tasks._Refill(interval=0.0)
    refill.poke()
    assert started.wait(5)
    refill.stop(timeout=5.0)
    assert calls == ["begun", "published"]  # stop() returned after the publish
    refill.poke()
    time.sleep(0.2)
    assert calls == ["begun", "published"]  # no dispatch after the stop

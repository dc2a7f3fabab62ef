"""The batch writer's waits through a database outage: the one backoff curve
(synthq.core.retry.exponential) at base 0.1 s and cap 5 s, without jitter."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from synthq.serving.writer import Writer


def test_a_batch_is_retried_through_an_outage_after_0_1_s_doubling_to_5_s(
        caplog: pytest.LogCaptureFixture) -> None:
    writer = Writer(threads=1, retry_seconds=3600.0)
    failures = 9
    waits: list[float] = []

    def transaction(writes: list[Any]) -> list[Any]:
        if len(waits) < failures:
            raise OperationalError("COMMIT", {}, Exception("the server closed the connection"))
        return [w(None, None) for w in writes]

    class Abandoned:
        def is_set(self) -> bool:
            return False

        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            return False

    try:
        writer._transaction = transaction  # type: ignore[method-assign]
        writer._abandoned = Abandoned()  # type: ignore[assignment]
        future: Future[Any] = Future()
        with caplog.at_level(logging.WARNING, logger="synthq.serving.writer"):
            writer._commit([(lambda s, now: "written", future)])
        assert future.result(0) == "written"
        assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
        # Each try's line says the wait it is about to take.
        said = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
        assert [m.rsplit(" in ", 1)[1] for m in said] == \
            ["0.1 s", "0.2 s", "0.4 s", "0.8 s", "1.6 s", "3.2 s", "5.0 s", "5.0 s", "5.0 s"]
    finally:
        writer.close()

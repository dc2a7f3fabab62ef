"""Each capture attempt names its engine file anew (issue 41 item 1): a re-send while the
first attempt still runs on the server never reuses the first's name.

vLLM with synthq's connector serves a second request naming a file in flight without
a file (the connector refuses the name); with vLLM's stock code such a pair wedged the
engine for good. A capture server of the test's own holds the first attempt until the
re-send is done, and records every name it is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import LAYERS, FakeEngine, capture_answer, capture_job, engine_file
from sqlalchemy import select

pytestmark = [pytest.mark.integration]

HIDDEN = 16


class HoldingServer(FakeEngine):
    """Writes each request's file as the connector does (``<synthq_name>.safetensors``)
    and answers its path; the first request is held until :attr:`release` is set."""

    def __init__(self, engine_dir: Path) -> None:
        self.engine_dir = engine_dir
        self.names: list[str] = []
        #: Set once the first request has arrived (the first attempt runs).
        self.first_arrived = threading.Event()
        self.release = threading.Event()
        super().__init__()

    def capture(self, body: dict[str, Any]) -> Any:
        name = body["kv_transfer_params"]["synthq_name"]
        self.names.append(name)
        if len(self.names) == 1:
            self.first_arrived.set()
            self.release.wait(60)
        ids = body["prompt"]
        hidden = np.zeros((len(ids), len(LAYERS), HIDDEN), dtype=np.float32)
        hidden += np.arange(len(ids), dtype=np.float32)[:, None, None]
        path = self.engine_dir / f"{name}.safetensors"
        path.write_bytes(engine_file(hidden, ids))
        return capture_answer(path)

    def close(self) -> None:
        self.release.set()
        super().close()


@pytest.fixture
def holding(tmp_path: Path) -> Iterator[HoldingServer]:
    (tmp_path / "engine").mkdir()
    server = HoldingServer(tmp_path / "engine")
    yield server
    server.close()


def test_a_resend_while_the_first_attempt_runs_names_a_new_file(
        job_factory: Any, holding: HoldingServer) -> None:
    from synthq.capture.stage import Stage
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Sample

    job_id = capture_job(job_factory, 1, holding.url, limit=2,
                         tokens=lambda sid: np.arange(7, dtype="<i4") + 3)
    with session_scope() as s:
        sid = s.scalar(select(Sample.id).where(Sample.job_id == job_id))
    errors: list[BaseException] = []

    def first_stage() -> None:
        try:
            Stage(job_id).run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    first = threading.Thread(target=first_stage, daemon=True)
    first.start()
    assert holding.first_arrived.wait(60), "the first attempt was never sent"
    # The re-send: a process that takes every lease as expired (as `synthq capture` after
    # a crash does) claims the capture again while the server still runs the first call.
    second = Stage(job_id, reclaim_all=True).run()
    holding.release.set()
    first.join(60)
    assert not first.is_alive() and not errors, errors
    assert second.done == 1, second
    first_name, resend_name = holding.names
    assert first_name != resend_name, holding.names
    for name in holding.names:
        assert name.startswith(f"synthq-{job_id}-{sid}-"), name
    with session_scope() as s:
        capture = s.scalars(select(Capture).where(Capture.sample_id == sid)).one()
        assert (capture.state, capture.attempts) == ("done", 2)
    # The stored file is the re-send's; each attempt deleted only its own engine file.
    assert list(holding.engine_dir.iterdir()) == []

"""A full disk under a streamed run's spool (issue 43, item 5): ``synthq train JOB --features
stream`` ends with one line (the folder, the bytes the file needed), the run is handed
back, not failed, and the same command resumes it from its checkpoint: every example
trained once per epoch by the ledger's record.

A capture server of the test's own answers each request with the tiny target's own
states (transformers', in the connector's layout); the full disk is the one fault
simulated in-process (the spool's file write raises ENOSPC), as no tmpfs can be mounted
here without root.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine, capture_answer
from sqlalchemy import select, update
from training_support import capture_file, get_run

pytestmark = [pytest.mark.integration]


class TinyCaptureServer(FakeEngine):
    """``/v1/models``, ``/version`` and ``/v1/completions`` writing the tiny target's states
    of the prompt's ids into ``folder`` under the request's ``synthq_name``."""

    model = "tiny"

    def __init__(self, target: Any, folder: Path) -> None:
        self.target, self.folder = target, folder
        self.lock = threading.Lock()
        super().__init__()

    def capture(self, body: dict[str, Any]) -> Any:
        path = self.folder / f"{body['kv_transfer_params']['synthq_name']}.safetensors"
        with self.lock:
            capture_file(self.target, body["prompt"], path)
        return capture_answer(path)


@pytest.fixture
def capture_server(tiny_target: Any, tmp_path: Path) -> Iterator[TinyCaptureServer]:
    (tmp_path / "engine").mkdir()
    server = TinyCaptureServer(tiny_target, tmp_path / "engine")
    yield server
    server.close()


def test_a_full_disk_under_the_spool_hands_the_run_back_and_the_same_command_resumes(
        greedy_job: Callable[..., int], tiny_target_dir: Path,
        capture_server: TinyCaptureServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from synthq.capture.plan import drafter_layers
    from synthq.capture.store import Store
    from synthq.queue import spool_states
    from synthq.store.db import session_scope
    from synthq.store.models import Job, TrainingRun

    job_id = greedy_job(8)
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            capture_servers=[capture_server.url], capture_layers=drafter_layers(8),
            capture_limit=2))
        name = s.get_one(Job, job_id).name
    # A file: at most 48 tokens x 4 layers x 64 floats (and ids, header): about 50 KB.
    # The spool keeps 5 of them, so its 8th file is written only after a commit.
    spool = 5 * (48 * (4 * 64 * 4 + 8) + 1024)
    command = ["train", name, "--target", str(tiny_target_dir), "--features", "stream",
               "--spool", str(spool), "--batch-size", "2", "--epochs", "2",
               "--save-every", "1", "--eval-fraction", "0"]
    puts = {"n": 0}
    real_put = Store.put

    def put(self: Store, data: bytes) -> Any:
        puts["n"] += 1
        if puts["n"] == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, data)

    monkeypatch.setattr(Store, "put", put)
    from synthq.cli import app

    first = CliRunner().invoke(app, command)
    monkeypatch.undo()
    assert first.exit_code == 1, first.output
    with session_scope() as s:
        (run_id,) = s.scalars(select(TrainingRun.id).where(TrainingRun.job_id == job_id)).all()
    run = get_run(run_id)
    line = first.output.strip().splitlines()[-1]
    spool_dir = Path(run.output_dir) / "spool" / "rank0"
    assert line.startswith(f"error: run {run_id} handed back: the disk under the spool "
                           f"{spool_dir} is full"), first.output
    assert first.output.count("the disk under the spool") == 1, first.output  # one line
    assert " bytes (" in line and "rerun the same `synthq train`" in line, line
    assert run.state == "pending" and run.step >= 1, (run.state, run.step)
    trained_before = run.step
    # The same command: the run resumes from its last checkpoint and ends.
    second = CliRunner().invoke(app, command)
    assert second.exit_code == 0, second.output
    assert f"resuming training run {run_id}" in second.output
    run = get_run(run_id)
    assert run.state == "done" and run.resumed_from >= trained_before >= 1
    with session_scope() as s:
        assert spool_states.consumed_per_epoch(s, run_id) == [8, 8]
        assert s.query(TrainingRun).filter(TrainingRun.job_id == job_id).count() == 1

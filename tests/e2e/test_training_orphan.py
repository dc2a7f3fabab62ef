"""An orphaned training run with only a training worker and beat running (issue 41, item 10).

The docs' training deployment (docs/operations.md) is ``synthq worker --queues train`` and beat. The
re-send of a run whose holder died was a stage of the scheduler tick, which only a
consumer of the ``control`` queue (a generation worker) runs: the run stayed
``running`` under its dead holder for good, and nothing said so. Now the training
worker runs the readiness check itself, and ``synthq status`` names the dead holder.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from support import Proc, child_env, run_cli, wait_for

from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, TrainingRun

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: A holder on another host: only its silence (the lease) can say it is dead.
DEAD = "gone-host:4242"


def _run(run_id: int) -> TrainingRun:
    with session_scope() as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        s.expunge(run)
        return run


def _status(job_id: int) -> dict[str, Any]:
    out = run_cli("status", str(job_id), "--json", check=False)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_orphaned_run_is_sent_again_by_a_training_worker_and_beat_alone(
        pg: str, redis_url: str, job_factory: Callable[..., Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.queue import run_states as states
    from synthq.spec.config import get_settings
    from synthq.training.config import TrainConfig
    from synthq.training.runs import new_run

    monkeypatch.setenv("SYNTHQ_TRAIN_LEASE", "2")
    get_settings.cache_clear()
    job_id = job_factory(["one prompt"]).job_id
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        # The target does not exist: the worker that takes the run over fails it at once.
        run_id = new_run(s, job, target=str(tmp_path / "no-target"), trigger="manual",
                         config=TrainConfig(draft_vocab_size=64, max_steps=1)).id
    with session_scope() as s:  # a holder that stopped heart-beating a minute ago
        assert states.claim(s, run_id, "dead-token", worker=DEAD,
                            now=utcnow() - timedelta(seconds=60), lease=2)

    warnings = [w for w in _status(job_id)["warnings"] if f"training run {run_id}" in w]
    assert len(warnings) == 1 and DEAD in warnings[0] and "looks dead" in warnings[0], warnings

    worker = Proc([sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q", "train",
                   "-P", "solo", "--without-mingle", "--without-gossip", "-l", "INFO"],
                  child_env(), tmp_path / "train.log")
    beat = Proc([sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
                 "--schedule", str(tmp_path / "beat-schedule")], child_env(),
                tmp_path / "beat.log")
    try:
        taken = wait_for(lambda: (r := _run(run_id)).worker != DEAD and r, 120,
                         lambda: f"the orphaned run was not taken over: {_run(run_id).state} "
                                 f"under {_run(run_id).worker}\n{worker.log()[-3000:]}")
        assert taken.worker == f"{_hostname()}:{worker.pid}", taken.worker
        assert f"training run {run_id}: its worker {DEAD} stopped heart-beating" in worker.log()
        ended = wait_for(lambda: (r := _run(run_id)).state in ("failed", "done") and r, 120,
                         lambda: f"the run did not end: {_run(run_id).state}\n"
                                 f"{worker.log()[-3000:]}")
        assert ended.state == "failed" and ended.error, ended.error  # no target: one line
        assert not [w for w in _status(job_id)["warnings"] if f"training run {run_id}" in w]
    finally:
        beat.stop()
        worker.stop()


def _hostname() -> str:
    import socket

    return socket.gethostname()

"""``synthq serve-check`` stores the engine's figure through the training runs' one writer
(synthq.queue.run_states.record_served), on a done run only: a run requeued or cancelled
while vLLM was measured keeps its state and gets no figure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import _reset_process_state

from synthq.jobs.enqueue import JobSpec, get_or_create_job
from synthq.queue import run_states as states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import TrainingRun
from synthq.training.config import TrainConfig
from synthq.training.runs import new_run


def test_the_served_figure_lands_on_a_done_run_only(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.store.migrate import upgrade

    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    url = f"sqlite:///{tmp_path / 'synthq.db'}"
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", url)
    _reset_process_state()
    upgrade(url)
    now = utcnow()
    try:
        with session_scope() as s:
            job, _, _ = get_or_create_job(s, JobSpec(servers=["http://127.0.0.1:9/v1"],
                                                     name="j", model="m", max_tokens=8))
            done, pending = (new_run(s, job, target="/t", trigger="manual",
                                     config=TrainConfig()).id for _ in range(2))
            assert states.claim(s, done, "tok", worker="h:1", now=now, lease=120)
            assert states.finish(s, done, "tok", checkpoint="/t/final", now=now)
        with session_scope() as s:
            assert states.record_served(s, done, acceptance=2.5, engine="vllm",
                                        version="0.32.0", now=now)
            assert not states.record_served(s, pending, acceptance=2.5, engine="vllm",
                                            version="0.32.0", now=now)
        with session_scope() as s:
            row, other = s.get_one(TrainingRun, done), s.get_one(TrainingRun, pending)
            assert (row.state, row.served_acceptance_length, row.served_engine,
                    row.served_engine_version) == ("done", 2.5, "vllm", "0.32.0")
            assert (other.state, other.served_acceptance_length) == ("pending", None)
    finally:
        _reset_process_state()

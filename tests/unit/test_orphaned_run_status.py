"""`synthq status` names a training run whose holder looks dead (issue 41, item 10):
``running`` alone said it was being trained while nobody was. Both status paths (the
ordinary one and the embedded fast path, synthq.cli.fast) say the same."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
from support import _reset_process_state

from synthq.jobs.enqueue import JobSpec, find_job, get_or_create_job
from synthq.queue import run_states as states
from synthq.store.db import session_scope, utcnow
from synthq.training.config import TrainConfig
from synthq.training.runs import new_run
from synthq.views.report import job_status


def test_status_names_a_run_under_a_dead_holder(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.cli import fast
    from synthq.store.migrate import upgrade

    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    db = tmp_path / "synthq.db"
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", f"sqlite:///{db}")
    _reset_process_state()
    upgrade(f"sqlite:///{db}")
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a process
    now = utcnow()
    holders = {"silent": ("other-host:7", now - timedelta(minutes=5)),  # past the lease
               "live": ("other-host:8", now - timedelta(seconds=5)),    # within it
               "killed": (f"{socket.gethostname()}:{gone}", now)}  # gone here
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, JobSpec(servers=["http://127.0.0.1:9/v1"],
                                                 name="j", model="m", max_tokens=8))
        ids = {}
        for name, (worker, at) in holders.items():
            ids[name] = new_run(s, job, target="/nowhere", trigger="manual",
                                config=TrainConfig()).id
            assert states.claim(s, ids[name], name, worker=worker, now=at, lease=120)
    with session_scope() as s:
        ordinary = job_status(s, find_job(s, "j"), now=now).warnings
    quick = fast.job_status("j", now=now)
    assert quick is not None, "the fast path declined"
    assert quick.warnings == ordinary
    assert [w.split(":")[0] for w in ordinary] == \
        [f"training run {ids['silent']}", f"training run {ids['killed']}"], ordinary
    assert "other-host:7 looks dead (no heartbeat for 300 s)" in ordinary[0]
    assert "looks dead (its process is gone)" in ordinary[1]
    _reset_process_state()

"""The job page shows each training run's served acceptance beside the training estimate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import TOKEN

from synthq.store.db import session_scope, utcnow

pytestmark = pytest.mark.integration


def test_job_page_shows_eval_acceptance_beside_the_estimate(
        client: Any, job_factory: Callable[..., Any]) -> None:
    from synthq.queue import run_states as states

    job_id = job_factory([]).job_id
    assert client.post("/ui/login", data={"token": TOKEN}).status_code == 200  # the cookie
    page = client.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200 and "Progress" in page.text
    assert "Drafter training" not in page.text  # no run yet
    with session_scope() as s:
        run_id = states.create(s, job_id=job_id, trigger="manual", target="/m", settings={},
                               output_dir="/tmp/run{run}", now=utcnow())
        from synthq.store.models import TrainingRun

        run = s.get(TrainingRun, run_id)
        assert run is not None
        run.metrics = [{"step": 40, "loss": 0.5, "acc": [0.9] * 7, "accept": 5.97}]
        run.step, run.eval_acceptance_length = 40, 2.514
    page = client.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200
    assert "Drafter training" in page.text
    row = page.text[page.text.index(f'data-run="{run_id}"'):]
    assert "5.97" in row and "<b>2.51</b>" in row


def test_served_acceptance_is_on_the_page_and_in_the_api_beside_synthqs_own(
        client: Any, job_factory: Callable[..., Any]) -> None:
    from synthq.queue import run_states as states
    from synthq.store.models import TrainingRun

    job_id = job_factory([]).job_id
    with session_scope() as s:
        run_id = states.create(s, job_id=job_id, trigger="manual", target="/m", settings={},
                               output_dir="/tmp/run{run}", now=utcnow())
        run = s.get_one(TrainingRun, run_id)
        run.eval_acceptance_length, run.served_acceptance_length = 4.19, 4.27
        run.served_engine, run.served_engine_version = "vllm", "0.32.0"
    runs = client.get(f"/api/jobs/{job_id}/training-runs")
    assert runs.status_code == 200
    [row] = runs.json()
    assert (row["id"], row["eval_acceptance_length"], row["served_acceptance_length"],
            row["served_engine"], row["served_engine_version"]) == (
        run_id, 4.19, 4.27, "vllm", "0.32.0")
    assert client.get("/api/jobs/no-such-job/training-runs").status_code == 404
    assert client.post("/ui/login", data={"token": TOKEN}).status_code == 200
    page = client.get(f"/ui/jobs/{job_id}").text
    cell = page[page.index('class="num served-accept"'):]
    assert cell.index("<b>4.27</b>") < cell.index("vllm 0.32.0") < cell.index("</td>")


def test_a_streamed_runs_spool_is_in_the_api(
        client: Any, job_factory: Callable[..., Any]) -> None:
    """Issue 43: the run record carries the spool's high-water mark and the examples
    consumed per epoch (the ledger's rows); the job's status shows the open run's spool."""
    from synthq.queue import run_states as states
    from synthq.queue import spool_states
    from synthq.store.models import TrainingRun

    job_id = job_factory([]).job_id
    with session_scope() as s:
        now = utcnow()
        run_id = states.create(s, job_id=job_id, trigger="manual", target="/m",
                               settings={"hidden_states": "stream", "spool": 4096},
                               output_dir="/tmp/run{run}", now=now)
        run = s.get_one(TrainingRun, run_id)
        run.spool_size, run.spool_bytes, run.spool_files = 4096, 3000, 2
        run.spool_high_water, run.spool_lead = 4000, 1
        spool_states.add_epoch(s, run_id, 0, 0, ["1", "2", "3"], now=now)
        spool_states.add_epoch(s, run_id, 0, 1, ["1", "2", "3"], now=now)
        first = {r.example: r.id for r in spool_states.items(s, run_id, epoch=0)}
        for example in ("1", "2", "3"):
            assert spool_states.offer(s, first[example], path=f"ab/{example}", nbytes=1000,
                                      captured=True, now=now)
        assert spool_states.take(s, list(first.values()), token="t", worker="w", step=1,
                                 lease=60, now=now) == 3
        assert spool_states.commit(s, run_id, token="t", step=1, now=now) == 3
        assert spool_states.commit(s, run_id, token="other", step=9, now=now) == 0
    [row] = client.get(f"/api/jobs/{job_id}/training-runs").json()
    assert (row["spool_size"], row["spool_high_water"], row["spool_bytes"],
            row["spool_files"], row["spool_lead"]) == (4096, 4000, 3000, 2, 1)
    assert row["consumed_per_epoch"] == [3]
    status = client.get(f"/api/jobs/{job_id}").json()
    assert status["spool"] == [{"run": run_id, "state": "pending", "size": 4096, "bytes": 3000,
                                "files": 2, "high_water": 4000, "lead": 1}]
    assert client.post("/ui/login", data={"token": TOKEN}).status_code == 200
    page = client.get(f"/ui/jobs/{job_id}").text
    row = page[page.index(f'data-run="{run_id}"'):]
    assert "high-water 4,000 B" in row and "consumed per epoch [3]" in row

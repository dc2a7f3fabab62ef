"""One record per thing shown: a training run and a job's capture stage are the same
record in the API and in the CLI's --json (a field in one and not the other fails)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from support import capture_rows, run_cli

from synthq.store.db import session_scope, utcnow

pytestmark = pytest.mark.integration


def test_a_training_run_is_one_record_in_the_api_and_in_runs_json(
        client: Any, job_factory: Callable[..., Any]) -> None:
    from synthq.queue import run_states as states
    from synthq.store.models import TrainingRun

    report = job_factory([])
    with session_scope() as s:
        run_id = states.create(s, job_id=report.job_id, trigger="manual", target="/m",
                               settings={"epochs": 1}, output_dir="/tmp/run{run}", now=utcnow())
        run = s.get_one(TrainingRun, run_id)
        run.metrics = [{"step": 4, "loss": 0.5, "acc": [0.9], "accept": 2.5}]
        run.step, run.eval_acceptance_length = 4, 2.25
    [api] = client.get(f"/api/jobs/{report.job_id}/training-runs").json()
    [cli] = json.loads(run_cli("runs", str(report.job_id), "--json").stdout)
    assert set(api) == set(cli), set(api) ^ set(cli)
    assert api == cli
    assert (api["loss"], api["accept"], api["eval_acceptance_length"]) == (0.5, 2.5, 2.25)


def test_a_capture_stage_is_one_record_in_status_and_capture_json(
        client: Any, job_factory: Callable[..., Any]) -> None:
    from synthq.store.models import Job

    url = "http://127.0.0.1:9/v1"
    report = job_factory([f"p{i}" for i in range(5)], servers=[url])
    with session_scope() as s:
        job = s.get_one(Job, report.job_id)
        job.capture_servers, job.capture_layers = [url], [2, 4, 5, 8]
    capture_rows(report.job_id, url)
    # (--plan gives every done sample its pending capture first, as the stage does.)
    own = json.loads(run_cli("capture", str(report.job_id), "--plan", "--json").stdout)
    status = json.loads(run_cli("status", str(report.job_id), "--json").stdout)["capture"]
    api = client.get(f"/api/jobs/{report.job_id}").json()["capture"]
    assert own.pop("plan")
    for record in (status, api, own):
        record.pop("free_bytes")  # the disk moves
    assert set(own) == set(status) == set(api), set(own) ^ set(status)
    assert own == status == api
    assert own["done"] == 1 and own["failures"] == {"capture_mismatch": 1}

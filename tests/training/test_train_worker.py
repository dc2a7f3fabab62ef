"""The train queue with real processes: a Celery training worker killed mid-run resumes,
and the `synthq train` / `synthq runs` / `synthq worker --queues` commands."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import Proc, child_env, run_cli, wait_for

from synthq.store.db import session_scope
from synthq.store.models import Job, TrainingRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run_row(run_id: int) -> TrainingRun:
    with session_scope() as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        s.expunge(run)
        return run


def _describe(run_id: int, proc: Proc) -> str:
    run = _run_row(run_id)
    alive = "running" if proc.proc.poll() is None else f"exited with {proc.proc.returncode}"
    return (f"run {run.state} at step {run.step} ({run.error}); the worker {alive}:\n"
            f"{proc.log()[-3000:]}")


def _wait_ready(proc: Proc, timeout: float) -> None:
    """Until the Celery worker says it is ready; fails at once if it exits first."""
    def ready() -> bool:
        assert proc.proc.poll() is None, f"the worker exited: {proc.log()[-3000:]}"
        return "ready." in proc.log()

    wait_for(ready, timeout, lambda: f"the worker did not start: {proc.log()[-3000:]}")


def synthq(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=child_env(**env), timeout=300, check=False)


def test_killed_training_worker_resumes_from_its_last_checkpoint(
        pg: str, redis_url: str, greedy_job: Callable[..., int], tiny_target_dir: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.spec.config import get_settings
    from synthq.training.config import TrainConfig
    from synthq.training.readiness import check_readiness
    from synthq.training.runs import new_run
    from worker.tasks import publish_train

    monkeypatch.setenv("SYNTHQ_TRAIN_LEASE", "3")
    get_settings.cache_clear()
    job_id = greedy_job(16)
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        run_id = new_run(s, job, target=str(tiny_target_dir), trigger="manual",
                         config=TrainConfig(draft_vocab_size=64, batch_size=2, epochs=30,
                                            max_steps=70, lr=1e-2, save_every=10,
                                            log_every=5)).id
    cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q", "train", "-P",
           "solo", "--without-mingle", "--without-gossip", "-l", "INFO"]
    first = Proc(cmd, child_env(), tmp_path / "train1.log")
    second = None
    try:
        publish_train([run_id])
        # Start-up first, then the steps: on a loaded machine (the suite's vLLM beside it)
        # either may be slow, and each wait's message says which part did not happen.
        _wait_ready(first, 300)
        wait_for(lambda: _run_row(run_id).step >= 25, 120,
                 lambda: f"training did not reach step 25: {_describe(run_id, first)}")
        first.kill9()
        killed = _run_row(run_id)
        assert killed.state == "running" and killed.checkpoint is not None
        saved = int(Path(killed.checkpoint).name.split("-")[1])
        assert saved >= 20 and saved % 10 == 0
        # Beat's readiness check notices the silent run and sends it again.
        wait_for(lambda: check_readiness(publish_train).to_send == [run_id], 20,
                 "the orphaned run was not sent again")
        second = Proc(cmd, child_env(), tmp_path / "train2.log")
        _wait_ready(second, 300)
        run = wait_for(lambda: (r := _run_row(run_id)).state in ("done", "failed") and r, 180,
                       lambda: f"the run did not finish: {_describe(run_id, second)}")
        assert run.state == "done", run.error
        assert run.resumed_from >= saved and run.step == 70
        assert Path(run.checkpoint or "").name == "final"
        steps = [m["step"] for m in run.metrics]
        assert steps == sorted(set(steps)) and steps[-1] == 70
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_train_and_runs_commands(pg: str, greedy_job: Callable[..., int],
                                 tiny_target_dir: Path, tmp_path: Path) -> None:
    job_id = greedy_job(4)
    env = {"SYNTHQ_BROKER_URL": "", "COLUMNS": "400"}
    # Bad input: one error line, exit 2, no traceback.
    bad = [["train", str(job_id), "--target", str(tmp_path)],           # no config.json
           ["train", "nope", "--target", str(tiny_target_dir)],         # no such job
           ["train", str(job_id), "--target", str(tiny_target_dir), "--when", "soon"],
           ["train", str(job_id), "--target", str(tiny_target_dir), "--lr", "5"],
           ["train", str(job_id), "--target", str(tiny_target_dir), "--hidden-states", "x"],
           ["train", str(job_id), "--target", str(tiny_target_dir), "--eval-fraction", "0.9"],
           ["train", str(job_id), "--target", str(tiny_target_dir), "--keep-checkpoints", "0"],
           ["train", str(job_id)],                                      # no stored target
           ["runs", "nope"], ["runs", "--interval", "0"],
           ["worker", "--queues", "train,generate"]]
    for args in bad:
        result = synthq(*args, **env)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, result.stderr)
    helped = synthq("train", "--help", COLUMNS="400").stdout
    assert "Example:" in helped
    options = helped[helped.index("Options"):]
    blocks = {b.split()[0].split(",")[0]: b for b in options.split("│ --")[1:]}  # by first name
    for option in ("epochs", "lr", "eval-fraction", "eval-every", "eval-draft-tokens",
                   "keep-checkpoints", "hidden-states", "draft-vocab-size", "max-len"):
        assert "[default:" in blocks[option], blocks[option]
    assert "[default: 10]" in blocks["epochs"] and "[default: 4]" in blocks["eval-draft-tokens"]
    assert "Example:" in synthq("runs", "--help").stdout

    # Arm the job: the target and threshold are stored on it.
    armed = synthq("train", str(job_id), "--target", str(tiny_target_dir), "--when", "done:0.9",
                   "--epochs", "2", "--json", **env)
    assert armed.returncode == 0, armed.stderr
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert (job.train_when, job.train_target, job.train_settings["epochs"]) == \
            ("done:0.9", str(tiny_target_dir), 2)

    # Without a broker, `synthq train` trains in this process to the end.
    result = synthq("train", str(job_id), "--max-steps", "3", "--draft-vocab-size", "32",
                    "--log-every", "1", "--json", **env)
    assert result.returncode == 0, result.stderr
    row: dict[str, Any] = json.loads(result.stdout)
    assert row["state"] == "done" and row["step"] == 3
    # 1 of the 4 examples was held out; the served acceptance length was measured on it.
    assert isinstance(row["eval_acceptance_length"], float) and \
        row["eval_acceptance_length"] >= 1.0
    assert Path(row["checkpoint"], "model.safetensors").is_file()
    listed = json.loads(synthq("runs", str(job_id), "--json", **env).stdout)
    assert [(r["id"], r["state"], r["checkpoint"], r["eval_acceptance_length"])
            for r in listed] == [(row["id"], "done", row["checkpoint"],
                                  row["eval_acceptance_length"])]
    table = synthq("runs", **env)
    assert table.returncode == 0 and "done" in table.stdout
    assert "eval accept" in table.stdout and f"{row['eval_acceptance_length']:.2f}" in table.stdout
    watched = synthq("runs", str(job_id), "--watch", "--interval", "0.1", **env)
    assert watched.returncode == 0 and "done" in watched.stdout

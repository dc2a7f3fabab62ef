"""Creating and listing training runs (no torch: the CLI, the API and beat use it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from synthq.config import get_settings
from synthq.db import utcnow
from synthq.errors import UserError
from synthq.models import Job, TrainingRun
from synthq.training import states
from synthq.training.config import TrainConfig

__all__ = ["new_run", "default_output_dir", "run_dict", "list_runs", "check_target"]


def default_output_dir(job_name: str) -> str:
    """``<data_dir>/runs/<job>-run<id>`` (``{run}`` is filled in when the row exists)."""
    base = Path(get_settings().data_dir).expanduser().absolute() / "runs"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_name)
    return str(base / f"{safe}-run{{run}}")


def check_target(target: str) -> None:
    """A local target directory must hold a config.json (a hub id is checked by the worker)."""
    path = Path(target).expanduser()
    looks_local = target.startswith(("/", ".", "~")) or path.exists()
    if looks_local and not (path / "config.json").is_file():
        raise UserError(f"--target {target}: no config.json there; give the target model's "
                        "directory (or a Hugging Face id)")


def new_run(session: Session, job: Job, *, target: str, config: TrainConfig, trigger: str,
            output_dir: str | None = None) -> TrainingRun:
    """A pending run of ``job``'s data for ``target``."""
    config.check()
    run_id = states.create(session, job_id=job.id, trigger=trigger, target=target,
                           settings=config.to_dict(),
                           output_dir=output_dir or default_output_dir(job.name), now=utcnow())
    run = session.get(TrainingRun, run_id)
    assert run is not None
    return run


def run_dict(run: TrainingRun, job_name: str | None = None) -> dict[str, Any]:
    """A run as JSON: what ``synthq runs --json`` prints."""
    last = run.metrics[-1] if run.metrics else {}
    return {
        "id": run.id, "job_id": run.job_id, "job": job_name, "state": str(run.state),
        "trigger": run.trigger, "target": run.target,
        "drafter": (run.settings or {}).get("drafter", "eagle3"), "step": run.step,
        "total_steps": run.total_steps, "resumed_from": run.resumed_from,
        "loss": last.get("loss"), "acc": last.get("acc"), "accept": last.get("accept"),
        "eval_acceptance_length": run.eval_acceptance_length,
        "served_acceptance_length": run.served_acceptance_length,
        "served_engine": run.served_engine, "served_engine_version": run.served_engine_version,
        "checkpoint": run.checkpoint, "output_dir": run.output_dir, "error": run.error,
        "worker": run.worker, "settings": run.settings,
        "created_at": run.created_at.isoformat(),
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "heartbeat_at": run.heartbeat_at.isoformat() if run.heartbeat_at else None,
    }


def list_runs(session: Session, job_id: int | None = None) -> list[dict[str, Any]]:
    q = select(TrainingRun, Job.name).join(Job, Job.id == TrainingRun.job_id)
    if job_id is not None:
        q = q.where(TrainingRun.job_id == job_id)
    return [run_dict(run, name) for run, name in session.execute(q.order_by(TrainingRun.id))]

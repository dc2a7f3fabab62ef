"""Creating and listing training runs (no torch: the CLI, the API and beat use it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from synthq.core.errors import UserError
from synthq.queue import run_states as states
from synthq.queue import spool_states
from synthq.spec.config import get_settings
from synthq.store.db import utcnow
from synthq.store.models import Job, TrainingRun
from synthq.training.config import TrainConfig

__all__ = ["RunRecord", "new_run", "default_output_dir", "run_record", "run_dict", "list_runs",
           "check_target", "check_trainable", "check_vocabulary"]


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


def check_trainable(job: Job) -> None:
    """A job without a tokenizer has no training examples. ``synthq train`` said so only
    through the export it runs, with the export's advice (``use --format jsonl``), which
    train does not take: say what train needs instead."""
    if not job.tokenizer:
        raise UserError(
            f"job {job.name} has no tokenizer, so no training examples: tokenize its stored "
            f"answers first, with no new calls, `synthq retokenize {job.name} --tokenizer "
            f"TARGET` (the target model's folder or Hugging Face id), then `synthq train "
            f"{job.name}` again")


#: Done samples whose token ids :func:`check_vocabulary` reads.
VOCAB_SAMPLE = 200


def check_same_examples(output_dir: str | Path, job: Job) -> None:
    """A streamed run resumes on its snapshot of the job's examples (OUT/data); one whose
    job was retokenized since would capture other tokens than its checkpoint saw: refused
    with one line, the run kept as it is."""
    import json

    manifest = Path(output_dir) / "data" / "manifest.json"
    try:
        version = json.loads(manifest.read_text())["settings"]["tokenize_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if version != job.tokenize_version:
        raise UserError(f"job {job.name} was retokenized (tokenize version {version} → "
                        f"{job.tokenize_version}) since its streamed run's last checkpoint: "
                        "the examples it trained on changed; start a new run with `synthq "
                        f"train {job.name} --restart ...`")


def check_vocabulary(session: Session, job: Job, target: str) -> None:
    """Refuse, before a run is made, a local target whose vocabulary is smaller than the
    ids of the job's examples: training read them as far as the draft vocabulary and
    failed there with ``token id 45585, beyond the target's vocabulary of 400`` (the
    README's tiny target against the demo's DeepSeek-V3 ids). A few hundred examples are
    read; a Hugging Face id is left to the training worker."""
    import json

    from synthq.core.packing import unpack_ids
    from synthq.store.models import Sample

    config = Path(target).expanduser() / "config.json"
    if not config.is_file():
        return
    try:
        vocab = int(json.loads(config.read_text()).get("vocab_size") or 0)
    except (OSError, ValueError, TypeError):
        return  # the loader says what is wrong with it
    top = -1
    for data in session.scalars(select(Sample.input_ids).where(
            Sample.job_id == job.id, Sample.state == "done", Sample.input_ids.is_not(None))
            .limit(VOCAB_SAMPLE)):
        ids = unpack_ids(data)
        if ids is not None and ids.size:
            top = max(top, int(ids.max()))
    if vocab and top >= vocab:
        raise UserError(
            f"job {job.name} holds token id {top:,}, beyond the vocabulary of --target "
            f"{target} ({vocab:,} tokens): its examples were tokenized with {job.tokenizer}, "
            f"not this target's tokenizer. Train with the target of that tokenizer, or "
            f"tokenize the stored answers for this one first, with no new calls: `synthq "
            f"retokenize {job.name} --tokenizer {target}`")


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


@dataclass(frozen=True)
class RunRecord:
    """A drafter training run, the one record of it: what ``synthq runs --json`` prints and
    ``GET /api/jobs/{job}/training-runs`` returns. Times are ISO 8601 text."""

    id: int
    job_id: int
    job: str | None
    state: str
    trigger: str
    target: str
    #: The drafter family (``eagle3``, ``dflash``).
    drafter: str
    step: int
    total_steps: int | None
    resumed_from: int
    #: The last logged step's loss, accuracy and teacher-forced acceptance estimate
    #: (optimistic).
    loss: float | None
    #: (per position of the unrolled steps)
    acc: list[float] | float | None
    accept: float | None
    #: synthq's greedy draft-and-verify on the held-out split.
    eval_acceptance_length: float | None
    #: Measured by a real engine serving the drafter (``synthq serve-check``): trust this.
    served_acceptance_length: float | None
    served_engine: str | None
    served_engine_version: str | None
    checkpoint: str | None
    output_dir: str
    error: str | None
    worker: str | None
    settings: dict[str, Any]
    created_at: str
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None
    #: ``--features stream``: the spool's bound, what it holds (bytes, files), the most
    #: it held at once (bytes), the examples captured ahead of the trainer, and the
    #: examples consumed (trained on into a committed checkpoint) in each epoch.
    spool_size: int | None = None
    spool_bytes: int | None = None
    spool_files: int | None = None
    spool_high_water: int | None = None
    spool_lead: int | None = None
    consumed_per_epoch: list[int] | None = None


def _iso(at: Any) -> str | None:
    return at.isoformat() if at else None


def run_record(run: TrainingRun, job_name: str | None = None,
               consumed: list[int] | None = None) -> RunRecord:
    last = run.metrics[-1] if run.metrics else {}
    return RunRecord(
        id=run.id, job_id=run.job_id, job=job_name, state=str(run.state), trigger=run.trigger,
        target=run.target, drafter=(run.settings or {}).get("drafter", "eagle3"),
        step=run.step, total_steps=run.total_steps,
        resumed_from=run.resumed_from, loss=last.get("loss"), acc=last.get("acc"),
        accept=last.get("accept"), eval_acceptance_length=run.eval_acceptance_length,
        served_acceptance_length=run.served_acceptance_length,
        served_engine=run.served_engine, served_engine_version=run.served_engine_version,
        checkpoint=run.checkpoint, output_dir=run.output_dir, error=run.error,
        worker=run.worker, settings=run.settings, created_at=run.created_at.isoformat(),
        started_at=_iso(run.started_at), finished_at=_iso(run.finished_at),
        heartbeat_at=_iso(run.heartbeat_at), spool_size=run.spool_size,
        spool_bytes=run.spool_bytes, spool_files=run.spool_files,
        spool_high_water=run.spool_high_water, spool_lead=run.spool_lead,
        consumed_per_epoch=consumed)


def run_dict(run: TrainingRun, job_name: str | None = None,
             consumed: list[int] | None = None) -> dict[str, Any]:
    """A run as JSON (:class:`RunRecord`): what ``synthq runs --json`` prints."""
    return asdict(run_record(run, job_name, consumed))


def list_runs(session: Session, job_id: int | None = None) -> list[dict[str, Any]]:
    q = select(TrainingRun, Job.name).join(Job, Job.id == TrainingRun.job_id)
    if job_id is not None:
        q = q.where(TrainingRun.job_id == job_id)
    return [run_dict(run, name, spool_states.consumed_per_epoch(session, run.id)
                     if run.spool_size else None)
            for run, name in session.execute(q.order_by(TrainingRun.id))]

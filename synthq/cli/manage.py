"""Repairing and steering jobs: `synthq requeue`, `pause`, `resume`, `cancel`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from synthq.cli import (
    JobArg,
    app,
    console,
    escape,
    fail,
    warn,
    with_job,
)
from synthq.cli.options import with_settings
from synthq.core.errors import UserError
from synthq.spec import jobspec


@app.command()
@with_settings([s.name for s in jobspec.SETTINGS if s.requeue], mode="requeue")
def requeue(
    job: JobArg,
    failed: Annotated[bool, typer.Option("--failed", help="Requeue failed samples "
                      "(the default when nothing else is given).")] = False,
    error_class: Annotated[list[str] | None, typer.Option("--class", help="Only failures of "
                           "this class (timeout, stalled, connection, rate_limited, "
                           "server_error, bad_request, context_length, empty_response, "
                           "truncated, ...). Repeatable.")] = None,
    sample: Annotated[list[int] | None, typer.Option("--sample", help="Only this sample id. "
                      "Repeatable.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Send the job's "
                     "remaining work (pending and requeued samples) to this model from now "
                     "on; done samples keep their answers.")] = None,
    server: Annotated[list[str] | None, typer.Option("--server", "-s", help="Send the job's "
                      "remaining work to these servers from now on. Repeatable.")] = None,
    *, settings: dict[str, Any],
) -> None:
    """Move failed samples back to pending with a fresh attempt budget.

    With `--model` or `--server`, the job's remaining work moves to a corrected
    model or server first (recorded on the job; see `synthq status`). With
    `--max-tokens`, `--temperature`, ... the requeued samples (only they) run
    with those settings from now on; `synthq sample ID` shows them. `--class
    truncated` also takes the done samples whose answer hit max_tokens.

    Example: `synthq requeue my-job --class truncated --max-tokens 8192`
    """
    from sqlalchemy import func, select

    from synthq.app import service
    from synthq.cli.options import api_values
    from synthq.jobs.enqueue import JobSpec
    from synthq.queue import jobs, states
    from synthq.serving.health import check_model
    from synthq.store.db import utcnow
    from synthq.store.models import Sample

    try:
        service.check_classes(error_class or [])
        values = api_values(settings)
        overrides, limits = jobspec.requeue_settings(values)
    except UserError as exc:
        raise fail(str(exc)) from None
    servers = [u.rstrip("/") for u in server] if server else None
    if model is not None or servers is not None:
        current_model, current_servers = with_job(job, lambda s, j: (j.model, list(j.servers)))
        try:
            JobSpec(name="x", model=model or current_model,
                    servers=servers or current_servers).check()
            for line in check_model(servers or current_servers, model or current_model):
                warn(line)
        except UserError as exc:
            raise fail(str(exc)) from None

    def go(s, j):  # type: ignore[no-untyped-def]
        now = utcnow()
        old_model = j.model
        n = service.requeue_with(s, j, classes=error_class or [], sample_ids=sample or [],
                                 settings=values)
        if model is not None or servers is not None:
            jobs.move_job(s, j, model=model, servers=servers, requeued=n, now=now)
        done = 0
        if model is not None and model != old_model:
            done = s.scalar(select(func.count()).select_from(Sample).where(
                Sample.job_id == j.id, Sample.state == states.SampleState.DONE)) or 0
        return n, old_model, done

    n, old_model, done = with_job(job, go)
    if model is not None and model != old_model:
        console.print(f"job {escape(job)}: model {escape(old_model)} → {escape(model)} for its "
                      f"remaining work; {done:,} done samples keep their answers from "
                      f"{escape(old_model)}")
    if servers is not None:
        console.print(f"job {escape(job)}: servers now {escape(', '.join(servers))}")
    if limits is not None:
        what = (f"auto ({limits['min_inflight']}–{limits['inflight_limit']})"
                if limits["inflight_auto"] else str(limits["inflight_limit"]))
        console.print(f"job {escape(job)}: in-flight limit now {what}")
    kind = "truncated or failed" if "truncated" in (error_class or []) else "failed"
    console.print(f"requeued {n:,} {kind} samples" + ("" if n else
                  " (nothing matched: see `synthq status`)"))
    if n and overrides:
        shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
        console.print(f"  with their own settings: {escape(shown)}")


def _set_job_state(ref: str, target: str) -> None:
    from synthq.app import service
    from synthq.core.enums import JobState

    before = with_job(ref, lambda s, j: service.set_job_state(s, j, JobState(target)))
    console.print(f"job {escape(ref)}: {before} → {target}")


@app.command()
def pause(job: JobArg) -> None:
    """Stop dispatching a job's samples; calls in flight finish.

    Example: `synthq pause my-job`
    """
    _set_job_state(job, "paused")


@app.command()
def resume(job: JobArg) -> None:
    """Dispatch a paused job again.

    Example: `synthq resume my-job`
    """
    _set_job_state(job, "active")


@app.command()
def cancel(job: JobArg) -> None:
    """Stop a job for good (its samples and results stay in the database).

    Example: `synthq cancel my-job`
    """
    _set_job_state(job, "cancelled")

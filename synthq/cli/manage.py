"""Repairing and steering jobs: `synthq requeue`, `pause`, `resume`, `cancel`."""

from __future__ import annotations

from typing import Annotated

import typer

from synthq.cli import (
    JobArg,
    app,
    console,
    fail,
    with_job,
)
from synthq.errors import UserError


@app.command()
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
) -> None:
    """Move failed samples back to pending with a fresh attempt budget.

    Example: `synthq requeue my-job --failed --class timeout --class stalled`
    """
    from synthq import states
    from synthq.db import utcnow
    from synthq.errors import PERMANENT_CLASSES, RETRYABLE_CLASSES

    known = RETRYABLE_CLASSES | PERMANENT_CLASSES
    for c in error_class or []:
        if c not in known:
            raise fail(f"unknown class {c!r}; known: {', '.join(sorted(known))}")

    def go(s, j) -> int:  # type: ignore[no-untyped-def]
        return states.requeue(s, j.id, classes=error_class or [], sample_ids=sample or [],
                              now=utcnow())

    n = with_job(job, go)
    console.print(f"requeued {n:,} failed samples" + ("" if n else
                  " (nothing matched: see `synthq status`)"))


def _set_job_state(ref: str, target: str) -> None:
    from synthq import states
    from synthq.db import utcnow
    from synthq.enums import JobState

    def go(s, j) -> str:  # type: ignore[no-untyped-def]
        before = str(j.state)
        if not states.set_job_state(s, j.id, JobState(target), now=utcnow()):
            if j.state == JobState.CANCELLED:
                raise UserError(f"job {j.name} is cancelled; it cannot be resumed or paused")
            raise UserError(f"job {j.name} is {before}; it cannot become {target}")
        return before

    before = with_job(ref, go)
    console.print(f"job {ref}: {before} → {target}")


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

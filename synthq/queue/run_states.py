"""Training run states and every training run transition.

Training runs are one kind of leased work (:data:`RUNS`): the claim, the
compare-and-set and the expiry are :mod:`synthq.queue.ledger`'s, as for samples and
captures. Each transition is one compare-and-set ``UPDATE`` naming its allowed
sources; the process that trains a run holds a random
``claim`` token and presents it on every write, so a worker that lost its run
(its heartbeat went stale and another worker took it over) cannot write to it.

::

    pending ──claim──▶ running ──finish──▶ done
       ▲                 │ │
       ├──stale sweep────┤ └──fail──▶ failed
       └──release────────┘ (the holder stops: Ctrl-C)
    (pending/running ──cancel──▶ cancelled)

A run's lease is its holder's heartbeat (``heartbeat_at``): a running run whose
heartbeat is older than the lease is claimable again. It is claimed again at
once, not after the lease, when its holder is a process on the claiming host
that no longer exists (``dead_worker``, found by :func:`synthq.queue.workers.dead_holder_here`:
kill -9). Runs have no attempt cap: a stale run always goes back to pending.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from synthq.core.enums import RunState
from synthq.queue import ledger
from synthq.spec.config import get_settings
from synthq.store.models import TrainingRun

__all__ = ["RUNS", "RunState", "OPEN", "create", "claim", "progress", "finish", "fail",
           "cancel", "release", "sweep_stale", "record_served"]

def _lease(_: Any = None) -> float:
    """A run's lease: the service's ``train_lease`` seconds after its holder's last beat."""
    return get_settings().train_lease


#: Training runs as a kind of leased work: claimed from pending, the lease their
#: holder's heartbeat (``train_lease`` seconds), which beats every quarter of the lease,
#: at least 1 s apart (a training worker's own readiness check keeps the same period); no
#: attempt budget and no retry: the holder hands a run back (release) or fails it.
RUNS = ledger.Kind("training run", TrainingRun, waiting=RunState.PENDING,
                   held=RunState.RUNNING, done=RunState.DONE, failed=RunState.FAILED,
                   cancelled=RunState.CANCELLED, lease="heartbeat_at", holder="row",
                   lease_length=_lease, renew_per_lease=4, renew_floor=1.0)


#: States in which a run still has work to do.
OPEN = (RunState.PENDING, RunState.RUNNING)


def create(session: Session, *, job_id: int, trigger: str, target: str,
           settings: dict[str, Any], output_dir: str, now: datetime) -> int:
    """A new pending run; returns its id. ``output_dir`` may name ``{run}``."""
    run = TrainingRun(job_id=job_id, state=RunState.PENDING, trigger=trigger, target=target,
                      settings=settings, metrics=[], output_dir=output_dir, step=0,
                      resumed_from=0, created_at=now, updated_at=now)
    session.add(run)
    session.flush()
    if "{run}" in output_dir:
        run.output_dir = output_dir.replace("{run}", str(run.id))
    return int(run.id)


def claim(session: Session, run_id: int, token: str, *, worker: str, now: datetime,
          lease: float, dead_worker: str | None = None) -> bool:
    """pending → running, or a running run whose holder is gone (:func:`synthq.queue.
    ledger.gone`): its heartbeat older than ``lease`` seconds, or it is ``dead_worker`` (a
    process the caller knows is gone: :func:`synthq.queue.workers.dead_holder_here`)."""
    gone = ledger.gone(RUNS, now=now, lease=lease,
                       dead=[dead_worker] if dead_worker is not None else [])
    sources = [TrainingRun.state.in_(ledger.allowed(RUNS, "claim")), gone]
    result = ledger.claim(session, RUNS, [TrainingRun.id == run_id, or_(*sources)],
                          token=token, worker=worker, lease=now, now=now,
                          values=dict(error=None))
    return result.rowcount == 1  # type: ignore[no-any-return]


def _stale(now: datetime, lease: float) -> Any:
    """A running run whose holder's heartbeat is older than ``lease`` seconds."""
    return ledger.gone(RUNS, now=now, lease=lease)


def progress(session: Session, run_id: int, token: str, *, now: datetime,
             **values: Any) -> bool:
    """running → running: heartbeat plus any of step, total_steps, metrics, checkpoint.

    False means the run is no longer this process's (cancelled, or taken over).
    """
    return ledger.move(session, RUNS, "renew", run_id, token, now=now, heartbeat_at=now,
                       updated_at=now, **values)


def finish(session: Session, run_id: int, token: str, *, checkpoint: str, now: datetime,
           **values: Any) -> bool:
    """running → done, with the final checkpoint."""
    return ledger.move(session, RUNS, "finish", run_id, token, now=now, checkpoint=checkpoint,
                       heartbeat_at=now, **values)


def fail(session: Session, run_id: int, token: str | None, *, error: str, now: datetime) -> bool:
    """running → failed (with the claim), or pending → failed (``token`` None)."""
    if token is not None:
        return ledger.move(session, RUNS, "fail", run_id, token, now=now, error=error)
    return ledger.move(session, RUNS, "refuse", run_id, None, now=now, error=error)


def release(session: Session, run_id: int, token: str, *, reason: str, now: datetime) -> bool:
    """running → pending: the holder stops (Ctrl-C) and hands the run back at once, so
    the next ``synthq train`` (or a worker) resumes it from its last checkpoint."""
    return ledger.move(session, RUNS, "release", run_id, token, now=now, error=reason)


def cancel(session: Session, run_id: int, *, now: datetime) -> bool:
    """pending/running → cancelled; the training process stops at its next heartbeat."""
    return ledger.move(session, RUNS, "cancel", run_id, None, now=now)


def record_served(session: Session, run_id: int, *, acceptance: float, engine: str,
                  version: str | None, now: datetime) -> bool:
    """The acceptance length an engine served the done run's drafter at (``synthq
    serve-check``), beside its own estimate; the state stays done."""
    return ledger.move(session, RUNS, "annotate", run_id, None, now=now,
                       served_acceptance_length=acceptance, served_engine=engine,
                       served_engine_version=version, updated_at=now)


def sweep_stale(session: Session, *, now: datetime, lease: float, resend_after: float) -> list[int]:
    """Runs that need a (new) ``train`` message; returns their ids.

    A running run whose heartbeat is older than ``lease`` (its worker died)
    goes back to pending; a pending run untouched for ``resend_after`` seconds
    (its message may have died with the broker) is touched. The caller
    publishes a message for each; a duplicate is harmless (the claim is a CAS).
    """
    stale = ledger.expire(
        session, RUNS, now=now, gone=_stale(now, lease),
        back=dict(error="the training worker stopped heart-beating; resuming from the last "
                        "checkpoint")).back
    waiting = list(session.scalars(
        select(TrainingRun.id).where(TrainingRun.state == RunState.PENDING,
                                     TrainingRun.updated_at < now - timedelta(seconds=resend_after))
        .with_for_update(skip_locked=True)))
    if waiting:
        ledger.apply(session, RUNS, "touch", [TrainingRun.id.in_(waiting)], now=now,
                     updated_at=now)
    return sorted(stale + waiting)

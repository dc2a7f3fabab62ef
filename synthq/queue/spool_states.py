"""Every write to ``spool_items``: the spool's consumption, one more kind of leased work.

A streamed training run (``synthq train JOB --features stream --spool SIZE``,
:mod:`synthq.capture.spool`, :mod:`synthq.training.stream`) has one row per example per
epoch, in its rank's shard. Its capture asks the engine for the examples the trainer
will take next and *offers* each file (it is in the spool); the trainer *claims* the
files of its step (under the run's claim token: the run's heartbeat is the lease of
what it holds); a committed checkpoint *finishes* them (consumed: the ledger's record
of which example the run consumed in which epoch)::

    pending ──offer (kept from an earlier epoch)───────────────▶ spooled
     ▲ ▲ │ └─start_capture──▶ capturing ──captured (its file)──▲    │ claim (the step)
     │ │ └─refuse─▶ failed ◀──fail──┘ │                             ▼
     │ └──release / expire (lease)────┘                          training ──finish──▶ consumed
     └──expire (a spooled file gone from the spool)──────────── (renew: trained again after
                                                                 a resume)  (a checkpoint)

A capture call in flight is a second kind of leased work on the same rows
(:data:`CAPTURE`): the row is ``capturing`` on its ``server``, under the capture thread's
claim and a lease (its call's timeout, the file's and the margin, as a stage capture's),
held by a process that heart-beats in ``workers``, so the one dead-holder rule
(:func:`synthq.queue.ledger.gone`) frees a killed trainer's call, in the sweep as for
the stage's captures. It is claimed through the capture stage's room
(:func:`synthq.queue.capture_states.room`): every capture call to a server counts toward
its one ``capture_limit``, the stage's and the spools' alike.

A killed trainer's rows are taken over by its run's next holder (:func:`take_over`, as
:func:`synthq.queue.run_states.claim` takes the run over): those its checkpoint covers are
finished, the others trained again under the new token (``renew``), so nothing is trained
twice into a committed checkpoint, and nothing skipped. The transitions are
:mod:`synthq.queue.ledger`'s; this module adds only what is the spool's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from synthq.core.enums import SpoolState
from synthq.queue import capture_states, ledger
from synthq.store.models import SpoolItem

__all__ = ["SPOOL", "CAPTURE", "Item", "add_epoch", "items", "offer", "take", "commit",
           "take_over", "forget_file", "lost_file", "refuse", "consumed_per_epoch", "files",
           "start_capture", "captured", "release_capture", "fail_capture", "expire_captures",
           "take_back_captures"]

#: The spool's consumption as a kind of leased work: offered (spooled) before it is
#: claimed (training); no attempt budget and no retry (a capture's own retries are the
#: capture's); the holder is the run, whose heartbeat is the lease of what it holds.
SPOOL = ledger.Kind("spool item", SpoolItem, waiting=SpoolState.PENDING,
                    offered=SpoolState.SPOOLED, held=SpoolState.TRAINING,
                    done=SpoolState.CONSUMED, failed=SpoolState.FAILED, lease="expires_at")

#: A spool row's capture call as a kind of leased work: claimed from pending on a server
#: within its capture limit (:func:`start_capture`), done once its file is in the spool
#: (spooled); the lease in ``expires_at``, set at the claim to outlive the call and its
#: file like a stage capture's (:data:`synthq.queue.capture_states.CAPTURES`), never
#: renewed; its holder a ``workers`` row (the run's capture thread heart-beats); no budget
#: and no retry of the ledger's: the thread retries a call its server did not answer.
CAPTURE = ledger.Kind("spool capture", SpoolItem, waiting=SpoolState.PENDING,
                      held=SpoolState.CAPTURING, done=SpoolState.SPOOLED,
                      failed=SpoolState.FAILED, lease="expires_at",
                      lease_length=capture_states.CAPTURES.lease_seconds)


@dataclass(frozen=True, slots=True)
class Item:
    id: int
    epoch: int
    example: str
    state: str
    path: str | None
    bytes: int | None
    step: int | None
    claim: str | None


_COLUMNS = (SpoolItem.id, SpoolItem.epoch, SpoolItem.example, SpoolItem.state,
            SpoolItem.path, SpoolItem.bytes, SpoolItem.step, SpoolItem.claim)


def add_epoch(session: Session, run_id: int, rank: int, epoch: int, examples: Iterable[str],
              *, now: datetime) -> int:
    """A pending row for each of ``examples`` (this rank's shard of the epoch) that has
    none; how many were added."""
    have = set(session.scalars(select(SpoolItem.example).where(
        SpoolItem.run_id == run_id, SpoolItem.epoch == epoch)))
    rows = [dict(run_id=run_id, epoch=epoch, rank=rank, example=ex, state=SpoolState.PENDING,
                 captures=0, created_at=now, updated_at=now)
            for ex in dict.fromkeys(examples) if ex not in have]
    if rows:
        session.execute(insert(SpoolItem), rows)
    return len(rows)


def items(session: Session, run_id: int, *, rank: int | None = None,
          epoch: int | None = None, states: Sequence[str] | None = None,
          examples: Iterable[str] | None = None) -> list[Item]:
    where = [SpoolItem.run_id == run_id]
    if examples is not None:
        where.append(SpoolItem.example.in_(list(examples)))
    if rank is not None:
        where.append(SpoolItem.rank == rank)
    if epoch is not None:
        where.append(SpoolItem.epoch == epoch)
    if states is not None:
        where.append(SpoolItem.state.in_(list(states)))
    return [Item(*row) for row in session.execute(select(*_COLUMNS).where(*where)
                                                  .order_by(SpoolItem.id))]


def files(session: Session, run_id: int, rank: int | None = None,
          example: str | None = None) -> list[Item]:
    """The rows whose file is in their rank's spool (any state): the run's, a rank's, or
    one example's."""
    where = [SpoolItem.run_id == run_id, SpoolItem.path.is_not(None)]
    if rank is not None:
        where.append(SpoolItem.rank == rank)
    if example is not None:
        where.append(SpoolItem.example == example)
    return [Item(*row) for row in session.execute(select(*_COLUMNS).where(*where))]


def offer(session: Session, item_id: int, *, path: str, nbytes: int, captured: bool,
          now: datetime) -> bool:
    """pending → spooled: its file is in the spool (``captured``: this epoch's capture
    stored it; else a file kept from an earlier epoch)."""
    return ledger.move(session, SPOOL, "offer", item_id, None, now=now, path=path,
                       bytes=nbytes, captures=SpoolItem.captures + int(captured),
                       error_class=None, error_message=None)


def take(session: Session, ids: Sequence[int], *, token: str, worker: str, step: int,
         lease: float, now: datetime) -> int:
    """The files of a step: spooled → training under the run's ``token``, and those this
    holder took over (:func:`take_over`) trained again; how many it holds now (fewer
    than ``ids``: the run is no longer this holder's)."""
    if not ids:
        return 0
    claimed = ledger.claim(
        session, SPOOL, [SpoolItem.id.in_(list(ids)),
                         SpoolItem.state.in_(ledger.allowed(SPOOL, "claim"))],
        token=token, worker=worker, lease=now + timedelta(seconds=lease), now=now,
        values=dict(step=step), returning=(SpoolItem.id,))
    got = {row[0] for row in claimed}
    again = [(i, token) for i in ids if i not in got]
    renewed = ledger.move_many(session, SPOOL, "renew", again, now=now, step=step,
                               worker=worker) if again else 0
    return len(got) + renewed


def commit(session: Session, run_id: int, *, token: str, step: int, now: datetime) -> int:
    """A checkpoint of ``step`` is committed: the run's rows trained at or before it →
    consumed; how many."""
    held = [(i, token) for i in session.scalars(select(SpoolItem.id).where(
        SpoolItem.run_id == run_id, SpoolItem.state == SPOOL.held, SpoolItem.claim == token,
        SpoolItem.step <= step))]
    return ledger.move_many(session, SPOOL, "finish", held, now=now) if held else 0


def take_over(session: Session, run_id: int, *, token: str, lease: float,
              now: datetime) -> int:
    """The run's rows a previous holder of the run held (it died, or handed the run back)
    → this holder's ``token``, as the run itself was taken over; each keeps the worker
    that trained it (a row trained again names its new one); how many."""
    stmt = ledger.claim_statement(
        SPOOL, [SpoolItem.run_id == run_id, SpoolItem.state == SPOOL.held,
                SpoolItem.claim.is_distinct_from(token)],
        token=token, worker=SpoolItem.worker, lease=now + timedelta(seconds=lease), now=now)
    result: Any = session.execute(stmt, execution_options={"synchronize_session": False})
    return int(result.rowcount or 0)


def forget_file(session: Session, ids: Sequence[int], *, now: datetime) -> int:
    """Consumed rows whose file left the spool (evicted: no longer needed)."""
    if not ids:
        return 0
    return ledger.apply(session, SPOOL, "annotate", [SpoolItem.id.in_(list(ids))], now=now,
                        path=None, updated_at=now)


def lost_file(session: Session, ids: Sequence[int], *, now: datetime) -> int:
    """Spooled (or taken-over) rows whose file is not in the spool: pending again,
    captured again."""
    if not ids:
        return 0
    return ledger.apply(session, SPOOL, "expire", [SpoolItem.id.in_(list(ids))], now=now,
                        path=None, bytes=None)


def refuse(session: Session, item_id: int, *, error_class: str, error_message: str,
           now: datetime) -> bool:
    """pending → failed: its capture failed for good (the run stops with the line)."""
    return ledger.move(session, SPOOL, "refuse", item_id, None, now=now,
                       error_class=error_class, error_message=error_message[:2000])


# -- the capture call (CAPTURE) -----------------------------------------------------------


def start_capture(session: Session, item_id: int, *, server: str, limit: int, token: str,
                  worker: str, lease: float, now: datetime) -> bool:
    """pending → capturing on ``server``, when the server has room within ``limit`` (its
    one capture limit, counted with the stage's captures under its lock:
    :func:`synthq.queue.capture_states.room`); False: no room now (or the row is not
    pending). The caller commits at once: the lock is held to the commit."""
    if capture_states.room(session, server, limit=limit, most=1, now=now) <= 0:
        return False
    result = ledger.claim(session, CAPTURE, [SpoolItem.id == item_id,
                                             SpoolItem.state.in_(ledger.allowed(CAPTURE,
                                                                                "claim"))],
                          token=token, worker=worker, lease=now + timedelta(seconds=lease),
                          now=now, values=dict(server=server))
    return int(result.rowcount or 0) == 1


def captured(session: Session, item_id: int, *, token: str, path: str, nbytes: int,
             now: datetime) -> bool:
    """capturing → spooled: its call stored its file in the spool, and the server's slot is
    free. A row whose claim was lost meanwhile (its lease passed: pending again) is offered
    from pending, since its file is in the spool all the same."""
    values: dict[str, Any] = dict(path=path, bytes=nbytes, captures=SpoolItem.captures + 1,
                                  error_class=None, error_message=None, finished_at=None)
    return ledger.move(session, CAPTURE, "finish", item_id, token, now=now, **values) or \
        ledger.move(session, SPOOL, "offer", item_id, None, now=now, **values)


def release_capture(session: Session, item_id: int, *, token: str, now: datetime) -> bool:
    """capturing → pending: its call ended with no file (its server did not answer, or the
    file needs more room than was reserved); the thread asks again."""
    return ledger.move(session, CAPTURE, "release", item_id, token, now=now)


def fail_capture(session: Session, item_id: int, *, token: str, error_class: str,
                 error_message: str, now: datetime) -> bool:
    """capturing → failed: its server answered wrong (the run stops with the line)."""
    return ledger.move(session, CAPTURE, "fail", item_id, token, now=now,
                       error_class=error_class, error_message=error_message[:2000])


def expire_captures(session: Session, *, now: datetime, worker_timeout: float | None = None,
                    server: str | None = None) -> int:
    """Capture calls whose holder is gone (the one rule, :func:`synthq.queue.ledger.gone`:
    the lease passed, or its capture thread's ``workers`` row silent for
    ``worker_timeout`` seconds) → pending: the server's slot is free, and the run's
    capture asks for the example again; all servers', or ``server``'s."""
    gone = ledger.gone(CAPTURE, now=now, worker_timeout=worker_timeout)
    scope = [SpoolItem.server == server] if server is not None else []
    return len(ledger.expire(session, CAPTURE, now=now, gone=gone, scope=scope))


def take_back_captures(session: Session, run_id: int, rank: int, *, now: datetime) -> int:
    """The rank's rows an earlier holder of the run left capturing (killed, or stopped
    mid-call) → pending, when the run's new holder starts its capture: the run is this
    holder's now, so those calls are nobody's."""
    return ledger.apply(session, CAPTURE, "expire",
                        [SpoolItem.run_id == run_id, SpoolItem.rank == rank], now=now)


def consumed_per_epoch(session: Any, run_id: int) -> list[int]:
    """Examples the run consumed (a committed checkpoint trained on them) in each epoch,
    from the first."""
    rows = dict(session.execute(select(SpoolItem.epoch, func.count()).where(
        SpoolItem.run_id == run_id, SpoolItem.state == SPOOL.done)
        .group_by(SpoolItem.epoch)).all())
    return [int(rows.get(e, 0)) for e in range(max(rows) + 1)] if rows else []

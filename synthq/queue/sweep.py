"""The sweep: what a dead holder leaves of every kind of leased work, in one pass.

Each kind (a :class:`synthq.queue.ledger.Kind`) is expired by the ledger's one rule
(:func:`synthq.queue.ledger.gone`: its lease passed, or its holder's heartbeat went
silent) into its declared states:

* samples (:func:`synthq.queue.states.expire`): an expired lease, a dead worker's
  sample, or a queued one nobody claimed before its deadline → ``pending`` (``failed``,
  class ``connection``, on its last attempt; the cut call logged ``lost``);
* captures (:func:`synthq.queue.capture_states.expire`): → ``pending`` (``failed``, class
  ``lost``, on its last attempt);
* a streamed run's capture calls (:func:`synthq.queue.spool_states.expire_captures`): →
  ``pending``, so a killed trainer's call no longer holds its server's capture limit;
* training runs (:func:`sweep_runs`): a run whose holder stopped heart-beating →
  ``pending``, and each such run (and a pending one whose message may have died) is sent
  a ``train`` message again.

The tick's ``sweep`` stage runs :func:`sweep` (with its ``train`` effect, the runs too);
a capture stage's heartbeat runs it for its job (a ``synthq capture`` may run where no
tick does); the readiness check (``synthq.training.readiness``, also run by each
training worker itself) runs :func:`sweep_runs` under its lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from synthq.queue import capture_states, ledger, run_states, spool_states, states, workers
from synthq.spec.config import get_settings
from synthq.store.counts import compact_counts
from synthq.store.db import session_scope, utcnow
from synthq.store.models import TrainingRun

__all__ = ["sweep", "sweep_runs", "database_trouble", "FORGET_WORKERS_AFTER"]

log = logging.getLogger(__name__)

#: When this process's sweeps last succeeded, since when without a gap, and whether
#: this process has met a database error since.
_sweeps = {"last": 0.0, "since": 0.0, "trouble": False}


def database_trouble() -> None:
    """Note a database error seen by this process's scheduling (dispatch, sweep, probes)."""
    _sweeps["trouble"] = True


#: Seconds a worker row may stay after its last heartbeat (``status`` shows it meanwhile).
FORGET_WORKERS_AFTER = 3600.0


def sweep(*, reclaim_all: bool = False, job_ids: Sequence[int] | None = None,
          send_runs: Callable[[list[int]], None] | None = None) -> int:
    """The sweep of every kind of leased work that a dead holder can leave behind: expired
    leases, dead workers' samples and captures, and unclaimed queued samples go back to
    ``pending`` (or ``failed``, on their last attempt); with ``send_runs`` (one ``train``
    message per run id, after the commit), training runs too (:func:`sweep_runs`).
    Returns the count of rows moved (and runs sent).

    ``reclaim_all`` treats every lease as expired: for a process that knows it
    is the only one working on these jobs (the embedded runner, at start).

    A worker counts as dead when it has not heart-beaten for ``worker_timeout``
    seconds, but only while this sweeper could see the database for that long
    too: after a database outage every worker's heartbeat is old, and the
    workers need a moment to write the answers they held (and a heartbeat)
    before anyone judges them.
    """
    settings = get_settings()
    now = utcnow()
    mono = time.monotonic()
    if _sweeps["trouble"] or mono - _sweeps["last"] > max(10.0, 2 * settings.worker_timeout):
        _sweeps["since"] = mono  # back after an outage (or a long pause): wait and see
        _sweeps["trouble"] = False
    if _sweeps["last"] == 0.0:
        _sweeps["since"] = mono - settings.worker_timeout  # a fresh sweeper judges at once
    judge = mono - _sweeps["since"] >= settings.worker_timeout
    timeout = settings.worker_timeout if judge else None
    cutoff = now + timedelta(days=36500) if reclaim_all else now
    runs: list[int] = []
    try:
        with session_scope() as s:
            moved = len(states.expire(s, now=now, cutoff=cutoff, job_ids=job_ids,
                                      worker_timeout=timeout))
            # A dead process's captures go back after its heartbeat's timeout, not at once
            # (even when its pid is known gone): the server may still be running its calls,
            # and the room they free would be filled on top of them (6 in flight, limit 3).
            moved += capture_states.expire(s, now=now, worker_timeout=timeout,
                                           job_ids=job_ids, everything=reclaim_all)
            # A streamed run's calls hold the same servers' limit: freed by the same rule.
            moved += spool_states.expire_captures(s, now=now, worker_timeout=timeout)
            if send_runs is not None:
                runs = sweep_runs(s, now=now)
            workers.prune(s, now=now, older_than=FORGET_WORKERS_AFTER)
            # The counters' delta rows (PostgreSQL), folded so a read sums a few rows.
            compact_counts(s)
    except DBAPIError:
        database_trouble()
        raise
    _sweeps["last"] = mono
    if runs and send_runs is not None:
        send_runs(runs)
    return moved + len(runs)


def sweep_runs(session: Session, *, now: datetime) -> list[int]:
    """Training runs that need a (new) ``train`` message, in the caller's transaction: a
    running run whose holder's heartbeat is older than the run lease goes back to
    pending (its worker died: the next one resumes it from its last checkpoint), and a
    pending run untouched for ``train_resend_after`` seconds (its message may have died
    with the broker) is touched. Each is logged; the caller publishes a message for each
    after its commit (a duplicate is harmless: the claim is a compare-and-set)."""
    settings = get_settings()
    lease = run_states.RUNS.lease_seconds()
    orphans = {int(run_id): (str(worker), (now - beat).total_seconds() if beat else lease)
               for run_id, worker, beat in session.execute(
                   select(TrainingRun.id, TrainingRun.worker, TrainingRun.heartbeat_at)
                   .where(ledger.gone(run_states.RUNS, now=now, lease=lease)))}
    swept = run_states.sweep_stale(session, now=now, lease=lease,
                                   resend_after=settings.train_resend_after)
    for run_id in swept:
        if run_id in orphans:
            log.warning("training run %d: its worker %s stopped heart-beating (%.0f s ago); "
                        "the run is pending again and sent to a training worker, which "
                        "resumes it from its last checkpoint", run_id, *orphans[run_id])
        else:
            log.warning("training run %d: pending for %.0f s with no worker; its message is "
                        "sent again", run_id, settings.train_resend_after)
    return swept

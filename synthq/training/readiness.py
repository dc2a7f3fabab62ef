"""The readiness check: give each job whose data is ready exactly one training run, and
send again the runs whose worker or message died.

Called by the beat tick (``worker.tasks.dispatch_tick``, run by the consumers of the
``control`` queue: the generation workers) and, every :func:`watch_interval` seconds,
by each training worker itself (:class:`Watch`). A deployment that runs only training
workers and beat (docs/operations.md, "Distributed mode") has no consumer of ``control``: an
orphaned run stayed ``running`` under its dead holder for good (issue 41, 88 s until a
generation worker was started, with no line in any log). Concurrent checks are
serialized by an advisory lock; one that finds it taken leaves the work to the holder.

A job takes part when it has a ``train_target`` and its ``train_when`` is not
``never``; it gets a run when its threshold is met (see
:meth:`synthq.training.config.When.met`) and it has no training run yet, whatever
that run's state: a failed run is retried by hand (``synthq train``), not by the
beat, which would loop on a broken job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import exists, select, text
from sqlalchemy.orm import Session

from synthq.core import locks
from synthq.core.errors import UserError
from synthq.queue import run_states
from synthq.queue.states import INFLIGHT, JobState, SampleState
from synthq.queue.sweep import sweep_runs
from synthq.store.counts import state_counts
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, TrainingRun
from synthq.training.config import TrainConfig, parse_when
from synthq.training.runs import new_run

__all__ = ["Readiness", "check_readiness", "Watch", "watch_interval", "LOCK"]

log = logging.getLogger(__name__)

#: The advisory lock of the readiness check (beat's ticks and the training workers').
LOCK = locks.key("synthq:readiness")


@dataclass
class Readiness:
    #: Runs created by this check (one per ready job).
    started: list[int] = field(default_factory=list)
    #: Runs that need a ``train`` message: the new ones, orphaned ones, lost messages.
    to_send: list[int] = field(default_factory=list)


def check_readiness(publish: Callable[[list[int]], None] | None = None) -> Readiness:
    """Start runs for ready jobs and re-send runs whose worker or message died.

    ``publish(run_ids)`` sends one ``train`` message per id (after commit).
    """
    now = utcnow()
    result = Readiness()
    with session_scope() as s:
        if not _lock(s):
            return result  # another process checks right now: the same work
        has_run = exists().where(TrainingRun.job_id == Job.id)
        candidates = list(s.scalars(
            select(Job).where(Job.train_target.is_not(None), Job.train_when != "never",
                              Job.state != JobState.CANCELLED, ~has_run)
            .order_by(Job.id).with_for_update(of=Job, skip_locked=True)))
        for job in candidates:
            try:
                when = parse_when(job.train_when)
                config = TrainConfig.from_dict(job.train_settings or {})
                config.check()
            except UserError as exc:
                log.warning("job %s: cannot start training: %s", job.name, exc)
                continue
            counts = state_counts(s, job.id)  # the counters: a few rows at any size
            total = sum(counts.values())
            inflight = sum(counts.get(st, 0) for st in INFLIGHT)
            if not when.met(done=counts.get(SampleState.DONE, 0), total=total,
                            skipped=counts.get(SampleState.SKIPPED, 0), inflight=inflight):
                continue
            assert job.train_target is not None
            run = new_run(s, job, target=job.train_target, config=config, trigger="auto")
            log.info("job %s reached train_when=%s: training run %d", job.name, when, run.id)
            result.started.append(run.id)
        swept = sweep_runs(s, now=now)  # (each logged)
        result.to_send = sorted(set(result.started) | set(swept))
    if publish is not None and result.to_send:
        publish(result.to_send)
    return result


def _lock(session: Session) -> bool:
    """Take the readiness check's lock for the transaction (PostgreSQL); False when
    another process holds it. SQLite serializes its write transactions already."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": LOCK}))


def watch_interval() -> float:
    """Seconds between a training worker's own readiness checks: a quarter of the run
    lease (its heartbeat's period too, as the runs' kind declares: 30 s by default), at
    least 1 s."""
    return run_states.RUNS.renew_every(run_states.RUNS.lease_seconds())


class Watch:
    """The readiness check on a thread of a training worker's own, every
    :func:`watch_interval` seconds, so that no other process need run for an orphaned
    run to be sent again (a solo worker training a run for hours still checks: the run
    it holds heart-beats, and another worker's orphan waits in the queue for a free one).
    """

    def __init__(self, publish: Callable[[list[int]], None],
                 interval: float | None = None) -> None:
        self.publish = publish
        self.interval = interval if interval is not None else watch_interval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Checks that failed in a row (the first is logged).
        self.failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="synthq-readiness",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self) -> Readiness | None:
        """One readiness check; None when it failed (logged once per failing streak)."""
        try:
            result = check_readiness(self.publish)
        except Exception as exc:  # noqa: BLE001 - the next check, an interval later
            self.failures += 1
            if self.failures == 1:
                log.warning("training worker: the readiness check failed (%s); trying "
                            "again every %.0f s", str(exc).splitlines()[0][:200]
                            if str(exc) else type(exc).__name__, self.interval)
            return None
        if self.failures:
            log.warning("training worker: the readiness check works again")
        self.failures = 0
        return result

    def _run(self) -> None:
        self.check()
        while not self._stop.wait(self.interval):
            self.check()

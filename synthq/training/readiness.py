"""The readiness check: give each job whose data is ready exactly one training run.

Called by the beat tick (``worker.tasks.dispatch_tick``). A job takes part when
it has a ``train_target`` and its ``train_when`` is not ``never``; it gets a run
when its threshold is met (see :meth:`synthq.training.config.When.met`) and it
has no training run yet, whatever that run's state: a failed run is retried
by hand (``synthq train``), not by the beat, which would loop on a broken job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import exists, select

from synthq.config import get_settings
from synthq.counts import state_counts
from synthq.db import session_scope, utcnow
from synthq.errors import UserError
from synthq.models import Job, TrainingRun
from synthq.states import INFLIGHT, JobState, SampleState
from synthq.training import states
from synthq.training.config import TrainConfig, parse_when
from synthq.training.runs import new_run

__all__ = ["Readiness", "check_readiness"]

log = logging.getLogger(__name__)


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
    settings = get_settings()
    now = utcnow()
    result = Readiness()
    with session_scope() as s:
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
        result.to_send = sorted(set(result.started) | set(states.sweep_stale(
            s, now=now, lease=settings.train_lease, resend_after=settings.train_resend_after)))
    if publish is not None and result.to_send:
        publish(result.to_send)
    return result

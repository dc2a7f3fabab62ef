"""Which jobs' capture stages have work now (the scheduler tick's capture step)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from synthq.core.enums import CaptureState, JobState
from synthq.queue import capture_states as states
from synthq.store.models import Capture, Job

__all__ = ["due_jobs"]


def due_jobs(session: Session, *, now: datetime) -> list[int]:
    """Jobs with capture servers that have captures due now and room on those servers.

    Newly done samples get their pending capture here, so a capture stage follows
    generation by one tick.
    """
    from synthq.spec.config import get_settings

    due: list[int] = []
    # A killed capture process's captures hold its servers' room until someone frees
    # them; no stage runs to do it while they do (the room looks full). The tick's sweep
    # stage (synthq.queue.sweep) has freed them before this step; a caller outside the
    # tick gets the same expiry here, so that the room it judges is the true one.
    timeout = get_settings().worker_timeout  # as the sweep: a dead holder's calls may still
    # run on its server for a while, so its captures wait out the heartbeat's timeout.
    for job_id, servers, limit in session.execute(
            select(Job.id, Job.capture_servers, Job.capture_limit)
            .where(Job.state.in_([JobState.ACTIVE, JobState.FINISHED]),
                   Job.capture_stopped.is_(None))):
        if not servers:
            continue
        states.expire(session, now=now, worker_timeout=timeout, job_ids=[job_id])
        states.add_missing(session, job_id, now=now)
        pending = session.scalar(select(func.count()).select_from(Capture).where(
            Capture.job_id == job_id, Capture.state == CaptureState.PENDING,
            or_(Capture.next_attempt_at.is_(None), Capture.next_attempt_at <= now))) or 0
        if pending and sum(states.running_on(session, url) for url in servers) \
                < limit * len(servers):
            due.append(job_id)
    return due

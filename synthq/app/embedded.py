"""Embedded mode: one process runs a job to the end, no broker needed.

It uses the same dispatcher and the same executor (one event loop for every
call, batched claims, the batch writer) as the Celery workers; only the
publisher differs (carrier threads instead of a Redis queue). A file
lock makes it the only process working on this data directory, so at start it
can reclaim whatever a killed run left queued or running: ``kill -9`` and
rerun, and it resumes; done samples are never generated again.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from synthq.app.tick import Effects, run_tick
from synthq.core.enums import INFLIGHT, JobState
from synthq.core.errors import DiskFull, UserError
from synthq.queue import jobs
from synthq.queue.dispatch import Dispatched
from synthq.queue.sweep import sweep
from synthq.serving.adaptive import START_TICK_SECONDS, in_slow_start
from synthq.serving.executor import Executor
from synthq.spec.config import get_settings
from synthq.store.db import database_location, disk_full, service_process, session_scope, utcnow
from synthq.store.models import Job
from synthq.views.report import JobStatus, job_status

__all__ = ["run_job", "exclusive"]


@contextmanager
def exclusive(data_dir: Path) -> Iterator[None]:
    """Hold ``data_dir/embedded.lock`` or fail with a clear message."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "embedded.lock"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise UserError(f"another `synthq run` is using {data_dir} (lock {path})") from exc
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


def run_job(job_id: int, *, on_tick: Callable[[JobStatus], None] | None = None,
            stop: threading.Event | None = None) -> JobStatus:
    """Process job ``job_id`` until no sample is pending, queued or running."""
    settings = get_settings()
    stop = stop or threading.Event()
    service_process()  # PostgreSQL: the hot path's limits and the answer deadline
    with session_scope() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise UserError(f"no job {job_id}")
        capacity = job.inflight_limit * len(job.servers)
    wake = threading.Event()
    size = max(1, settings.batch_size)
    # With the embedded SQLite file we hold the data directory's lock, so
    # anything in flight belongs to a run that died: reclaim it now. (On a
    # shared database, workers elsewhere may hold leases: wait them out.)
    if settings.is_sqlite:
        with _disk_full_stops():
            sweep(reclaim_all=True, job_ids=[job_id])
    with _disk_full_stops():
        engine = Executor(capacity, on_finished=wake.set)
    # The "broker" is in-process: carrier threads hand each batch to the
    # executor's event loop and wait for it, as Celery's threads do.
    pool = ThreadPoolExecutor(max_workers=capacity, thread_name_prefix="synthq-batch")
    try:

        def publish(batch: Sequence[Dispatched]) -> None:
            for start in range(0, len(batch), size):
                chunk = batch[start:start + size]
                engine.submit_batch([(d.sample_id, d.token, d.job_id) for d in chunk], pool)

        status: JobStatus | None = None
        last_tick = float("-inf")
        while True:
            if engine.writer.disk_full is not None:  # answers cannot be written: stop
                raise DiskFull(database_location())
            # A finished sample wakes the loop: refill its slot at once (the tick's
            # every-wake stages: the adaptive limit, then the dispatch). The probes, the
            # sweep and the status (a dozen queries) run once per interval, or when this
            # process holds no call (the job may be ending). The samples for the free
            # slots are claimed in the dispatch's own transaction and started on the loop
            # at once (as a worker's refill does): no carrier thread and no second
            # transaction per batch.
            full = time.monotonic() - last_tick >= settings.dispatch_interval
            if full:
                last_tick = time.monotonic()
            queued = run_tick(Effects(publish=None if stop.is_set() else publish,
                                      local=engine.local_claim),
                              job_ids=[job_id], full=full).queued
            # The status (and on_tick) between two ticks only when the job may be ending:
            # while this process holds calls, none of its samples is finished, and a wake
            # that refilled nothing (its slot was taken by the previous refill) needs no
            # report. A pause or cancel from elsewhere is seen at the next tick.
            if status is not None and not full and (queued or engine.inflight) \
                    and not stop.is_set():
                wake.wait(timeout=_pause(settings.dispatch_interval))
                wake.clear()
                continue
            with session_scope() as s:
                status = job_status(s, s.get_one(Job, job_id), cost=False)
            if status.finished:
                # Every sample is terminal: the job holds no server's limit any more.
                with session_scope() as s:
                    if jobs.finish_jobs(s, now=utcnow(), job_ids=[job_id]):
                        status = replace(status, state=str(JobState.FINISHED))
            if on_tick:
                on_tick(status)
            if status.finished or (stop.is_set() and not _inflight(status)) or \
                    (status.state != JobState.ACTIVE and not _inflight(status)):
                if status.finished and not stop.is_set():
                    _capture_stage(job_id, stop)
                with session_scope() as s:  # the full report, cost included
                    final = job_status(s, s.get_one(Job, job_id))
                # This process is leaving: its worker row's load is its last heartbeat's.
                return replace(final, state=status.state, workers=[
                    w for w in final.workers if w["name"] != engine.name])
            wake.wait(timeout=_pause(settings.dispatch_interval))
            wake.clear()
    except (DiskFull, DBAPIError) as exc:
        if not isinstance(exc, DiskFull) and not disk_full(exc):
            raise
        # A full disk is not transient: stop within seconds (the calls in flight are
        # cut and redone by the next run; done samples stay done), and say where.
        engine.writer.abandon()
        engine.begin_shutdown(0.0)
        if isinstance(exc, DiskFull):
            raise
        raise DiskFull(database_location()) from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=False)
        engine.close()


def _capture_stage(job_id: int, stop: threading.Event) -> None:
    """Generation ended: a job with capture servers (``synthq capture --server``) runs its
    hidden-state capture stage in this process too, as beat sends it to capture workers."""
    with session_scope() as s:
        servers = s.get_one(Job, job_id).capture_servers
    if not servers:
        return
    from synthq.capture.stage import Stage

    Stage(job_id, stop=stop, reclaim_all=get_settings().is_sqlite).run()


def _pause(interval: float) -> float:
    """How long the loop sleeps when nothing wakes it: shorter while a server's adaptive
    limit is in slow start, so that a step is judged as soon as its calls have ended
    (they end together, and wake the loop before their results are all written)."""
    return min(interval, START_TICK_SECONDS) if in_slow_start() else interval


@contextmanager
def _disk_full_stops() -> Iterator[None]:
    """A full disk met by a statement of the runner's own becomes :class:`DiskFull`."""
    try:
        yield
    except DBAPIError as exc:
        if not disk_full(exc):
            raise
        raise DiskFull(database_location()) from exc


def _inflight(status: JobStatus) -> int:
    return sum(status.counts.get(s, 0) for s in INFLIGHT)

"""Process one queued sample: claim it, call its server, record the outcome.

This is the body of the Celery ``generate`` task and of the embedded runner's
threads: one implementation for both. Every write is a compare-and-set on the
claim token, so a duplicate delivery or a worker that lost its lease writes
nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from sqlalchemy import insert, select, update

from synthq import errors, states
from synthq.config import get_settings
from synthq.db import session_scope, utcnow
from synthq.inference import ChatRequest, ChatResult, get_client
from synthq.models import Attempt, Job, Sample
from synthq.packing import pack_ids
from synthq.retry import backoff_delay

__all__ = ["Outcome", "process_sample", "worker_name"]

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    #: Another delivery, a sweep, or a pause got there first; nothing was done.
    STALE = "stale"
    DONE = "done"
    RETRY = "retry"
    FAILED = "failed"
    #: The lease was lost mid-call (the sweep gave the sample to someone else).
    LOST = "lost"


class LeaseLost(Exception):
    """Raised inside the streaming loop when renewing the lease fails."""


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(slots=True)
class _Claimed:
    job: Job
    prompt: list[dict[str, str]]
    attempts: int
    server: str
    token: str
    attempt_id: int


def _lease_seconds(job: Job) -> float:
    # The worker gives up on a silent server after stall_timeout; the lease
    # outlives that by a margin, so a live worker never loses it.
    return min(job.stall_timeout, job.total_timeout) + get_settings().lease_margin


def _claim(sample_id: int, token: str, worker: str) -> _Claimed | None:
    now = utcnow()
    new_token = secrets.token_hex(16)
    with session_scope() as s:
        # The lease length depends on the job; read it with the sample.
        row = s.execute(
            select(Job).join(Sample, Sample.job_id == Job.id).where(Sample.id == sample_id)
        ).scalar_one_or_none()
        if row is None:
            return None
        job = row
        lease_until = now + timedelta(seconds=_lease_seconds(job))
        won = states.claim(s, sample_id, token, new_token=new_token, lease_until=lease_until,
                           worker=worker, now=now)
        if won is None:
            # Not ours: a duplicate or stale message, or the job is not active.
            states.release(s, sample_id, token, now=now)
            return None
        _, attempts = won
        prompt, server = s.execute(
            select(Sample.prompt, Sample.server).where(Sample.id == sample_id)
        ).one()
        assert server is not None, "a queued sample always has its server"
        attempt_id = s.execute(
            insert(Attempt).values(sample_id=sample_id, server=server, worker=worker,
                                   started_at=now).returning(Attempt.id)
        ).scalar_one()
        s.expunge(job)
    return _Claimed(job, prompt or [], attempts, server, new_token, attempt_id)


def _close_attempt(s, c: _Claimed, *, outcome: str, message: str | None,  # type: ignore[no-untyped-def]
                   result: ChatResult | None, latency: float, now) -> None:  # type: ignore[no-untyped-def]
    s.execute(
        update(Attempt).where(Attempt.id == c.attempt_id).values(
            ended_at=now, outcome=outcome, error_message=message, latency_s=latency,
            ttft_s=result.ttft_s if result else None,
            completion_tokens=result.completion_tokens if result else None,
        )
    )


def _check_result(job: Job, result: ChatResult) -> None:
    """A response that must not become a done sample raises here."""
    if result.finish_reason == "length" and not job.keep_truncated:
        raise errors.Truncated(
            f"the answer hit max_tokens={job.max_tokens} (finish_reason=length) and the job "
            "does not keep truncated answers")
    if not result.content.strip():
        raise errors.EmptyResponse(
            f"the server returned no content (finish_reason={result.finish_reason!r})")


def process_sample(sample_id: int, token: str, *, worker: str | None = None) -> Outcome:
    """Claim ``sample_id`` with the dispatch ``token`` and run it to an outcome."""
    worker = worker or worker_name()
    c = _claim(sample_id, token, worker)
    if c is None:
        return Outcome.STALE
    job = c.job
    lease = _lease_seconds(job)
    renew_every = max(1.0, lease / 4)
    last_renew = time.monotonic()

    def renew_lease() -> None:
        nonlocal last_renew
        if time.monotonic() - last_renew < renew_every:
            return
        last_renew = time.monotonic()
        with session_scope() as s:
            if not states.renew(s, sample_id, c.token,
                                lease_until=utcnow() + timedelta(seconds=lease)):
                raise LeaseLost(f"sample {sample_id}: lease lost")

    client = get_client(c.server, max_connections=job.inflight_limit)
    request = ChatRequest(model=job.model, messages=c.prompt, max_tokens=job.max_tokens,
                          sampling=dict(job.sampling), extra_body=dict(job.extra_body))
    started = time.monotonic()
    result: ChatResult | None = None
    try:
        result = client.chat(request, total_timeout=job.total_timeout,
                             stall_timeout=job.stall_timeout, on_chunk=renew_lease)
        _check_result(job, result)
    except LeaseLost:
        log.warning("sample %s: lease lost mid-call; dropping the response", sample_id)
        with session_scope() as s:
            _close_attempt(s, c, outcome="lost", message="lease lost mid-call", result=None,
                           latency=time.monotonic() - started, now=utcnow())
        return Outcome.LOST
    except errors.SampleError as exc:
        return _record_failure(sample_id, c, exc, result, time.monotonic() - started)
    return _record_success(sample_id, c, result)


def _record_success(sample_id: int, c: _Claimed, result: ChatResult) -> Outcome:
    now = utcnow()
    with session_scope() as s:
        won = states.complete(
            s, sample_id, c.token, now=now,
            response_content=result.content,
            reasoning_content=result.reasoning_content,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            prompt_token_ids=pack_ids(result.prompt_token_ids),
            completion_token_ids=pack_ids(result.completion_token_ids),
        )
        _close_attempt(s, c, outcome="ok" if won else "lost",
                       message=None if won else "lease lost before the result was written",
                       result=result, latency=result.latency_s, now=now)
    return Outcome.DONE if won else Outcome.LOST


def _record_failure(sample_id: int, c: _Claimed, exc: errors.SampleError,
                    result: ChatResult | None, latency: float) -> Outcome:
    now = utcnow()
    job = c.job
    message = str(exc)
    retry = exc.retryable and c.attempts < job.max_attempts
    with session_scope() as s:
        if retry:
            delay = backoff_delay(c.attempts, base=job.backoff_base, cap=job.backoff_cap,
                                  retry_after=getattr(exc, "retry_after", None))
            won = states.retry(s, sample_id, c.token, now=now,
                               next_attempt_at=now + timedelta(seconds=delay),
                               error_class=exc.error_class, error_message=message)
        else:
            if exc.retryable:
                message = f"{message} (gave up after {c.attempts} attempts)"
            won = states.fail(s, sample_id, c.token, now=now, error_class=exc.error_class,
                              error_message=message)
        _close_attempt(s, c, outcome=exc.error_class, message=str(exc), result=result,
                       latency=latency, now=now)
    if not won:
        return Outcome.LOST
    return Outcome.RETRY if retry else Outcome.FAILED

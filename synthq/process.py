"""Process one queued sample: claim it, call its server, tokenize, record the outcome.

This is the body of the Celery ``generate`` task and of the embedded runner's
threads: one implementation for both. Every write is a compare-and-set on the
claim token, so a duplicate delivery or a worker that lost its lease writes
nothing, and every write is retried through transient database errors, so an
answer in hand is not dropped because PostgreSQL hiccuped.

With a tokenizer on the job, the raw response is stored first (its own
transaction), then tokenized; the example is written in the transaction that
marks the sample done. A sample claimed with its response already stored (a
worker died after storing it, or a tokenization failure was requeued) is
tokenized again without calling the server: a generation is paid for once.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from synthq import errors, states
from synthq.config import get_settings
from synthq.db import session_scope, utcnow, with_db_retry
from synthq.inference import ChatRequest, ChatResult, get_client
from synthq.models import Attempt, Job
from synthq.packing import pack_ids, pack_mask, unpack_ids
from synthq.tokenize import TokenizeSettings, get_chat_tokenizer

__all__ = ["Outcome", "process_sample", "worker_name", "tokenize_response"]

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    #: Another delivery, a sweep, or a pause got there first; nothing was done.
    STALE = "stale"
    DONE = "done"
    RETRY = "retry"
    FAILED = "failed"
    #: Tokenization left no supervised token: skipped, not failed.
    SKIPPED = "skipped"
    #: The lease was lost mid-call (the sweep gave the sample to someone else).
    LOST = "lost"


class LeaseLost(Exception):
    """Raised inside the streaming loop when renewing the lease fails."""


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- jobs, cached per process --------------------------------------------------------

#: Seconds a process trusts its copy of a job's settings.
JOB_CACHE_SECONDS = 5.0
_jobs: dict[int, tuple[float, Job]] = {}
_jobs_lock = threading.Lock()


def _job(job_id: int) -> Job:
    """The job's settings; re-read at most every JOB_CACHE_SECONDS."""
    now = time.monotonic()
    with _jobs_lock:
        hit = _jobs.get(job_id)
    if hit and now - hit[0] < JOB_CACHE_SECONDS:
        return hit[1]

    def load() -> Job:
        with session_scope() as s:
            job = s.get_one(Job, job_id)
            s.expunge(job)
            return job

    job = with_db_retry(load, what=f"job {job_id}")
    with _jobs_lock:
        _jobs[job_id] = (now, job)
    return job


# -- claim ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Claimed:
    sample_id: int
    job: Job
    prompt: list[dict[str, str]]
    attempts: int
    server: str
    token: str
    #: Set when a previous attempt already stored the response.
    stored: ChatResult | None
    #: The attempts row of the call about to be made (None when no call is needed).
    attempt_id: int | None


def _lease_seconds(job: Job) -> float:
    # The worker gives up on a silent server after stall_timeout; the lease
    # outlives that by a margin, so a live worker never loses it.
    return min(job.stall_timeout, job.total_timeout) + get_settings().lease_margin


def _claim(sample_id: int, token: str, worker: str, job_id: int | None) -> _Claimed | None:
    new_token = secrets.token_hex(16)
    # The message names the job, so the lease is the job's from the start.
    # (Without it, a generous lease now, the job's own right after.)
    known = _job(job_id) if job_id is not None else None
    lease = timedelta(seconds=_lease_seconds(known) if known else
                      get_settings().lease_margin + 3600)

    def attempt() -> Any:
        now = utcnow()
        with session_scope() as s:
            row = states.claim(s, sample_id, token, new_token=new_token, lease_until=now + lease,
                               worker=worker, now=now)
            if row is None:
                # Not ours: a duplicate or stale message, or the job is not active.
                states.release(s, sample_id, token, now=now)
                return None
            attempt_id = None
            if row.response_content is None:  # a call will be made: log it
                attempt_id = s.execute(insert(Attempt).values(
                    sample_id=sample_id, server=row.server, worker=worker, started_at=now,
                ).returning(Attempt.id)).scalar_one()
            return row, attempt_id

    won = with_db_retry(attempt, what=f"claim sample {sample_id}")
    if won is None:
        return None
    row, attempt_id = won
    job_id, attempts, prompt, server, content, reasoning, finish, completion_ids = row
    assert server is not None, "a queued sample always has its server"
    job = known if known is not None and known.id == job_id else _job(job_id)
    if known is None:
        with session_scope() as s:  # now the job's own lease
            states.renew(s, sample_id, new_token,
                         lease_until=utcnow() + timedelta(seconds=_lease_seconds(job)))
    stored = None
    if content is not None:
        ids = unpack_ids(completion_ids)
        stored = ChatResult(content=content, reasoning_content=reasoning, finish_reason=finish,
                            prompt_tokens=None, completion_tokens=None, prompt_token_ids=None,
                            completion_token_ids=ids.tolist() if ids is not None else None,
                            latency_s=0.0, ttft_s=None)
    return _Claimed(sample_id, job, prompt or [], attempts, server, new_token, stored,
                    attempt_id)


def _close_attempt(s: Session, attempt_id: int, *, outcome: str, message: str | None,
                   result: ChatResult | None, latency: float, now: datetime) -> None:
    s.execute(
        update(Attempt).where(Attempt.id == attempt_id).values(
            ended_at=now, outcome=outcome, error_message=message, latency_s=latency,
            ttft_s=result.ttft_s if result else None,
            completion_tokens=result.completion_tokens if result else None,
        )
    )


# -- the step ------------------------------------------------------------------------


def _check_result(job: Job, result: ChatResult) -> None:
    """A response that must not become a done sample raises here."""
    if result.finish_reason == "length" and not job.keep_truncated:
        raise errors.Truncated(
            f"the answer hit max_tokens={job.max_tokens} (finish_reason=length) and the job "
            "does not keep truncated answers")
    if not result.content.strip():
        raise errors.EmptyResponse(
            f"the server returned no content (finish_reason={result.finish_reason!r})")


def _response_columns(result: ChatResult) -> dict[str, Any]:
    return dict(response_content=result.content, reasoning_content=result.reasoning_content,
                finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                prompt_token_ids=pack_ids(result.prompt_token_ids),
                completion_token_ids=pack_ids(result.completion_token_ids))


def tokenize_response(job: Job, prompt: list[dict[str, str]], content: str,
                      reasoning: str | None, server_ids: list[int] | None) -> dict[str, Any]:
    """The example's columns for one response; raises a tokenization error class."""
    settings = TokenizeSettings.from_job(job)
    assert settings is not None
    tok = get_chat_tokenizer(settings)
    result = tok.tokenize(tok.conversation(prompt, content, reasoning))
    mismatch = None
    if server_ids is not None:
        mismatch = list(server_ids) != result.completion_ids
    return dict(input_ids=pack_ids(result.input_ids), loss_mask=pack_mask(result.loss_mask),
                num_tokens=len(result.input_ids), num_supervised=result.num_supervised,
                tokenize_version=job.tokenize_version, token_mismatch=mismatch)


def process_sample(sample_id: int, token: str, *, job_id: int | None = None,
                   worker: str | None = None) -> Outcome:
    """Claim ``sample_id`` with the dispatch ``token`` and run it to an outcome."""
    worker = worker or worker_name()
    c = _claim(sample_id, token, worker, job_id)
    if c is None:
        return Outcome.STALE
    if c.stored is not None:
        return _finish(c, c.stored, attempt_id=None)
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

    attempt_id = c.attempt_id
    assert attempt_id is not None
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
        latency = time.monotonic() - started

        def close(s: Session, now: datetime) -> bool:
            _close_attempt(s, attempt_id, outcome="lost", message="lease lost mid-call",
                           result=None, latency=latency, now=now)
            return True

        _write(sample_id, close)
        return Outcome.LOST
    except errors.SampleError as exc:
        return _record_failure(c, exc, result, time.monotonic() - started, attempt_id)
    return _finish(c, result, attempt_id=attempt_id)


def _write(sample_id: int, fn: Any) -> bool:
    """One transaction ``fn(session, now) -> won``, retried through transient DB errors."""

    def attempt() -> bool:
        now = utcnow()
        with session_scope() as s:
            return bool(fn(s, now))

    return with_db_retry(attempt, what=f"sample {sample_id}")


def _finish(c: _Claimed, result: ChatResult, *, attempt_id: int | None) -> Outcome:
    """Store the response, tokenize it if the job says so, and mark the sample."""
    job = c.job
    if not job.tokenizer:
        # No example to build: the stored response is the result.
        def done(s: Session, now: datetime) -> bool:
            won = states.complete(s, c.sample_id, c.token, now=now, **_response_columns(result))
            if attempt_id is not None:
                _close_attempt(s, attempt_id, outcome="ok" if won else "lost", result=result,
                               message=None if won else "lease lost before the result was written",
                               latency=result.latency_s, now=now)
            return won

        return Outcome.DONE if _write(c.sample_id, done) else Outcome.LOST

    if attempt_id is not None:
        # The answer is paid for: store it before anything else can go wrong.
        def store(s: Session, now: datetime) -> bool:
            assert attempt_id is not None
            won = states.store_response(s, c.sample_id, c.token, now=now,
                                        **_response_columns(result))
            _close_attempt(s, attempt_id, outcome="ok" if won else "lost", result=result,
                           message=None if won else "lease lost before the result was written",
                           latency=result.latency_s, now=now)
            return won

        if not _write(c.sample_id, store):
            return Outcome.LOST
    try:
        example = tokenize_response(job, c.prompt, result.content, result.reasoning_content,
                                    result.completion_token_ids)
    except errors.PermanentError as exc:
        return _tokenization_failed(c, exc)
    except Exception as exc:  # a bug or a tokenizer surprise: fail it, never loop on it
        log.exception("sample %s: tokenization crashed", c.sample_id)
        return _tokenization_failed(c, errors.InvalidInput(
            f"tokenization crashed: {type(exc).__name__}: {exc}"[:2000]))
    won = _write(c.sample_id, lambda s, now: states.complete(
        s, c.sample_id, c.token, now=now, **example))
    return Outcome.DONE if won else Outcome.LOST


def _tokenization_failed(c: _Claimed, exc: errors.PermanentError) -> Outcome:
    """No example: skipped when truncation left nothing to learn, else failed.

    The response stays stored either way; ``synthq retokenize`` can retry.
    """
    skip = isinstance(exc, errors.NoSupervisedTokens)
    transition = states.skip if skip else states.fail

    def record(s: Session, now: datetime) -> bool:
        return transition(s, c.sample_id, c.token, error_class=exc.error_class,
                          error_message=str(exc), now=now)

    if not _write(c.sample_id, record):
        return Outcome.LOST
    return Outcome.SKIPPED if skip else Outcome.FAILED


def _record_failure(c: _Claimed, exc: errors.SampleError, result: ChatResult | None,
                    latency: float, attempt_id: int) -> Outcome:
    job = c.job
    message = str(exc)
    retry = exc.retryable and c.attempts < job.max_attempts
    delay = 0.0
    if retry:
        from synthq.retry import backoff_delay

        delay = backoff_delay(c.attempts, base=job.backoff_base, cap=job.backoff_cap,
                              retry_after=getattr(exc, "retry_after", None))
    elif exc.retryable:
        message = f"{message} (gave up after {c.attempts} attempts)"

    def record(s: Session, now: datetime) -> bool:
        if retry:
            won = states.retry(s, c.sample_id, c.token, now=now,
                               next_attempt_at=now + timedelta(seconds=delay),
                               error_class=exc.error_class, error_message=message)
        else:
            won = states.fail(s, c.sample_id, c.token, now=now, error_class=exc.error_class,
                              error_message=message)
        _close_attempt(s, attempt_id, outcome=exc.error_class, message=str(exc), result=result,
                       latency=latency, now=now)
        return won

    if not _write(c.sample_id, record):
        return Outcome.LOST
    return Outcome.RETRY if retry else Outcome.FAILED

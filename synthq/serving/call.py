"""One claimed sample, start to outcome: call its server, tokenize, record what happened.

This coroutine runs on a worker process's event loop (:mod:`synthq.serving.executor`),
for Celery workers and ``synthq run`` alike. Every write goes through the
process's batch writer (:mod:`synthq.serving.writer`) as a compare-and-set on the
claim token (:mod:`synthq.queue.states`), so a duplicate delivery or a worker that
lost its lease writes nothing, and the call's ``attempts`` row is written by
the same transition, in the same transaction.

With a tokenizer on the job, the raw response is stored first, then
tokenized (in a thread: the tokenizer is CPU work), and the example is
written by the transition that marks the sample done. A sample claimed with
its response already stored (a worker died after storing it, or a
tokenization failure was requeued) is tokenized without calling the server:
a generation is paid for once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor as ThreadPool
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from synthq.core import errors
from synthq.core.enums import SampleState
from synthq.core.packing import pack_ids, unpack_ids
from synthq.data import turns
from synthq.data.examples import tokenization_failure, tokenize_sample
from synthq.queue import jobs, ledger, states
from synthq.queue.jobview import effective
from synthq.queue.states import Claimed
from synthq.queue.streaks import Streaks
from synthq.serving.inference import ChatRequest, ChatResult, InferenceClient
from synthq.serving.writer import Writer
from synthq.spec.config import get_settings
from synthq.store.db import disk_full, utcnow
from synthq.store.models import Attempt, Job

__all__ = ["Outcome", "Call", "run_claimed", "wrong_base_url", "inline_name"]

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    #: Another delivery, a sweep, or a pause got there first; nothing was done.
    STALE = "stale"
    DONE = "done"
    RETRY = "retry"
    FAILED = "failed"
    #: Tokenization left no supervised token: skipped, not failed.
    SKIPPED = "skipped"
    #: The call ended but nothing of it was written: the compare-and-set lost (the
    #: lease had passed to another worker) or the database refused the write. The
    #: sample's lease, or whoever holds it now, carries it on.
    NOT_WRITTEN = "not_written"
    #: A turn of a conversation regenerated turn by turn is stored; the sample is
    #: pending again for its next turn.
    TURN = "turn"


# -- pieces ---------------------------------------------------------------------------


def _check_result(job: Job, result: ChatResult) -> None:
    """A response that must not become a done sample raises here."""
    if result.finish_reason == "length" and not job.keep_truncated:
        raise errors.Truncated(
            f"the answer hit max_tokens={job.max_tokens} (finish_reason=length) and the job "
            "does not keep truncated answers")
    if not result.content.strip() and not result.tool_calls:
        raise errors.EmptyResponse(
            f"the server returned no content (finish_reason={result.finish_reason!r})")


def _response_columns(result: ChatResult) -> dict[str, Any]:
    return dict(response_content=result.content, reasoning_content=result.reasoning_content,
                finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                prompt_token_ids=pack_ids(result.prompt_token_ids),
                completion_token_ids=pack_ids(result.completion_token_ids),
                repairs=result.repairs, tool_calls=result.tool_calls)


def _answer(result: ChatResult) -> dict[str, Any]:
    """One turn's stored answer (``samples.turns`` item)."""
    return dict(content=result.content, reasoning_content=result.reasoning_content,
                tool_calls=result.tool_calls, finish_reason=result.finish_reason,
                prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens)


def _multi(job: Any, c: Claimed) -> bool:
    """Whether the sample is regenerated turn by turn."""
    return job.regenerate == "all" and bool(c.turn_count)


def inline_name(job: Any, c: Claimed) -> str | None:
    """``--capture inline``: the name under which the engine writes the hidden states of
    this call's prompt and output (synthq.core.kvparams), for the call of a sample's final
    answer (its only one, or the last turn of one regenerated turn by turn: earlier turns
    are captured by the capture stage); None for any other call. The claim's token makes
    it this attempt's own: a retry asks for another file."""
    if getattr(job, "capture_mode", "stage") != "inline" or not job.tokenizer:
        return None
    if _multi(job, c) and c.turn + 1 < (c.turn_count or 1):
        return None
    return f"synthq-{c.job_id}-{c.sample_id}-{c.token}-inline"


def _stored(c: Claimed) -> ChatResult | None:
    if c.response_content is None:
        return None
    ids = unpack_ids(c.completion_token_ids)
    return ChatResult(content=c.response_content, reasoning_content=c.reasoning_content,
                      finish_reason=c.finish_reason, prompt_tokens=None, completion_tokens=None,
                      prompt_token_ids=None,
                      completion_token_ids=ids.tolist() if ids is not None else None,
                      latency_s=0.0, ttft_s=None, tool_calls=c.tool_calls)


class Call:
    """What the executor knows about one sample in flight (for renewal and cancelling)."""

    __slots__ = ("claimed", "lease_s", "renewed_at", "started_at", "started_mono",
                 "claimed_mono", "calling", "lost", "interrupted", "task")

    def __init__(self, claimed: Claimed, lease_s: float, claimed_mono: float | None = None) -> None:
        self.claimed = claimed
        self.lease_s = lease_s
        self.renewed_at = time.monotonic()
        self.started_at = utcnow()
        self.started_mono = time.monotonic()
        #: ``time.monotonic()`` before the claim statement (streaks.Streaks.holds).
        self.claimed_mono = self.started_mono if claimed_mono is None else claimed_mono
        #: True while the HTTP call runs: the only time a lost lease cancels the task.
        self.calling = False
        #: Set by the renewal that found the lease gone.
        self.lost = False
        #: Set when the worker stops and cuts the call (its grace period ran out).
        self.interrupted = False
        #: The task running this sample (cancelled when the lease is lost mid-call).
        self.task: asyncio.Task[Any] | None = None


# -- the coroutine ------------------------------------------------------------------------


async def run_claimed(call: Call, job: Job, *, client: Callable[[str, int], InferenceClient],
                      writer: Writer, worker: str, tokenize_pool: ThreadPool,
                      streaks: Streaks | None = None) -> Outcome:
    """Run one claimed sample to its outcome; every write committed before it returns.

    ``streaks``: the process's identical failures in a row per server (synthq.queue.streaks):
    the ``stop_after``-th ``bad_request`` in a row on one server pauses the job, and a
    sample claimed before that pause committed is given back unsent."""
    c = call.claimed
    job = effective(job, c.overrides)
    multi = _multi(job, c)
    stored = _stored(c)
    if stored is not None:
        return await _finish(c, job, stored, None, writer, tokenize_pool,
                             answers=c.turns if multi else None)
    stop = streaks.holds(c.server, call.claimed_mono) if streaks is not None else None
    if stop is not None:
        return await _unsent(c, stop, writer)

    def attempt(outcome: str, message: str | None, result: ChatResult | None) -> dict[str, Any]:
        return states.attempt_row(
            c.sample_id, server=c.server, worker=worker, started_at=call.started_at,
            ended_at=utcnow(), outcome=outcome, error_message=message,
            latency_s=time.monotonic() - call.started_mono,
            ttft_s=result.ttft_s if result else None,
            completion_tokens=result.completion_tokens if result else None,
            turn=c.turn if multi else None)

    if multi:
        messages = turns.history(c.prompt, c.turns or [], c.turn,
                                 reasoning=job.history_reasoning)
    else:
        messages = c.prompt
    capture_name = inline_name(job, c)
    request = ChatRequest(model=job.model, messages=messages, max_tokens=job.max_tokens,
                          sampling=dict(job.sampling), extra_body=dict(job.extra_body),
                          max_response_bytes=job.max_response_bytes, tools=c.tools,
                          max_request_bytes=get_settings().max_request_bytes,
                          capture_name=capture_name)
    result: ChatResult | None = None
    call.calling = True
    try:
        result = await client(c.server, job.inflight_limit).chat(
            request, total_timeout=job.total_timeout, stall_timeout=job.stall_timeout,
            stream=job.stream)
        _check_result(job, result)
    except asyncio.CancelledError:
        call.calling = False
        if call.interrupted:  # the worker is stopping: back to pending, due now
            message = "the worker shut down during the call"
            won = await _write(writer, c, lambda s, now: states.retry(
                s, c.sample_id, c.token, now=now, next_attempt_at=now,
                error_class="interrupted", error_message=message,
                attempt=attempt("interrupted", message, None)))
            return Outcome.RETRY if won else Outcome.NOT_WRITTEN
        if not call.lost:
            raise
        log.warning("sample %s: lease lost mid-call; dropping the call", c.sample_id)
        await writer.write(lambda s, now: states.lose(s, attempt=attempt(
            "lost", "lease lost mid-call", None)))
        return Outcome.NOT_WRITTEN
    except errors.SampleError as exc:
        call.calling = False
        return await _failure(c, job, exc, attempt(exc.error_class, str(exc), result), writer,
                              streaks)
    call.calling = False
    if streaks is not None:
        streaks.ok(c.server)
    # From here the answer is paid for: its wait for the commit is measured from now.
    answered = time.monotonic()

    def late(s: Session, now: datetime) -> bool:  # the lease was given up meanwhile
        return states.keep_late(s, c.sample_id, c.token, worker=worker, server=c.server,
                                turn=c.turn, started_at=call.started_at,
                                lease_until=now + timedelta(seconds=call.lease_s), now=now)

    if not multi:
        return await _finish(c, job, result, attempt("ok", None, result), writer, tokenize_pool,
                             since=answered, late=late, capture_name=capture_name)
    return await _turn_done(c, job, result, attempt("ok", None, result), writer, tokenize_pool,
                            since=answered, late=late, capture_name=capture_name)


#: Makes a sample whose lease was given up this call's again (states.keep_late).
Late = Callable[[Session, datetime], bool]


async def _turn_done(c: Claimed, job: Any, result: ChatResult, attempt: dict[str, Any],
                     writer: Writer, tokenize_pool: ThreadPool, *,
                     since: float | None = None, late: Late | None = None,
                     capture_name: str | None = None) -> Outcome:
    """A turn of a conversation regenerated turn by turn has its answer: store it and
    send the sample back for its next turn, or finish it after its last (or a cut)."""
    answer = _answer(result)
    answers = [*(c.turns or []), answer]
    count = c.turn_count or 1
    extra: dict[str, Any] = dict(turns=answers, turn=len(answers))
    if c.turn + 1 < count:
        positions = turns.turn_positions(c.prompt)
        reason = turns.cut_reason(c.prompt[positions[c.turn]], answer)
        if reason is None:
            won = await _write(writer, c, lambda s, now: states.advance_turn(
                s, c.sample_id, c.token, turn=c.turn + 1, turns=answers, now=now,
                attempt=attempt), since=since, late=late)
            return Outcome.TURN if won else Outcome.NOT_WRITTEN
        extra.update(cut_at_turn=c.turn, cut_reason=reason)
    return await _finish(c, job, result, attempt, writer, tokenize_pool, answers=answers,
                         extra=extra, since=since, late=late, capture_name=capture_name)


async def _finish(c: Claimed, job: Any, result: ChatResult, attempt: dict[str, Any] | None,
                  writer: Writer, tokenize_pool: ThreadPool, *,
                  answers: list[dict[str, Any]] | None = None,
                  extra: dict[str, Any] | None = None, since: float | None = None,
                  late: Late | None = None, capture_name: str | None = None) -> Outcome:
    """Store the response, tokenize it if the job says so, and mark the sample. ``since``:
    when a new answer arrived (its first write makes it durable); ``late``: how that write
    keeps the answer if the lease was given up meanwhile. ``capture_name``: the call asked
    the engine for its hidden states under this name (``--capture inline``): stored with
    the answer (``samples.inline_capture``, the capture stage takes the file), and the
    example is the engine's own ids, when it returned them."""
    engine_ids = _engine_ids(result) if capture_name is not None else None
    columns = {**_response_columns(result), **(extra or {}),
               "inline_capture": capture_name if engine_ids is not None else None} \
        if attempt is not None else {}
    if not job.tokenizer:
        # No example to build: the stored response is the result.
        won = await _write(writer, c, states.completion(
            c.sample_id, c.token, attempt=attempt, **columns), since=since, late=late)
        return Outcome.DONE if won else Outcome.NOT_WRITTEN
    # A new answer is paid for: store it before anything else can go wrong.
    if attempt is not None and not await _write(writer, c, lambda s, now: states.store_response(
            s, c.sample_id, c.token, now=now, attempt=attempt, **columns), since=since,
            late=late):
        return Outcome.NOT_WRITTEN
    loop = asyncio.get_running_loop()
    try:
        example = await loop.run_in_executor(tokenize_pool, lambda: tokenize_sample(
            job, c.prompt, result.content, result.reasoning_content,
            result.completion_token_ids, tool_calls=result.tool_calls, tools=c.tools,
            answers=answers, finish_reason=result.finish_reason, engine_ids=engine_ids))
    except Exception as exc:  # noqa: BLE001 - recorded on the sample, never looped on
        if not isinstance(exc, errors.PermanentError):
            log.exception("sample %s: tokenization crashed", c.sample_id)
        return await _tokenization_failed(c, exc, writer)
    won = await _write(writer, c, states.completion(c.sample_id, c.token, **example))
    return Outcome.DONE if won else Outcome.NOT_WRITTEN


def _engine_ids(result: ChatResult) -> tuple[list[int], list[int]] | None:
    """The call's prompt and output token ids as the engine returned them, or None (an
    engine that did not: its answer's example is tokenized our way, and the capture stage
    captures it with a call of its own)."""
    if not result.prompt_token_ids or not result.completion_token_ids:
        return None
    return list(result.prompt_token_ids), list(result.completion_token_ids)


async def _write(writer: Writer, c: Claimed, fn: Callable[[Session, datetime], bool], *,
                 since: float | None = None, late: Late | None = None) -> bool:
    """A write of this sample's; one the database refuses (not a transient error, e.g.
    text PostgreSQL cannot store) fails the sample with ``unstorable`` instead.
    ``since``: the write makes an answer that arrived then durable (measured). ``late``:
    when the write loses (the lease was given up meanwhile), the answer is kept by a
    second write that takes the sample back first (states.keep_late), if it still can."""
    try:
        won = bool(await writer.write(fn, since=since) if since is not None
                   else await writer.write(fn))
        if won or late is None:
            return won
        won = bool(await writer.write(lambda s, now: late(s, now) and fn(s, now)))
        if won:
            log.info("sample %s: its answer came after its lease was given up; kept (no "
                     "later attempt had finished)", c.sample_id)
        return won
    except errors.DiskFull:
        raise  # nothing can be written: the sample is not at fault
    except Exception as exc:  # noqa: BLE001 - recorded on the sample
        if disk_full(exc) or getattr(writer, "disk_full", None):
            raise
        # The whole error (SQL included) to the log; the sample's message is one line.
        log.warning("sample %s: write refused: %s", c.sample_id, exc)
        refused = errors.Unstorable(f"the result could not be stored: {errors.brief(exc)}")
        return bool(await writer.write(lambda s, now: states.fail(
            s, c.sample_id, c.token, error_class=refused.error_class, error_message=str(refused),
            now=now)))


async def _tokenization_failed(c: Claimed, exc: BaseException, writer: Writer) -> Outcome:
    """No example: the sample is skipped or failed (synthq.data.examples.tokenization_failure)."""
    state, error = tokenization_failure(exc)
    skip = state == SampleState.SKIPPED
    transition = states.skip if skip else states.fail
    won = await _write(writer, c, lambda s, now: transition(
        s, c.sample_id, c.token, error_class=error.error_class, error_message=str(error),
        now=now))
    if not won:
        return Outcome.NOT_WRITTEN
    return Outcome.SKIPPED if skip else Outcome.FAILED


def wrong_base_url(server: str, exc: errors.SampleError) -> str | None:
    """The hint when ``exc`` says ``server`` is not the OpenAI base URL, else None.

    A URL without ``/v1`` (``http://host:8000``) makes every call a 404, and a
    server without a ``/models`` route gives the model check at enqueue
    nothing to go on: the first 404 is the first sign.
    """
    if not isinstance(exc, errors.BadRequest) or not str(exc).startswith("HTTP 404"):
        return None
    base = server.rstrip("/")
    if base.endswith("/v1"):
        return None
    return (f"server {server} answered 404 for /chat/completions: is it the OpenAI base URL, "
            f"ending in /v1 (e.g. --server {base}/v1)?")


async def _wrong_base(c: Claimed, hint: str, attempt: dict[str, Any],
                      writer: Writer) -> Outcome:
    """Pause the job and give the call back, instead of failing every sample with a 404."""
    from synthq.core.enums import JobState

    def record(s: Session, now: datetime) -> bool:
        jobs.set_job_state(s, c.job_id, JobState.PAUSED, now=now, reason=hint)
        return states.retry(s, c.sample_id, c.token, now=now, next_attempt_at=now,
                            error_class="bad_request", error_message=hint, attempt=attempt,
                            charge=False)

    log.warning("job %s paused: %s", c.job_id, hint)
    return Outcome.RETRY if await _write(writer, c, record) else Outcome.NOT_WRITTEN


async def _unsent(c: Claimed, stop: Any, writer: Writer) -> Outcome:
    """Give back, uncharged and unsent, a sample claimed before its server's stop committed
    (the job is paused: it waits in ``pending`` for the resume)."""
    message = f"not sent: server {stop.server} was stopped after {stop.count} " \
              f"{stop.error_class} failures in a row"
    won = await _write(writer, c, lambda s, now: states.retry(
        s, c.sample_id, c.token, now=now, next_attempt_at=now, error_class="interrupted",
        error_message=message, charge=False))
    return Outcome.RETRY if won else Outcome.NOT_WRITTEN


async def _failure(c: Claimed, job: Any, exc: errors.SampleError, attempt: dict[str, Any],
                   writer: Writer, streaks: Streaks | None = None) -> Outcome:
    hint = wrong_base_url(c.server, exc)
    if hint is not None:
        return await _wrong_base(c, hint, attempt, writer)
    stop = streaks.failed(c.server, exc.error_class, str(exc)) if streaks is not None else None
    pause = stop.line("call", f"`synthq resume {job.name}` and `synthq requeue {job.name} "
                      f"--failed --class {stop.error_class}`") if stop is not None else None
    message = str(exc)
    if _multi(job, c):  # which turn, for the person who requeues it
        message = f"turn {c.turn + 1} of {c.turn_count}: {message}"
    # An overload answer (Retry-After) is not charged to the budget, within a cap on
    # the sample's calls in all (counted in the write's transaction).
    overload = isinstance(exc, errors.RetryableError) and exc.overload
    due = ledger.retry_or_fail(states.SAMPLES, exc, c.attempts, job, charged=not overload)
    retry, delay = due is not None, due or 0.0
    gave_up = f"{message} (gave up after {c.attempts} attempts)" if exc.retryable else message
    if overload:
        gave_up = (f"{message} (gave up: overloaded for "
                   f"{errors.OVERLOAD_CALLS_PER_ATTEMPT * job.max_attempts} calls)")
    decided = {"retry": retry}

    def record(s: Session, now: datetime) -> bool:
        from synthq.core.enums import JobState

        if pause is not None and jobs.set_job_state(s, c.job_id, JobState.PAUSED, now=now,
                                                      reason=pause):
            log.warning("job %s paused: %s", c.job_id, pause)
        charge = True
        if overload:  # this call's own row is not inserted yet: + 1
            calls = s.scalar(select(func.count()).select_from(Attempt)
                             .where(Attempt.sample_id == c.sample_id)) or 0
            charge = False
            decided["retry"] = calls + 1 < errors.OVERLOAD_CALLS_PER_ATTEMPT * job.max_attempts
        if decided["retry"]:
            return states.retry(s, c.sample_id, c.token, now=now,
                                next_attempt_at=now + timedelta(seconds=delay),
                                error_class=exc.error_class, error_message=message,
                                attempt=attempt, charge=charge)
        return states.fail(s, c.sample_id, c.token, now=now, error_class=exc.error_class,
                           error_message=gave_up, attempt=attempt)

    written = await _write(writer, c, record)
    if stop is not None and streaks is not None:
        # Committed (or refused): claims that begin from now on see the job paused.
        streaks.settled(c.server, time.monotonic())
    if not written:
        return Outcome.NOT_WRITTEN
    return Outcome.RETRY if decided["retry"] else Outcome.FAILED

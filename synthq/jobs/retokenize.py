"""Recompute a job's training examples from the stored responses: no server calls.

``synthq retokenize`` changes a job's tokenization settings (tokenizer,
template, max length, reasoning, mask), bumps its ``tokenize_version``, and
recomputes every sample that has a stored response and an example from an
older version: done samples, and those that tokenization failed or skipped
(a new template or length may fix them). Work is split into batches of
sample ids: Celery tasks on the ``tokenize`` queue, spread over the worker
processes, or a loop in this process in embedded mode. Progress is read from
SQL (samples still at an older version), so lost messages are simply sent
again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from synthq.core import errors
from synthq.core.enums import SampleState
from synthq.core.errors import UserError
from synthq.core.packing import unpack_ids
from synthq.data.examples import choose, tokenization_failure, tokenize_sample
from synthq.data.tokenize import TokenizeSettings, get_chat_tokenizer
from synthq.queue import jobs, states
from synthq.queue.jobview import effective
from synthq.spec import jobspec
from synthq.store.db import session_scope, utcnow, with_db_retry
from synthq.store.models import Job, Sample

__all__ = ["configure", "stale_query", "stale_ids", "count_stale", "retokenize_batch",
           "run_in_process"]

#: Samples whose stored response can be (re)tokenized.
_HAS_RESPONSE = Sample.response_content.is_not(None)


def _eligible(job_id: int) -> Any:
    """Samples retokenize can work on: :data:`synthq.core.errors.RETOKENIZABLE` in SQL."""
    return and_(Sample.job_id == job_id, _HAS_RESPONSE, or_(*(
        Sample.state == state if classes is None
        else and_(Sample.state == state, Sample.error_class.in_(sorted(classes)))
        for state, classes in errors.RETOKENIZABLE.items())))


def stale_query(job_id: int, version: int) -> Any:
    """Eligible samples whose example is from an older version (or missing)."""
    return and_(_eligible(job_id), or_(Sample.tokenize_version.is_(None),
                                       Sample.tokenize_version < version))


def configure(session: Session, job: Job, changes: dict[str, Any]) -> int:
    """Apply tokenization ``changes`` to ``job``, check they work, bump the version."""
    unknown = set(changes) - set(jobspec.RETOKENIZABLE)
    if unknown:
        raise UserError(f"cannot change {sorted(unknown)} by retokenizing")
    merged = {name: getattr(job, name) for name in (*jobspec.TOKENIZATION,
                                                    *jobspec.RETOKENIZABLE)} | changes
    settings = TokenizeSettings.from_job(SimpleNamespace(**merged, regenerate=job.regenerate))
    if settings is None:
        raise UserError(f"job {job.name} has no tokenizer: pass --tokenizer")
    tok = get_chat_tokenizer(settings)  # raises a clear error if it cannot work
    if "examples" in changes or "mask" in changes:  # refused where every sample would fail
        choose(merged["examples"], regenerate=job.regenerate, mask=merged["mask"],
               tokenizer=tok)
    writes = {**changes, "tokenize_version": job.tokenize_version + 1}
    if merged["reasoning"] == "auto":  # stored resolved, as enqueue does
        writes["reasoning"] = tok.reasoning
    jobs.update_job(session, job, writes, now=utcnow())
    return job.tokenize_version


def stale_ids(session: Session, job_id: int, version: int, *, after: int = 0,
              limit: int = 1000) -> list[int]:
    return list(session.scalars(
        select(Sample.id).where(stale_query(job_id, version), Sample.id > after)
        .order_by(Sample.id).limit(limit)))


def count_stale(session: Session, job_id: int, version: int) -> tuple[int, int]:
    """(stale, eligible) sample counts."""
    stale = session.scalar(select(func.count()).select_from(Sample)
                           .where(stale_query(job_id, version))) or 0
    total = session.scalar(select(func.count()).select_from(Sample)
                           .where(_eligible(job_id))) or 0
    return stale, total


@dataclass
class BatchResult:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    #: Already current (another batch or the generating worker got there).
    unchanged: int = 0


def retokenize_batch(job_id: int, sample_ids: Sequence[int]) -> BatchResult:
    """Recompute the examples of ``sample_ids`` at the job's current version."""
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        s.expunge(job)
        rows = s.execute(
            select(Sample.id, Sample.prompt, Sample.response_content, Sample.reasoning_content,
                   Sample.finish_reason, Sample.completion_token_ids, Sample.tool_calls,
                   Sample.tools, Sample.turns, Sample.overrides, Sample.prompt_token_ids,
                   Sample.inline_capture)
            .where(Sample.id.in_(sample_ids), stale_query(job_id, job.tokenize_version))
        ).all()
    result = BatchResult(unchanged=len(sample_ids) - len(rows))
    updates: list[tuple[int, dict[str, Any]]] = []
    for sid, prompt, content, reasoning, finish, server_ids, tool_calls, tools, answers, \
            overrides, prompt_ids, inline_capture in rows:
        ids = unpack_ids(server_ids)
        # A --capture inline answer's example stays the engine's ids (its capture's).
        given = unpack_ids(prompt_ids)
        engine_ids = (given.tolist(), ids.tolist()) \
            if inline_capture and given is not None and ids is not None else None
        try:
            # A sample requeued with its own chat_template_kwargs was generated with
            # them: its example is rendered with them too, as the worker did.
            values = tokenize_sample(effective(job, overrides), prompt or [], content or "",
                                     reasoning, ids.tolist() if ids is not None else None,
                                     tool_calls=tool_calls, tools=tools,
                                     answers=answers if job.regenerate == "all" else None,
                                     finish_reason=finish, engine_ids=engine_ids)
            values.update(state=SampleState.DONE, error_class=None, error_message=None)
            result.done += 1
        except Exception as exc:  # noqa: BLE001 - recorded on the sample, as the worker does
            state, error = tokenization_failure(exc)
            values = dict(state=state, error_class=error.error_class, error_message=str(error),
                          input_ids=None, loss_mask=None, num_tokens=None, num_supervised=None,
                          tokenize_version=job.tokenize_version, token_mismatch=None,
                          examples=None)
            if state == SampleState.SKIPPED:
                result.skipped += 1
            else:
                result.failed += 1
        updates.append((sid, values))

    def write() -> None:
        now = utcnow()
        with session_scope() as s:
            for sid, values in updates:
                # CAS: still eligible and still older than this version.
                states.retokenized(s, sid, still_stale=stale_query(job_id, job.tokenize_version),
                                   now=now, **values)

    with_db_retry(write, what=f"retokenize batch of job {job_id}")
    return result


def run_in_process(job_id: int, *, batch_size: int = 200,
                   progress: Callable[[int, int], None] | None = None) -> BatchResult:
    """Embedded mode: every stale sample, batch by batch, in this process."""
    total = BatchResult()
    after = 0
    while True:
        with session_scope() as s:
            version = s.get_one(Job, job_id).tokenize_version
            ids = stale_ids(s, job_id, version, after=after, limit=batch_size)
        if not ids:
            return total
        r = retokenize_batch(job_id, ids)
        total.done += r.done
        total.failed += r.failed
        total.skipped += r.skipped
        total.unchanged += r.unchanged
        after = ids[-1]
        if progress:
            with session_scope() as s:
                progress(*count_stale(s, job_id, version))

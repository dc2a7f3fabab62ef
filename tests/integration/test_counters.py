"""The per-job counters (``sample_counts``, ``call_counts``, kept by the triggers of
migration 0016) equal a GROUP BY over the rows after a mixed workload, on PostgreSQL
and on SQLite: enqueue (a malformed row included), dispatch, claims, answers,
failures, retries, the sweep, requeue, a cancelled job, a sample and a job deleted
by hand, and the fold of the delta rows."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, select, text, update

from synthq.core.enums import JobState
from synthq.data.dataset import Row
from synthq.jobs.enqueue import EnqueueReport, JobSpec, get_or_create_job
from synthq.jobs.retokenize import stale_query
from synthq.jobs.samplecopy import insert_rows
from synthq.queue import jobs, states
from synthq.queue.dispatch import Dispatched, dispatch
from synthq.store.counts import call_counts, compact_counts, state_counts
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, CallCount, Job, Sample, SampleCount
from synthq.views.report import job_status

pytestmark = pytest.mark.integration

SERVERS = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]


@pytest.fixture
def backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """tests/integration/conftest.py's, with no broker (capacity: the test says how much)."""
    monkeypatch.setenv("SYNTHQ_BROKER_URL", "")
    from synthq.spec.config import get_settings

    get_settings.cache_clear()
    yield backend


def _job(name: str, n: int) -> int:
    spec = JobSpec(name=name, model="m", servers=SERVERS, max_tokens=16, inflight_limit=50,
                   max_attempts=2)
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    rows = [Row(i, [{"role": "user", "content": f"{name} prompt {i}"}]) for i in range(n)]
    rows.append(Row(n, None, skip_reason="no messages", raw="{}"))  # a malformed row
    insert_rows(job_id, settings, rows, EnqueueReport(job_id=job_id, job_name=name,
                                                      created=True))
    return job_id


def _attempt(d: Dispatched, outcome: str) -> dict[str, Any]:
    now = utcnow()
    return dict(sample_id=d.sample_id, server=d.server, worker="w", started_at=now,
                ended_at=now, outcome=outcome, latency_s=0.1, completion_tokens=7)


def _work(job_id: int, count: int) -> dict[str, int]:
    """Dispatch ``count``, claim them, and end them: done, retry, fail, lost; returns
    how many of each."""
    taken: list[Dispatched] = []
    dispatch(taken.extend, job_ids=[job_id], capacity=count)
    now = utcnow()
    token = secrets.token_hex(16)
    with session_scope() as s:
        claimed = states.claim_batch(s, [(d.sample_id, d.token) for d in taken],
                                     new_token=token, lease_until=now + timedelta(minutes=5),
                                     worker="w", now=now)
    by_id = {d.sample_id: d for d in taken}
    ends = {"done": 0, "retry": 0, "fail": 0, "held": 0}
    with session_scope() as s:  # one transaction, like the batch writer's
        for i, c in enumerate(claimed):
            d = by_id[c.sample_id]
            if i % 5 in (0, 1):
                states.complete(s, c.sample_id, token, now=now, attempt=_attempt(d, "ok"),
                                response_content="an answer", completion_tokens=7,
                                num_tokens=20 + i, num_supervised=5, tokenize_version=1,
                                token_mismatch=i % 2 == 0)
                ends["done"] += 1
            elif i % 5 == 2:
                states.retry(s, c.sample_id, token, next_attempt_at=now, error_class="timeout",
                             error_message="slow", now=now, attempt=_attempt(d, "timeout"))
                ends["retry"] += 1
            elif i % 5 == 3:
                states.fail(s, c.sample_id, token, error_class="bad_request",
                            error_message="no", now=now, attempt=_attempt(d, "bad_request"))
                ends["fail"] += 1
            else:
                ends["held"] += 1  # left running: the sweep takes them back
    return ends


Key = tuple[Any, ...]


def _truth() -> tuple[dict[Key, tuple[int, ...]], dict[Key, tuple[int, ...]],
                      dict[Key, tuple[int, int]], dict[Key, tuple[int, int]]]:
    """(the counters, a GROUP BY over samples, the call counters, one over attempts)."""
    with session_scope() as s:
        key = (SampleCount.job_id, SampleCount.state, SampleCount.error_class,
               SampleCount.tokenize_version, SampleCount.answered)
        counted = {(*r[:4], bool(r[4])): tuple(int(x) for x in r[5:]) for r in s.execute(
            select(*key, func.sum(SampleCount.n), func.sum(SampleCount.tokens),
                   func.sum(SampleCount.supervised), func.sum(SampleCount.mismatches))
            .group_by(*key)) if any(r[5:])}
        answered = Sample.response_content.is_not(None)
        key = (Sample.job_id, Sample.state, Sample.error_class, Sample.tokenize_version,
               answered)
        grouped = {(r[0], str(r[1]), r[2], r[3], bool(r[4])): tuple(int(x or 0) for x in r[5:])
                   for r in s.execute(
            select(*key, func.count(), func.sum(Sample.num_tokens),
                   func.sum(Sample.num_supervised),
                   func.count().filter(Sample.token_mismatch.is_(True)))
            .group_by(*key))}
        calls = {(j, srv, o): (int(n), int(t)) for j, srv, o, n, t in s.execute(
            select(CallCount.job_id, CallCount.server, CallCount.outcome, func.sum(CallCount.n),
                   func.sum(CallCount.tokens))
            .group_by(CallCount.job_id, CallCount.server, CallCount.outcome)) if n}
        attempts = {(j, srv, o): (n, int(t or 0)) for j, srv, o, n, t in s.execute(
            select(Sample.job_id, Attempt.server, Attempt.outcome, func.count(),
                   func.sum(Attempt.completion_tokens))
            .join(Sample, Sample.id == Attempt.sample_id)
            .group_by(Sample.job_id, Attempt.server, Attempt.outcome))}
    return counted, grouped, calls, attempts


def _check() -> None:
    counted, grouped, calls, attempts = _truth()
    assert counted == grouped
    assert calls == attempts


def test_counters_equal_a_group_by_after_a_mixed_workload(backend: str) -> None:
    a = _job("a", 120)
    b = _job("b", 40)
    _check()
    ends = _work(a, 60)
    assert ends["done"] and ends["retry"] and ends["fail"] and ends["held"]
    _work(b, 30)
    _check()
    with session_scope() as s:  # the fold: one row per key, sums unchanged
        compact_counts(s)
    _check()
    # The sweep: the held samples' leases end (one last attempt: failed as connection).
    with session_scope() as s:
        moved = states.expire(s, now=utcnow(), cutoff=utcnow() + timedelta(days=1))
    assert moved
    _check()
    # Retries come back round; requeue the failures; a second round of work.
    _work(a, 40)
    with session_scope() as s:
        assert states.requeue(s, a, now=utcnow()) > 0
    _check()
    # Cancel job b: its queued samples go back to pending at the claim.
    taken: list[Dispatched] = []
    dispatch(taken.extend, job_ids=[b], capacity=10)
    with session_scope() as s:
        assert jobs.set_job_state(s, b, JobState.CANCELLED, now=utcnow())
    with session_scope() as s:
        assert states.claim_batch(s, [(d.sample_id, d.token) for d in taken],
                                  new_token="t" * 32, lease_until=utcnow(), worker="w",
                                  now=utcnow()) == []
    _check()
    # By hand: one sample of a deleted (its calls stay: history), then the whole job b.
    with session_scope() as s:
        one = s.scalar(select(Sample.id).where(Sample.job_id == a, Sample.state == "done")
                       .limit(1))
        s.execute(delete(Attempt).where(Attempt.sample_id == one))
        s.execute(delete(Sample).where(Sample.id == one))
    counted, grouped, _, _ = _truth()
    assert counted == grouped
    with session_scope() as s:
        s.execute(delete(Job).where(Job.id == b))
    counted, grouped, calls, _ = _truth()
    assert counted == grouped and not any(k[0] == b for k in counted)
    assert counted
    assert not any(k[0] == b for k in calls)
    with session_scope() as s:
        compact_counts(s)
        keys = s.execute(select(SampleCount.job_id, SampleCount.state, SampleCount.error_class,
                                SampleCount.tokenize_version, SampleCount.answered)).all()
        assert len(keys) == len(set(keys))  # one row per key after the fold
        assert all(n for n in s.scalars(select(SampleCount.n)))  # no key at zero
    counted, grouped, _, _ = _truth()
    assert counted == grouped
    # What status reads from the counters equals what the rows say.
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == a).values(tokenizer="a-tokenizer",
                                                         tokenize_version=2))
    with session_scope() as s:
        one = s.scalar(select(Sample.id).where(Sample.job_id == a, Sample.state == "done")
                       .limit(1))
        s.execute(update(Sample).where(Sample.id == one).values(tokenize_version=2))  # retokenized
        job = s.get_one(Job, a)
        status = job_status(s, job, cost=False)
        done = [v for (j, st, *_), v in grouped.items() if j == a and st == "done"]
        assert status.counts == state_counts(s, a) and status.total == sum(
            v[0] for (j, *_), v in grouped.items() if j == a)
        failures: dict[str, int] = {}
        for (j, st, c, *_), v in grouped.items():
            if j == a and st == "failed":
                failures[c or "unknown"] = failures.get(c or "unknown", 0) + v[0]
        assert status.failures == failures
        assert status.calls == call_counts(s, a) and status.calls.get("ok")
        assert (status.num_tokens, status.num_supervised, status.token_mismatches) == (
            sum(v[1] for v in done), sum(v[2] for v in done), sum(v[3] for v in done))
        assert status.num_tokens > 0 and status.token_mismatches > 0
        stale = s.scalar(select(func.count()).select_from(Sample).where(stale_query(a, 2)))
        assert status.stale_examples == stale and 0 < stale < status.counts["done"]


def test_a_broken_trigger_is_caught(backend: str) -> None:
    """The comparison can fail: with the update trigger gone, transitions go uncounted."""
    a = _job("a", 20)
    with session_scope() as s:
        if backend == "postgresql":
            s.execute(text("ALTER TABLE samples DISABLE TRIGGER synthq_samples_updated"))
        else:
            s.execute(text("DROP TRIGGER synthq_samples_updated"))
    try:
        _work(a, 10)
        counted, grouped, _, _ = _truth()
        assert counted != grouped
    finally:
        if backend == "postgresql":
            with session_scope() as s:
                s.execute(text("ALTER TABLE samples ENABLE TRIGGER synthq_samples_updated"))


@pytest.fixture(params=["postgresql", "sqlite"])
def at_0015(request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database at the head; the settings point at it. (The test takes it back to 0015
    with its rows: rows written by today's models need today's columns.)"""
    from support import TEST_ENV, _reset_process_state, fresh_pg_database, pg_database

    from synthq.store.migrate import upgrade

    with contextlib.ExitStack() as stack:
        if request.param == "postgresql":
            url = stack.enter_context(fresh_pg_database(pg_database("backfill_")))
        else:
            url = f"sqlite:///{tmp_path / 'backfill.db'}"
        upgrade(url)
        monkeypatch.setenv("SYNTHQ_DATABASE_URL", url)
        monkeypatch.setenv("SYNTHQ_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("SYNTHQ_BROKER_URL", "")
        for key, value in TEST_ENV.items():
            monkeypatch.setenv(key, value)
        _reset_process_state()
        yield url
        _reset_process_state()


def test_the_migration_backfills_the_counters(at_0015: str) -> None:
    """Jobs that existed before migration 0016 get their counters filled by it."""
    from alembic import command

    from synthq.store.db import dispose_engines
    from synthq.store.migrate import alembic_config, upgrade

    a = _job("a", 30)
    _work(a, 20)
    dispose_engines()
    command.downgrade(alembic_config(at_0015), "0015")  # the rows stay, the counters go
    upgrade(at_0015)
    counted, grouped, calls, attempts = _truth()
    assert counted == grouped and grouped
    assert calls == attempts and attempts
    _work(a, 5)  # and the triggers keep them from there
    _check()

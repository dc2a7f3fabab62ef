"""Each failure class ends in the right state, attempt count and backoff.

Real PostgreSQL, the simulator over real HTTP, and the production code path
(dispatcher → claim → call → record) run in this process. A prompt's
``[[sim:FAULT*K]]`` directive makes the simulator fail its first K requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from synthq.queue.dispatch import Dispatched, dispatch
from synthq.serving.call import Outcome
from synthq.serving.executor import process_sample
from synthq.store.db import session_scope
from synthq.store.models import Attempt, Sample

pytestmark = pytest.mark.integration


def run_until_settled(job_id: int, max_rounds: int = 20) -> list[Outcome]:
    """Dispatch and process, ignoring backoff waits, until nothing is open."""
    from sqlalchemy import update

    outcomes: list[Outcome] = []
    for _ in range(max_rounds):
        batch: list[Dispatched] = []
        dispatch(batch.extend, job_ids=[job_id])
        for item in batch:
            outcomes.append(process_sample(item.sample_id, item.token, job_id=item.job_id))
        with session_scope() as s:
            open_ = s.scalars(select(Sample.id).where(
                Sample.job_id == job_id, Sample.state.in_(["pending", "queued", "running"]))).all()
            if not open_:
                return outcomes
            # Tests do not wait out the backoff; the delay itself is checked separately.
            s.execute(update(Sample).where(Sample.id.in_(open_))
                      .values(next_attempt_at=Sample.created_at))
    raise AssertionError(f"job {job_id} did not settle: {outcomes}")


def only_sample(job_id: int) -> Sample:
    with session_scope() as s:
        return s.scalars(select(Sample).where(Sample.job_id == job_id)).one()


def attempt_outcomes(sample_id: int) -> list[str]:
    with session_scope() as s:
        return list(s.scalars(select(Attempt.outcome).where(Attempt.sample_id == sample_id)
                              .order_by(Attempt.id)))


CASES = [
    # directive, job fields, final state, error class, attempts
    ("error*2",             {},                                    "done",   None,             3),
    ("error",               {},                                    "failed", "server_error",   3),
    # A 429 with Retry-After is an overload: its call is not charged (UNCHARGED).
    ("rate_limit*1",        {},                                    "done",   None,             1),
    # A stream the server breaks off after answering is its fault, not unreachability.
    ("reset",               {},                                    "failed", "server_error",   3),
    ("html",                {},                                    "failed", "server_error",   3),
    ("nodone",              {},                                    "failed", "server_error",   3),
    ("stall",               {"stall_timeout": 1.0},                "failed", "stalled",        3),
    ("hang",                {"stall_timeout": 1.0},                "failed", "stalled",        3),
    ("hang",                {"stall_timeout": 5.0, "total_timeout": 1.0}, "failed", "timeout", 3),
    ("context_length",      {},                                    "failed", "context_length", 1),
    ("empty",               {},                                    "failed", "empty_response", 1),
    ("length",              {},                                    "failed", "truncated",      1),
    ("length",              {"keep_truncated": True},              "done",   None,             1),
]
#: Calls a case makes beyond the attempts charged: overload answers (Retry-After).
UNCHARGED = {"rate_limit*1": 1}


@pytest.mark.parametrize(("fault", "fields", "state", "error_class", "attempts"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_failure_class(simulator: Callable[..., Any], job_factory: Callable[..., Any],
                       fault: str, fields: dict[str, Any], state: str, error_class: str | None,
                       attempts: int) -> None:
    sim = simulator("--latency", "0")
    report = job_factory([f"tell me a story [[sim:{fault}]]"], servers=[sim.url],
                         max_attempts=3, **fields)
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == (state, error_class, attempts), \
        smp.error_message
    outcomes = attempt_outcomes(smp.id)
    calls = attempts + UNCHARGED.get(fault, 0)
    assert len(outcomes) == calls
    assert outcomes[-1] == ("ok" if state == "done" else error_class)
    if state == "done":
        assert smp.response_content and smp.finish_reason in ("stop", "length")
    else:
        assert smp.error_message
    # The server saw exactly one request per attempt: no hidden client retries.
    assert sim.stats()["prompts"][f"tell me a story [[sim:{fault}]]"] == calls


def test_retry_backoff_within_bounds(simulator: Callable[..., Any],
                                     job_factory: Callable[..., Any],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A retryable failure waits in SQL: next_attempt_at - now in [0, min(cap, base*2^(n-1))]."""
    from synthq.store.db import utcnow

    # Three 500s in a row make the server down (one probe per PROBE_INTERVAL): not tested here.
    monkeypatch.setattr("synthq.queue.outage.PROBE_INTERVAL", 0.0)

    sim = simulator("--latency", "0")
    report = job_factory(["x [[sim:error]]"], servers=[sim.url], max_attempts=10,
                         backoff_base=4.0, backoff_cap=10.0)
    batch: list[Dispatched] = []
    for attempt, ceiling in [(1, 4.0), (2, 8.0), (3, 10.0), (4, 10.0)]:
        if not batch:
            dispatch(batch.extend, job_ids=[report.job_id])
        assert len(batch) == 1, f"attempt {attempt}: sample not due"
        before = utcnow()
        assert process_sample(batch[0].sample_id, batch[0].token) is Outcome.RETRY
        after = utcnow()
        smp = only_sample(report.job_id)
        assert smp.state == "pending" and smp.attempts == attempt
        assert smp.next_attempt_at is not None
        delay_low = (smp.next_attempt_at - after).total_seconds()
        delay_high = (smp.next_attempt_at - before).total_seconds()
        assert -0.01 <= delay_high and delay_low <= ceiling + 0.01
        batch = []
        # Not due yet (unless the jitter drew ~0): the dispatcher leaves it alone.
        if delay_low > 0.5:
            nothing: list[Dispatched] = []
            dispatch(nothing.extend, job_ids=[report.job_id])
            if nothing and utcnow() >= smp.next_attempt_at:
                # A loaded machine reached this line after the sample fell due (CI, at
                # load 10): it went, rightly; it is the next attempt's batch.
                batch = nothing
                continue
            assert nothing == []
        from sqlalchemy import update

        with session_scope() as s:
            s.execute(update(Sample).where(Sample.id == smp.id)
                      .values(next_attempt_at=Sample.created_at))


def test_retry_after_is_a_floor(simulator: Callable[..., Any],
                                job_factory: Callable[..., Any]) -> None:
    from synthq.store.db import utcnow

    sim = simulator("--latency", "0")  # 429s carry Retry-After: 1
    report = job_factory(["y [[sim:rate_limit]]"], servers=[sim.url], max_attempts=5,
                         backoff_base=0.0, backoff_cap=0.01)
    batch: list[Dispatched] = []
    dispatch(batch.extend, job_ids=[report.job_id])
    before = utcnow()
    assert process_sample(batch[0].sample_id, batch[0].token) is Outcome.RETRY
    smp = only_sample(report.job_id)
    assert smp.error_class == "rate_limited"
    assert (smp.next_attempt_at - before).total_seconds() >= 0.99


def test_job_finishes_with_one_server_dead(simulator: Callable[..., Any],
                                           job_factory: Callable[..., Any]) -> None:
    """Two servers, one refusing connections: the embedded runner finishes every sample
    on the live one; the dead one fails its health probe and is sent nothing."""
    from support import free_port

    from synthq.app.embedded import run_job

    sim = simulator("--latency", "0.05")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    report = job_factory([f"q{i}" for i in range(60)], servers=[dead, sim.url],
                         inflight_limit=8, max_attempts=5, backoff_base=0.05, backoff_cap=0.2)
    status = run_job(report.job_id)
    assert status.counts["done"] == 60, status
    assert list(status.unhealthy) == [dead] and "ConnectError" in (status.unhealthy[dead] or "")
    with session_scope() as s:
        dead_calls = s.scalar(select(func.count()).select_from(Attempt)
                              .where(Attempt.server == dead))
    assert dead_calls == 0


def test_server_without_health_endpoint_is_watched_passively(
        job_factory: Callable[..., Any]) -> None:
    """A server that refuses connections but whose probe is not due yet (or that has no
    /health) still gets only one request at a time once its calls fail to connect."""
    from support import free_port

    from synthq.app.embedded import run_job
    from synthq.serving.health import probe_due

    dead = f"http://127.0.0.1:{free_port()}/v1"
    # The server is down once its third failure is committed. A retry due sooner than
    # that (a backoff of milliseconds, the writer a few behind) may go out before the
    # trip, as it would in production: the backoff here outlasts the writer's lag, so
    # what is measured is the probing once the server is known down.
    report = job_factory([f"q{i}" for i in range(3)], servers=[dead], inflight_limit=8,
                         max_attempts=2, backoff_base=0.5, backoff_cap=0.5)
    with pytest.MonkeyPatch.context() as patch:  # as if /health answered 404
        patch.setattr("synthq.app.tick.probe_due", lambda urls: {})
        status = run_job(report.job_id)
    assert status.counts["failed"] == 3  # nothing to reach: every sample fails, bounded
    with session_scope() as s:
        starts = sorted(s.scalars(select(Attempt.started_at)))
    # The first wave of 3, then probes one at a time, PROBE_INTERVAL apart.
    assert len(starts) == 6
    gaps = [(b - a).total_seconds() for a, b in zip(starts[3:], starts[4:], strict=False)]
    assert all(g >= 1.9 for g in gaps), gaps
    assert probe_due([dead]) == {dead: False}


@pytest.mark.parametrize(("fault", "kind"), [("nul", "nul"), ("surrogate", "surrogate"),
                                             ("badutf8", "invalid_utf8")])
def test_unstorable_text_is_repaired_and_counted(simulator: Callable[..., Any],
                                                 job_factory: Callable[..., Any],
                                                 fault: str, kind: str) -> None:
    """NUL (PostgreSQL refuses it), a lone surrogate (not UTF-8) and invalid UTF-8 bytes:
    stored with U+FFFD in their place, and counted on the sample."""
    sim = simulator("--latency", "0")
    report = job_factory([f"bad bytes [[sim:{fault}]]"], servers=[sim.url], max_attempts=3)
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    assert smp.state == "done", smp.error_message
    assert smp.repairs and smp.repairs.get(kind, 0) >= 1, smp.repairs
    assert "\ufffd" in (smp.response_content or "")


def test_response_over_max_bytes_fails_permanently(simulator: Callable[..., Any],
                                                   job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0", "--response-tokens", "200")
    report = job_factory(["a long answer please"], servers=[sim.url], max_response_bytes=2000)
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == ("failed", "response_too_large", 1)


def test_malformed_answers_do_not_mark_the_server_down(simulator: Callable[..., Any],
                                                       job_factory: Callable[..., Any]) -> None:
    from synthq.queue.dispatch import server_is_down

    sim = simulator("--latency", "0")
    report = job_factory([f"junk {i} [[sim:html]]" for i in range(4)], servers=[sim.url],
                         max_attempts=1)
    run_until_settled(report.job_id)
    with session_scope() as s:
        assert not server_is_down(s, sim.url)


def test_a_retry_prefers_another_server(simulator: Callable[..., Any],
                                        job_factory: Callable[..., Any]) -> None:
    a, b = simulator("--latency", "0"), simulator("--latency", "0")
    report = job_factory(["flaky once [[sim:error*1]]"], servers=[a.url, b.url])
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    with session_scope() as s:
        servers = list(s.scalars(select(Attempt.server).where(Attempt.sample_id == smp.id)
                                 .order_by(Attempt.id)))
    # Each simulator fails the prompt's first request to it: A fails, B fails, A answers.
    assert smp.state == "done" and servers[0] != servers[1] and servers[1] != servers[2], servers


def test_a_bug_in_the_worker_hands_the_sample_back(simulator: Callable[..., Any],
                                                   job_factory: Callable[..., Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception while running a sample: back to pending after its backoff
    (class worker_error), not stranded as running until its lease expires."""
    import synthq.serving.executor

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    sim = simulator("--latency", "0")
    report = job_factory(["boom"], servers=[sim.url])
    monkeypatch.setattr(synthq.serving.executor, "run_claimed", broken)
    batch: list[Dispatched] = []
    dispatch(batch.extend, job_ids=[report.job_id])
    assert process_sample(batch[0].sample_id, batch[0].token) is Outcome.RETRY
    smp = only_sample(report.job_id)
    assert (smp.state, smp.error_class) == ("pending", "worker_error"), smp.error_message
    assert "a bug" in (smp.error_message or "")


# -- --no-stream: the same executor path, one plain call per attempt ---------------------

NO_STREAM_CASES = [
    ("error*2",        {},                                           "done",   None,             3),
    ("error",          {},                                           "failed", "server_error",   3),
    ("rate_limit*1",   {},                                           "done",   None,             1),
    ("reset",          {},                                           "failed", "server_error",   3),
    ("html",           {},                                           "failed", "server_error",   3),
    # No stall clock without a stream: a silent server is caught by the total timeout.
    ("stall",          {"stall_timeout": 0.1, "total_timeout": 0.5}, "failed", "timeout",        3),
    ("hang",           {"stall_timeout": 0.1, "total_timeout": 0.5}, "failed", "timeout",        3),
    ("context_length", {},                                           "failed", "context_length", 1),
    ("empty",          {},                                           "failed", "empty_response", 1),
    ("length",         {},                                           "failed", "truncated",      1),
    ("length",         {"keep_truncated": True},                     "done",   None,             1),
]


@pytest.mark.parametrize(("fault", "fields", "state", "error_class", "attempts"),
                         NO_STREAM_CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in NO_STREAM_CASES])
def test_failure_class_without_streaming(simulator: Callable[..., Any],
                                         job_factory: Callable[..., Any], fault: str,
                                         fields: dict[str, Any], state: str,
                                         error_class: str | None, attempts: int) -> None:
    """A ``stream=False`` job: the same classes, retries and attempt rows as a streamed
    one, over non-streamed requests only."""
    sim = simulator("--latency", "0")
    prompt = f"tell me a story [[sim:{fault}]]"
    report = job_factory([prompt], servers=[sim.url], max_attempts=3, stream=False, **fields)
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == (state, error_class, attempts), \
        smp.error_message
    calls = attempts + UNCHARGED.get(fault, 0)
    outcomes = attempt_outcomes(smp.id)
    assert len(outcomes) == calls
    assert outcomes[-1] == ("ok" if state == "done" else error_class)
    if state == "done":
        assert smp.response_content and smp.finish_reason in ("stop", "length")
        assert smp.completion_tokens and smp.completion_tokens > 0
    stats = sim.stats()
    assert stats["prompts"][prompt] == calls and stats["streamed"] == 0


def test_no_stream_has_no_stall_clock(simulator: Callable[..., Any],
                                      job_factory: Callable[..., Any]) -> None:
    """A first token later than the stall timeout: a streamed job counts the call as
    stalled; a ``--no-stream`` job waits for the answer (only the total timeout bounds it)."""
    sim = simulator("--latency", "0.6")
    streamed = job_factory(["slow to start"], servers=[sim.url], max_attempts=1,
                           stall_timeout=0.2, total_timeout=5.0)
    plain = job_factory(["slow to start, no stream"], servers=[sim.url], max_attempts=1,
                        stall_timeout=0.2, total_timeout=5.0, stream=False)
    run_until_settled(streamed.job_id)
    run_until_settled(plain.job_id)
    assert only_sample(streamed.job_id).error_class == "stalled"
    smp = only_sample(plain.job_id)
    assert (smp.state, smp.attempts) == ("done", 1), smp.error_message
    with session_scope() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.sample_id == smp.id)).one()
    # One document, no first-token time: latency only.
    assert attempt.ttft_s is None and attempt.latency_s is not None and attempt.latency_s >= 0.6
    assert sim.stats()["streamed"] == 1


def test_no_stream_response_over_max_bytes_fails(simulator: Callable[..., Any],
                                                 job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0", "--response-tokens", "200")
    report = job_factory(["a long answer please"], servers=[sim.url], max_response_bytes=1000,
                         max_tokens=400, stream=False)
    run_until_settled(report.job_id)
    smp = only_sample(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == ("failed", "response_too_large", 1)

"""Leased work's policy, written once beside the ledger (issue 42, item 1): retry-or-fail
with backoff and Retry-After, for generation, the worker's hand-back and capture alike."""

from __future__ import annotations

from datetime import UTC, datetime

from synthq.core import errors
from synthq.queue import ledger, states
from synthq.queue.capture_states import CAPTURES
from synthq.queue.states import SAMPLES
from synthq.store.models import Attempt


def test_a_permanent_error_fails_at_once_whatever_the_budget() -> None:
    for charged in (True, False):
        assert ledger.retry_delay(errors.BadRequest("no"), 1, max_attempts=5, base=1.0,
                                  cap=10.0, charged=charged) is None


def test_a_retryable_error_retries_until_the_charged_attempts_reach_the_budget() -> None:
    exc = errors.TimeoutError_("slow")
    for attempts in (1, 2):
        delay = ledger.retry_delay(exc, attempts, max_attempts=3, base=1.0, cap=10.0)
        assert delay is not None and 0.0 <= delay <= min(10.0, 2.0 ** (attempts - 1))
    assert ledger.retry_delay(exc, 3, max_attempts=3, base=1.0, cap=10.0) is None
    assert ledger.retry_delay(exc, 4, max_attempts=3, base=1.0, cap=10.0) is None


def test_an_uncharged_call_is_not_ended_by_the_budget() -> None:
    """A sample's overload answer: the caller caps those calls its own way."""
    exc = errors.RateLimited("busy", retry_after=5.0)
    assert ledger.retry_delay(exc, 9, max_attempts=3, base=1.0, cap=10.0) is None
    assert ledger.retry_delay(exc, 9, max_attempts=3, base=1.0, cap=2.0, charged=False) == 5.0


def test_the_backoff_is_exponential_with_full_jitter_under_the_cap() -> None:
    exc = errors.ConnectionFailed("refused")
    for attempts in range(1, 10):
        ceiling = min(60.0, 2.0 * 2 ** (attempts - 1))
        draws = [ledger.retry_delay(exc, attempts, max_attempts=99, base=2.0, cap=60.0)
                 for _ in range(200)]
        assert all(d is not None and 0.0 <= d <= ceiling for d in draws)
        assert max(d for d in draws if d is not None) > ceiling * 0.8


def test_retry_after_is_a_floor_and_absent_means_none() -> None:
    assert ledger.retry_delay(errors.ServerError("503", retry_after=7.0), 1, max_attempts=3,
                              base=0.1, cap=0.2) == 7.0
    # The worker's hand-back passes an error with no Retry-After: plain backoff.
    delay = ledger.retry_delay(errors.WorkerError("bug"), 1, max_attempts=3, base=0.1, cap=0.2)
    assert delay is not None and delay <= 0.1


def test_an_uncharged_retry_gives_the_claims_charge_back_for_every_kind() -> None:
    """The claim charged ``attempts + 1``; the refund is ``attempts - 1`` of the kind's own
    table (the contract test runs it against PostgreSQL)."""
    for kind in (SAMPLES, CAPTURES):
        (column, value), = ledger.refund(kind).items()
        assert column == "attempts"
        assert str(value.compile(compile_kwargs={"literal_binds": True})) == \
            f"{kind.model.__tablename__}.attempts - 1"


def test_every_attempt_row_names_every_column_whoever_builds_it() -> None:
    """The worker's outcome, its hand-back after a bug and the sweep's ``lost`` rows share
    one INSERT per transaction, whose columns are the first row's: one shape for all."""
    columns = set(Attempt.__table__.c.keys()) - {"id"}
    now = datetime(2026, 12, 1, tzinfo=UTC)
    bare = states.attempt_row(7, server="http://s/v1", worker=None, started_at=now,
                              ended_at=now, outcome="lost", error_message=None)
    assert set(bare) == columns
    assert {k: v for k, v in bare.items() if v is not None} == dict(
        sample_id=7, server="http://s/v1", started_at=now, ended_at=now, outcome="lost")
    full = states.attempt_row(7, server="s", worker="w", started_at=now, ended_at=now,
                              outcome="ok", error_message=None, latency_s=1.5, ttft_s=0.25,
                              completion_tokens=12, turn=2)
    assert (full["worker"], full["latency_s"], full["ttft_s"], full["completion_tokens"],
            full["turn"]) == ("w", 1.5, 0.25, 12, 2)


def test_the_claim_charges_by_the_kinds_declaration() -> None:
    """Samples: a call (none when the answer is stored); captures: every claim; runs keep no
    budget. The one claim statement (ledger.claim_statement) sets what ledger.charged says."""
    from synthq.queue.run_states import RUNS

    def compiled(kind: ledger.Kind) -> str:
        (column, value), = ledger.charged(kind).items()
        assert column == "attempts"
        return str(value.compile(compile_kwargs={"literal_binds": True})).replace("\n", " ")

    assert compiled(SAMPLES) == ("CASE WHEN (samples.response_content IS NULL) "
                                 "THEN samples.attempts + 1 ELSE samples.attempts END")
    assert compiled(CAPTURES) == "captures.attempts + 1"
    assert ledger.charged(RUNS) == {}
    for kind in (SAMPLES, CAPTURES):
        claim = str(ledger.claim_statement(kind, [], token="t", worker="w", lease=None,
                                           now=None))
        assert "attempts=" in claim.replace(" ", ""), kind.name
    assert "attempts" not in str(ledger.claim_statement(RUNS, [], token="t", worker="w",
                                                        lease=None, now=None))


def test_each_transition_implies_its_columns_from_the_table() -> None:
    """Offer, keep-late, restale, redo, requeue, cancel, refuse: rows of ledger.TRANSITIONS
    whose implied columns ledger.moved writes, not columns each kind spells by hand."""
    import pytest

    from synthq.queue.run_states import RUNS

    t = datetime(2026, 12, 1, tzinfo=UTC)
    assert ledger.moved(SAMPLES, "offer", None, now=t, claim="c") == dict(
        state="queued", updated_at=t, claim="c")
    assert ledger.moved(SAMPLES, "keep_late", None, now=t, claim="c") == dict(
        state="running", updated_at=t, claim="c")
    assert ledger.allowed(SAMPLES, "keep_late") == ("pending", "queued", "running")
    fresh = dict(state="pending", claim=None, expires_at=None, updated_at=t, attempts=0,
                 finished_at=None)
    assert ledger.moved(CAPTURES, "restale", None, now=t) == fresh
    assert ledger.allowed(CAPTURES, "restale") == ("done", "failed")
    assert ledger.moved(SAMPLES, "redo", None, now=t) == fresh
    assert ledger.moved(SAMPLES, "requeue", None, now=t) == fresh
    # A heartbeat lease is not cleared: it is the last beat, not a deadline.
    assert ledger.moved(RUNS, "cancel", None, now=t) == dict(
        state="cancelled", claim=None, updated_at=t, finished_at=t)
    assert ledger.allowed(RUNS, "cancel") == ("pending", "running")
    assert ledger.moved(RUNS, "refuse", None, now=t, error="x") == dict(
        state="failed", claim=None, updated_at=t, finished_at=t, error="x")
    # Samples and captures are cancelled with their job: no such state of their own.
    for kind in (SAMPLES, CAPTURES):
        with pytest.raises(ValueError, match="no cancelled state"):
            ledger.allowed(kind, "cancel")
    with pytest.raises(ValueError, match="needs the claim token"):
        ledger.moved(SAMPLES, "retry", None, now=t)


def test_one_dead_holder_rule_reads_each_kinds_holder() -> None:
    """ledger.gone: a lease passed, or a holder whose heartbeat went silent: a sample's or
    a capture's in its workers row, a training run's in its own row (its lease)."""
    import pytest

    from synthq.queue.run_states import RUNS

    t = datetime(2026, 12, 1, tzinfo=UTC)

    def sql(expr: object) -> str:
        return " ".join(str(expr).split())

    for kind in (SAMPLES, CAPTURES):
        table = kind.model.__tablename__
        assert sql(ledger.gone(kind, now=t)) == f"{table}.expires_at < :expires_at_1"
        judged = sql(ledger.gone(kind, now=t, worker_timeout=15.0))
        assert judged.startswith(f"{table}.expires_at < :expires_at_1 OR {table}.state = ")
        assert f"{table}.worker NOT IN (SELECT workers.name FROM workers WHERE " \
               "workers.heartbeat_at >= :heartbeat_at_1)" in judged
    assert sql(ledger.gone(RUNS, now=t, lease=60.0, worker_timeout=15.0)) == (
        "training_runs.state = :state_1 AND training_runs.heartbeat_at < :heartbeat_at_1")
    with pytest.raises(ValueError, match="needs the lease"):
        ledger.gone(RUNS, now=t)


def test_each_kind_declares_its_lease_and_its_renewal() -> None:
    """A sample's lease is its job's stall timeout (bounded) and the margin, renewed after
    each third; a capture's, its call's timeout, the file's and the margin, never renewed;
    a run's, the service's ``train_lease``, its heartbeat every quarter of it, >= 1 s. The
    executor, the capture stage, the training lifecycle and the sweep read these."""
    from types import SimpleNamespace

    import pytest

    from synthq.queue.run_states import RUNS
    from synthq.spec import jobspec
    from synthq.spec.config import get_settings

    settings = get_settings()
    margin = settings.lease_margin
    job = SimpleNamespace(stall_timeout=50.0, total_timeout=900.0)
    assert SAMPLES.lease_seconds(job) == 50.0 + margin
    job = SimpleNamespace(stall_timeout=1e308, total_timeout=1e308)
    assert SAMPLES.lease_seconds(job) == jobspec.MAX_SECONDS + margin
    assert SAMPLES.lease_seconds(None) == margin + 3600
    assert SAMPLES.renew_every(90.0) == 30.0
    assert CAPTURES.lease_seconds(7.0) == 7.0 + settings.capture_file_timeout + margin
    with pytest.raises(ValueError, match="not renewed"):
        CAPTURES.renew_every(60.0)
    assert RUNS.lease_seconds() == settings.train_lease
    assert (RUNS.renew_every(120.0), RUNS.renew_every(2.0)) == (30.0, 1.0)


def test_the_retry_is_the_kinds_declaration_over_the_jobs_settings() -> None:
    """Samples and captures back off within the job's budget (ledger.retry_or_fail, what
    generation, the worker's hand-back and capture call); runs have no retry: the ledger
    refuses one, their holder hands them back."""
    from types import SimpleNamespace

    import pytest

    from synthq.queue.run_states import RUNS

    job = SimpleNamespace(max_attempts=3, backoff_base=1.0, backoff_cap=10.0)
    slow, busy = errors.TimeoutError_("slow"), errors.RateLimited("busy", retry_after=5.0)
    for kind in (SAMPLES, CAPTURES):
        assert kind.retry == "backoff"
        delay = ledger.retry_or_fail(kind, slow, 2, job)
        assert delay is not None and 0.0 <= delay <= 2.0
        assert ledger.retry_or_fail(kind, slow, 3, job) is None
        low = SimpleNamespace(max_attempts=3, backoff_base=1.0, backoff_cap=2.0)
        assert ledger.retry_or_fail(kind, busy, 9, low, charged=False) == 5.0
        assert ledger.retry_or_fail(kind, busy, 9, low) is None
        assert ledger.retry_or_fail(kind, errors.BadRequest("no"), 1, job) is None
        assert ledger.allowed(kind, "retry") == (kind.held,)
    assert RUNS.retry is None
    with pytest.raises(ValueError, match="no retry"):
        ledger.retry_or_fail(RUNS, slow, 1, job)
    with pytest.raises(ValueError, match="no retry"):
        ledger.allowed(RUNS, "retry")
    assert ledger.allowed(RUNS, "release") == ("running",)


def test_a_holder_known_dead_is_part_of_the_one_dead_holder_rule() -> None:
    """ledger.gone's ``dead``: the holders workers.dead_holder_here found gone (a process of
    this host that no longer exists), whose held rows are taken at once: what a training
    run's claim reads (the lifecycle no longer writes its own rule)."""
    from synthq.queue.run_states import RUNS

    t = datetime(2026, 12, 1, tzinfo=UTC)

    def sql(expr: object) -> str:
        return " ".join(str(expr).split())

    assert sql(ledger.gone(RUNS, now=t, lease=60.0, dead=["host:1"])) == (
        "training_runs.state = :state_1 AND training_runs.heartbeat_at < :heartbeat_at_1 "
        "OR training_runs.state = :state_2 AND training_runs.worker IN "
        "(__[POSTCOMPILE_worker_1])")
    assert sql(ledger.gone(SAMPLES, now=t, dead=["host:1"])) == (
        "samples.expires_at < :expires_at_1 OR samples.state = :state_1 AND samples.worker "
        "IN (__[POSTCOMPILE_worker_1])")
    assert sql(ledger.gone(RUNS, now=t, lease=60.0, dead=[])) == sql(
        ledger.gone(RUNS, now=t, lease=60.0))

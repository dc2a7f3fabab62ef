"""The ledger's contract (issue 42, item 5): one set of scenarios (claim, renew, expire,
retry-or-fail, requeue, cancel) run over every kind of leased work (samples, captures,
training runs) through each kind's own public functions, against real PostgreSQL.

The kinds do not agree everywhere yet. Where one lacks an operation or differs, the
difference is a row of :data:`CONTRACT`, and the scenario asserts that row for that
kind: the table is what each kind does today, the input of the refactor that gives
leased work's policy one place beside :mod:`synthq.queue.ledger`. A row that changes there
changes here, visibly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import func, select, update

from synthq.core.enums import JobState
from synthq.core.errors import BadRequest, TimeoutError_
from synthq.queue import capture_states, jobs, ledger, run_states
from synthq.queue import states as sample_states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, Capture, Sample, TrainingRun

pytestmark = pytest.mark.integration

KINDS = ("sample", "capture", "run")

#: What each kind does, rule by rule: (samples, captures, training runs). None: the kind
#: has no such operation. The scenarios below assert each row for each kind.
CONTRACT: dict[str, tuple[Any, Any, Any]] = {
    # The state a row is offered in before its claim (None: claimed straight from waiting).
    "offered state": ("queued", None, None),
    # The lease column: its end (expires_at), or the holder's last beat (heartbeat_at).
    "lease column": ("expires_at", "expires_at", "heartbeat_at"),
    # What a claim charges to ``attempts``: a call (none when the response is stored,
    # nothing to call), every claim, or nothing (runs have no attempts column).
    "claim charges": ("a call", "every claim", None),
    # A held row whose lease passed is claimable as it is, without a sweep first.
    "claim takes over a stale holder": (False, False, True),
    # The public renewal (None: a capture's lease is fixed at its claim).
    "renew": ("renew", None, "progress"),
    # How a dead holder's row comes back before its lease passes (ledger.gone, by the
    # kind's holder: a workers row, or the row's own heartbeat).
    "dead holder": ("sweep: worker rows without a recent heartbeat",
                    "sweep: worker rows without a recent heartbeat",
                    "claim(dead_worker=...): the claimer names it"),
    # The error an expired row carries back to waiting (column: error_class; runs: error).
    "expired row carries": (None, "lost", "the training worker stopped heart-beating"),
    # The failure class of an expired last attempt (None: no cap, always back to waiting).
    "expired last attempt fails as": ("connection", "lost", None),
    # The sweep logs the holder's cut call as a ``lost`` attempts row.
    "sweep logs the lost call": (True, False, False),
    # The public retry (held → waiting, due later); runs only hand back (``release``).
    "retry": ("retry", "retry", None),
    "uncharged retry (charge=False)": (True, True, None),
    # Where a retry's due time is enforced: the claim itself, or the dispatcher's offer.
    "due time kept by": ("dispatcher (queue.dispatch)", "claim", None),
    # Where retry-or-fail is decided: ledger.retry_delay (through the kind's declared retry,
    # ledger.retry_or_fail), or inline in the caller.
    "retry-or-fail decided by": ("ledger.retry_delay (serving.call._failure, serving.executor)",
                                 "ledger.retry_delay (capture.stage)", None),
    # The holder's hand-back (held → waiting, now, uncharged).
    "release": ("advance_turn (a turn done)", None, "release"),
    # The public requeue (failed → waiting, fresh budget); None: failed is final.
    "requeue": ("requeue", "requeue_failed", None),
    "requeue clears the error": (False, True, None),
    # What cancel acts on: the job (samples, captures) or the row itself (runs).
    "cancel": ("job", "job", "row"),
    # After cancel, a new claim of a waiting/offered row is refused.
    "cancel refuses the claim": (True, True, True),
    # After cancel, the current holder's writes are refused.
    "cancel stops the holder": (False, False, True),
}


def expect(kind: str, rule: str) -> Any:
    return CONTRACT[rule][KINDS.index(kind)]


LEASE = 60.0  # seconds


# -- one adapter per kind: its public functions behind one shape --------------------------


@dataclass
class Row:
    id: int
    job_id: int
    #: The capture's sample (captures only).
    sample_id: int = 0


class Kind:
    """A kind's public functions behind the scenarios' verbs; each verb returns whether its
    compare-and-set won."""

    name: str
    ledger_kind: ledger.Kind
    model: Any
    module: Any
    error_column = "error_class"

    def __init__(self, job_factory: Callable[..., Any]) -> None:
        self.job_factory = job_factory

    def make(self, *, max_attempts: int = 3) -> Row:
        raise NotImplementedError

    def claim(self, row: Row, token: str, *, now: datetime, worker: str = "w1") -> bool:
        raise NotImplementedError

    def renew(self, row: Row, token: str, *, now: datetime) -> bool:
        raise NotImplementedError

    def finish(self, row: Row, token: str, *, now: datetime) -> bool:
        raise NotImplementedError

    def retry(self, row: Row, token: str, *, now: datetime, due: datetime,
              charge: bool = True) -> bool:
        raise NotImplementedError

    def fail(self, row: Row, token: str, *, now: datetime, error_class: str) -> bool:
        raise NotImplementedError

    def sweep(self, *, now: datetime, dead: bool = False) -> None:
        raise NotImplementedError

    def requeue(self, row: Row, *, now: datetime) -> int:
        raise NotImplementedError

    def cancel(self, row: Row, *, now: datetime) -> None:
        with session_scope() as s:
            assert jobs.set_job_state(s, row.job_id, JobState.CANCELLED, now=now)

    def read(self, row: Row) -> Any:
        with session_scope() as s:
            return s.get_one(self.model, row.id)

    def lease_end(self, row: Row) -> datetime:
        """When the row's lease ends (a heartbeat lease: its beat plus the lease)."""
        got = self.read(row)
        value = getattr(got, self.ledger_kind.lease)
        return value if self.ledger_kind.lease_is_deadline else value + timedelta(seconds=LEASE)


class Samples(Kind):
    name, ledger_kind, model, module = "sample", sample_states.SAMPLES, Sample, sample_states

    def make(self, *, max_attempts: int = 3) -> Row:
        job_id = self.job_factory(["hello"], max_attempts=max_attempts).job_id
        with session_scope() as s:
            return Row(s.scalars(select(Sample.id).where(Sample.job_id == job_id)).one(), job_id)

    def claim(self, row: Row, token: str, *, now: datetime, worker: str = "w1") -> bool:
        """The dispatcher's offer (pending → queued), then the worker's claim."""
        offer = f"offer-{token}"
        with session_scope() as s:
            sample_states.queue(s, [row.id], server="http://127.0.0.1:9/v1", token=offer,
                                deadline=now + timedelta(seconds=30), now=now)
        with session_scope() as s:
            return sample_states.claim(s, row.id, offer, new_token=token, worker=worker,
                                       lease_until=now + timedelta(seconds=LEASE),
                                       now=now) is not None

    def renew(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return sample_states.renew(s, row.id, token,
                                       lease_until=now + timedelta(seconds=LEASE))

    def finish(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return sample_states.complete(s, row.id, token, now=now)

    def retry(self, row: Row, token: str, *, now: datetime, due: datetime,
              charge: bool = True) -> bool:
        with session_scope() as s:
            return sample_states.retry(s, row.id, token, next_attempt_at=due,
                                       error_class="timeout", error_message="slow", now=now,
                                       charge=charge)

    def fail(self, row: Row, token: str, *, now: datetime, error_class: str) -> bool:
        with session_scope() as s:
            return sample_states.fail(s, row.id, token, error_class=error_class,
                                      error_message="no", now=now)

    def sweep(self, *, now: datetime, dead: bool = False) -> None:
        with session_scope() as s:
            sample_states.expire(s, now=now, worker_timeout=30.0 if dead else None)

    def requeue(self, row: Row, *, now: datetime) -> int:
        with session_scope() as s:
            return sample_states.requeue(s, row.job_id, now=now)


class Captures(Kind):
    name, ledger_kind, model, module = "capture", capture_states.CAPTURES, Capture, capture_states
    server = "http://127.0.0.1:9/capture"

    def make(self, *, max_attempts: int = 3) -> Row:
        """A done sample (written here as a test's fixture) and its pending capture."""
        job_id = self.job_factory(["hello"], max_attempts=max_attempts).job_id
        now = utcnow()
        with session_scope() as s:
            s.execute(update(Sample).where(Sample.job_id == job_id).values(
                state="done", input_ids=b"\x01\x00\x00\x00", num_tokens=1, tokenize_version=1))
            # (Its count is not checked here: on psycopg an INSERT's rowcount reads -1.)
            capture_states.add_missing(s, job_id, now=now)
        with session_scope() as s:
            cid, sid = s.execute(select(Capture.id, Capture.sample_id)
                                 .where(Capture.job_id == job_id)).one()
        return Row(cid, job_id, sid)

    def claimed(self, row: Row, token: str) -> capture_states.Claimed:
        """The holder's handle (the attempts field is the stage's, not the write's)."""
        return capture_states.Claimed(row.id, row.sample_id, token, 0)

    def claim(self, row: Row, token: str, *, now: datetime, worker: str = "w1") -> bool:
        with session_scope() as s:
            return bool(capture_states.claim(s, row.job_id, server=self.server, limit=8, most=1,
                                             worker=worker, token=token, lease=LEASE, now=now))

    def renew(self, row: Row, token: str, *, now: datetime) -> bool:
        raise AssertionError("captures have no renewal")

    def finish(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return capture_states.done(s, self.claimed(row, token), now=now, path="ab/x",
                                       sha256="0" * 64, nbytes=1, num_tokens=1, layer_ids=[1],
                                       dtype="bf16", engine="fake", engine_model="m")

    def retry(self, row: Row, token: str, *, now: datetime, due: datetime,
              charge: bool = True) -> bool:
        with session_scope() as s:
            return capture_states.retry(s, self.claimed(row, token), now=now,
                                        next_attempt_at=due, error_class="timeout",
                                        error_message="slow", charge=charge)

    def fail(self, row: Row, token: str, *, now: datetime, error_class: str) -> bool:
        with session_scope() as s:
            return capture_states.fail(s, self.claimed(row, token), now=now,
                                       error_class=error_class, error_message="no")

    def sweep(self, *, now: datetime, dead: bool = False) -> None:
        with session_scope() as s:
            capture_states.expire(s, now=now, worker_timeout=30.0 if dead else None)

    def requeue(self, row: Row, *, now: datetime) -> int:
        with session_scope() as s:
            return capture_states.requeue_failed(s, row.job_id, now=now)


class Runs(Kind):
    name, ledger_kind, model, module = "run", run_states.RUNS, TrainingRun, run_states
    error_column = "error"

    def make(self, *, max_attempts: int = 3) -> Row:
        """A pending run (runs have no attempt budget: ``max_attempts`` is the job's)."""
        job_id = self.job_factory([], max_attempts=max_attempts).job_id
        with session_scope() as s:
            run_id = run_states.create(s, job_id=job_id, trigger="manual", target="t",
                                       settings={}, output_dir="/nowhere/{run}", now=utcnow())
        return Row(run_id, job_id)

    def claim(self, row: Row, token: str, *, now: datetime, worker: str = "w1",
              dead_worker: str | None = None) -> bool:
        with session_scope() as s:
            return run_states.claim(s, row.id, token, worker=worker, now=now, lease=LEASE,
                                    dead_worker=dead_worker)

    def renew(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return run_states.progress(s, row.id, token, now=now)

    def finish(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return run_states.finish(s, row.id, token, checkpoint="/nowhere/final", now=now)

    def release(self, row: Row, token: str, *, now: datetime) -> bool:
        with session_scope() as s:
            return run_states.release(s, row.id, token, reason="Ctrl-C", now=now)

    def fail(self, row: Row, token: str, *, now: datetime, error_class: str) -> bool:
        with session_scope() as s:
            return run_states.fail(s, row.id, token, error=error_class, now=now)

    def sweep(self, *, now: datetime, dead: bool = False) -> None:
        with session_scope() as s:
            run_states.sweep_stale(s, now=now, lease=LEASE, resend_after=3600)

    def cancel(self, row: Row, *, now: datetime) -> None:
        with session_scope() as s:
            assert run_states.cancel(s, row.id, now=now)


ADAPTERS: dict[str, type[Kind]] = {"sample": Samples, "capture": Captures, "run": Runs}


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, job_factory: Callable[..., Any]) -> Kind:
    return ADAPTERS[request.param](job_factory)


def _error(k: Kind, row: Row) -> Any:
    return getattr(k.read(row), k.error_column)


# -- the table is true to each kind's declaration -------------------------------------------


def test_the_table_matches_each_kinds_declaration(kind: Kind) -> None:
    lk = kind.ledger_kind
    assert lk.offered == expect(kind.name, "offered state")
    assert lk.lease == expect(kind.name, "lease column")
    # The dead-holder rule reads the kind's holder: its workers row, or its own heartbeat.
    assert lk.holder == ("row" if expect(kind.name, "dead holder").startswith("claim")
                         else "worker")
    # The class of an expired last attempt is the kind's declaration (None: no budget).
    assert lk.expired_class == expect(kind.name, "expired last attempt fails as")
    assert (lk.budget is None) is (lk.expired_class is None)
    # The retry is the kind's declaration (None: no retry transition; the holder hands back).
    assert (lk.retry is None) is (expect(kind.name, "retry") is None)
    # The lease's renewal is the kind's declaration (None: never renewed), as is its length.
    assert (lk.renew_per_lease is None) is (expect(kind.name, "renew") is None)
    assert lk.lease_length is not None
    # The charge at claim is the kind's declaration, which ledger.claim applies.
    assert {"call": "a call", "claim": "every claim", None: None}[lk.charge] == \
        expect(kind.name, "claim charges")
    # Each operation the table says a kind lacks is absent from its module, and present
    # where the table names it: adding one changes the table.
    for rule in ("renew", "retry", "release", "requeue"):
        named = expect(kind.name, rule)
        if named is None:
            assert not hasattr(kind.module, rule), f"{kind.name} has {rule}: update CONTRACT"
        else:
            assert callable(getattr(kind.module, named.split(" ")[0]))


# -- claim ---------------------------------------------------------------------------------


def test_claim_records_the_holder_and_charges_by_the_kinds_rule(kind: Kind) -> None:
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now, worker="host:1")
    got = kind.read(row)
    assert got.state == kind.ledger_kind.held
    assert (got.claim, got.worker, got.started_at) == ("tok1", "host:1", now)
    assert kind.lease_end(row) == now + timedelta(seconds=LEASE)
    charges = expect(kind.name, "claim charges")
    if charges is None:
        assert not hasattr(kind.model, "attempts")
    else:
        assert got.attempts == 1
    # A row that is held (its lease running) is nobody else's.
    assert not kind.claim(row, "tok2", now=now + timedelta(seconds=1), worker="host:2")
    assert kind.read(row).claim == "tok1"


def test_the_charge_rules_differ_on_a_row_with_a_history(kind: Kind) -> None:
    """A sample whose response is stored is claimed to be tokenized again, no call made:
    not charged. A capture is charged at every claim, whatever it holds. A run has no
    budget to charge."""
    charges = expect(kind.name, "claim charges")
    row, now = kind.make(), utcnow()
    if charges is None:
        assert not hasattr(kind.model, "attempts")
        return
    stored = {"response_content": "stored"} if charges == "a call" else {}
    with session_scope() as s:
        s.execute(update(kind.model).where(kind.model.id == row.id).values(attempts=2, **stored))
    assert kind.claim(row, "tok1", now=now)
    assert kind.read(row).attempts == (2 if charges == "a call" else 3)


def test_a_stale_holder_is_taken_over_only_where_the_table_says(kind: Kind) -> None:
    """Past its lease, a held row: runs are claimed as they are (the claim reads the
    heartbeat); samples and captures wait for the sweep."""
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now)
    later = now + timedelta(seconds=LEASE + 5)
    takes_over = expect(kind.name, "claim takes over a stale holder")
    assert kind.claim(row, "tok2", now=later) is takes_over


# -- renew ---------------------------------------------------------------------------------


def test_renew_extends_the_lease_for_the_current_holder_only(kind: Kind) -> None:
    renew = expect(kind.name, "renew")
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now)
    if renew is None:
        # No renewal: the lease set at the claim is the only one.
        assert not hasattr(kind.module, "renew")
        assert kind.lease_end(row) == now + timedelta(seconds=LEASE)
        return
    later = now + timedelta(seconds=20)
    assert kind.renew(row, "tok1", now=later)
    assert kind.lease_end(row) == later + timedelta(seconds=LEASE)
    # A token that is not the holder's is refused, and the lease stays.
    assert not kind.renew(row, "not-mine", now=later + timedelta(seconds=10))
    assert kind.lease_end(row) == later + timedelta(seconds=LEASE)


def test_a_holder_whose_lease_was_taken_over_cannot_write(kind: Kind) -> None:
    """tok1's lease passes, the row is swept (or taken over) and claimed by tok2: every
    write of tok1's is refused, tok2's win."""
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now, worker="host:1")
    later = now + timedelta(seconds=LEASE + 5)
    if not expect(kind.name, "claim takes over a stale holder"):
        kind.sweep(now=later)
    assert kind.claim(row, "tok2", now=later, worker="host:2")
    if expect(kind.name, "renew") is not None:
        assert not kind.renew(row, "tok1", now=later)
    if expect(kind.name, "retry") is not None:
        assert not kind.retry(row, "tok1", now=later, due=later)
    assert not kind.fail(row, "tok1", now=later, error_class="bad_request")
    assert not kind.finish(row, "tok1", now=later)
    got = kind.read(row)
    assert (got.state, got.claim, got.worker) == (kind.ledger_kind.held, "tok2", "host:2")
    assert kind.finish(row, "tok2", now=later)
    got = kind.read(row)
    assert (got.state, got.claim, got.finished_at) == (kind.ledger_kind.done, None, later)


# -- expire --------------------------------------------------------------------------------


def test_an_expired_lease_is_swept_back_to_waiting(kind: Kind) -> None:
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now)
    kind.sweep(now=now + timedelta(seconds=LEASE - 1))  # within the lease: kept
    assert kind.read(row).state == kind.ledger_kind.held
    later = now + timedelta(seconds=LEASE + 1)
    kind.sweep(now=later)
    got = kind.read(row)
    assert (got.state, got.claim) == (kind.ledger_kind.waiting, None)
    if kind.ledger_kind.lease_is_deadline:
        assert getattr(got, kind.ledger_kind.lease) is None
    carries = expect(kind.name, "expired row carries")
    assert (carries is None and _error(kind, row) is None) or \
        str(_error(kind, row)).startswith(carries)
    with session_scope() as s:
        lost = s.scalar(select(func.count()).select_from(Attempt)
                        .where(Attempt.outcome == "lost"))
    assert bool(lost) is expect(kind.name, "sweep logs the lost call")
    # Claimable again, by anyone.
    assert kind.claim(row, "tok2", now=later, worker="host:2")


def test_an_offer_nobody_claimed_is_swept_back(kind: Kind) -> None:
    """Only a kind with an offered state has one (samples: queued past its deadline)."""
    offered = expect(kind.name, "offered state")
    if offered is None:
        assert kind.ledger_kind.inflight == (kind.ledger_kind.held,)
        return
    row, now = kind.make(max_attempts=1), utcnow()
    with session_scope() as s:
        sample_states.queue(s, [row.id], server="http://127.0.0.1:9/v1", token="offer",
                            deadline=now + timedelta(seconds=30), now=now)
    kind.sweep(now=now + timedelta(seconds=31))
    got = kind.read(row)
    # Never failed, even at the cap: no call was made.
    assert (got.state, got.claim, got.expires_at) == (kind.ledger_kind.waiting, None, None)


def test_a_dead_holder_is_taken_back_before_its_lease_passes(kind: Kind) -> None:
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now, worker="host:1")
    soon = now + timedelta(seconds=1)
    kind.sweep(now=soon, dead=True)
    if expect(kind.name, "dead holder").startswith("sweep"):
        assert kind.read(row).state == kind.ledger_kind.waiting
        assert kind.claim(row, "tok2", now=soon)
    else:
        # The sweep reads the heartbeat only; the claimer names the dead holder.
        assert kind.read(row).state == kind.ledger_kind.held
        assert isinstance(kind, Runs)
        assert not kind.claim(row, "tok2", now=soon, dead_worker="host:other")
        assert kind.claim(row, "tok2", now=soon, dead_worker="host:1")
    assert kind.read(row).claim == "tok2"


def test_an_expired_last_attempt_fails_with_its_kinds_class(kind: Kind) -> None:
    row, now = kind.make(max_attempts=2), utcnow()
    cls = expect(kind.name, "expired last attempt fails as")
    for i in range(3 if cls is None else 2):
        t = now + timedelta(seconds=(LEASE + 1) * 2 * i)
        assert kind.claim(row, f"tok{i}", now=t)
        kind.sweep(now=t + timedelta(seconds=LEASE + 1))
    got = kind.read(row)
    if cls is None:  # no cap: a stale run always goes back
        assert got.state == kind.ledger_kind.waiting
    else:
        assert (got.state, got.error_class, got.attempts) == (kind.ledger_kind.failed, cls, 2)
        assert got.finished_at is not None and got.claim is None


# -- retry-or-fail --------------------------------------------------------------------------

#: The settings a retry reads (a job's, or a sample's view of it).
_JOB = SimpleNamespace(max_attempts=2, backoff_base=0.1, backoff_cap=0.5)


def test_retry_waits_in_sql_and_an_uncharged_retry_gives_the_call_back(kind: Kind) -> None:
    if expect(kind.name, "retry") is None:
        assert expect(kind.name, "uncharged retry (charge=False)") is None
        assert not hasattr(kind.module, "retry")
        return
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now)
    due = now + timedelta(seconds=30)
    assert kind.retry(row, "tok1", now=now, due=due)
    got = kind.read(row)
    assert (got.state, got.claim, got.next_attempt_at, got.error_class, got.attempts) == \
        (kind.ledger_kind.waiting, None, due, "timeout", 1)
    if expect(kind.name, "due time kept by") == "claim":
        assert not kind.claim(row, "early", now=now + timedelta(seconds=1))
    assert kind.claim(row, "tok2", now=due)
    assert kind.read(row).attempts == 2
    assert kind.retry(row, "tok2", now=due, due=due, charge=False)
    assert kind.read(row).attempts == 1


def test_retry_or_fail_by_the_attempt_budget(kind: Kind) -> None:
    """A retryable failure goes back until the attempts reach the cap, then fails; a
    permanent one fails at once. Runs have no retry: their holder hands back (release),
    and a failed run is final."""
    decided_by = expect(kind.name, "retry-or-fail decided by")
    row, now = kind.make(max_attempts=2), utcnow()
    if decided_by is None:
        assert isinstance(kind, Runs)
        assert kind.claim(row, "tok1", now=now)
        assert not kind.release(row, "other", now=now)
        assert kind.release(row, "tok1", now=now)
        assert (kind.read(row).state, kind.read(row).error) == (kind.ledger_kind.waiting,
                                                                "Ctrl-C")
        assert kind.claim(row, "tok2", now=now)
        assert kind.fail(row, "tok2", now=now, error_class="boom")
        assert kind.read(row).state == kind.ledger_kind.failed
        assert not kind.claim(row, "tok3", now=now + timedelta(days=1))
        # The ledger refuses a retry the kind does not declare.
        for refused in (lambda: ledger.allowed(kind.ledger_kind, "retry"),
                        lambda: ledger.retry_or_fail(kind.ledger_kind, TimeoutError_("slow"),
                                                     1, _JOB)):
            with pytest.raises(ValueError, match="no retry"):
                refused()
        return

    def decide(attempts: int, exc: Any) -> float | None:
        assert decided_by.startswith("ledger.retry_delay")
        return ledger.retry_or_fail(kind.ledger_kind, exc, attempts, _JOB)

    t = now
    for attempt in (1, 2):
        assert kind.claim(row, f"tok{attempt}", now=t)
        assert kind.read(row).attempts == attempt
        delay = decide(attempt, TimeoutError_("slow"))
        if delay is None:
            assert attempt == 2
            assert kind.fail(row, f"tok{attempt}", now=t, error_class="timeout")
        else:
            assert attempt == 1 and 0 <= delay <= 0.5
            t = t + timedelta(seconds=1)
            assert kind.retry(row, f"tok{attempt}", now=t, due=t)
    got = kind.read(row)
    assert (got.state, got.error_class, got.claim) == (kind.ledger_kind.failed, "timeout", None)
    # A permanent error fails on the first attempt.
    other = kind.make(max_attempts=5)
    assert kind.claim(other, "p1", now=now)
    assert decide(1, BadRequest("no")) is None
    assert kind.fail(other, "p1", now=now, error_class="bad_request")
    assert kind.read(other).state == kind.ledger_kind.failed


# -- requeue --------------------------------------------------------------------------------


def test_requeue_gives_a_failed_row_a_fresh_budget(kind: Kind) -> None:
    row, now = kind.make(), utcnow()
    assert kind.claim(row, "tok1", now=now)
    assert kind.fail(row, "tok1", now=now, error_class="bad_request")
    if expect(kind.name, "requeue") is None:
        assert not any(hasattr(kind.module, n) for n in ("requeue", "requeue_failed"))
        assert not kind.claim(row, "tok2", now=now + timedelta(days=1))  # final
        return
    later = now + timedelta(seconds=5)
    assert kind.requeue(row, now=later) == 1
    got = kind.read(row)
    assert (got.state, got.attempts, got.claim, got.finished_at) == \
        (kind.ledger_kind.waiting, 0, None, None)
    cleared = expect(kind.name, "requeue clears the error")
    assert (got.error_class is None) is cleared
    assert kind.requeue(row, now=later) == 0  # only failed rows move
    assert kind.claim(row, "tok2", now=later)
    assert kind.read(row).attempts == 1


# -- cancel ---------------------------------------------------------------------------------


def test_cancel(kind: Kind) -> None:
    """Runs are cancelled one by one, and their holder stops; samples and captures are
    cancelled with their job, and a held one's holder still writes its answer."""
    now = utcnow()
    held, waiting = kind.make(), kind.make()
    assert kind.claim(held, "tok1", now=now)
    kind.cancel(held, now=now)
    kind.cancel(waiting, now=now)  # (each row here has a job of its own)
    later = now + timedelta(seconds=1)
    assert kind.claim(waiting, "tok2", now=later) is not expect(kind.name,
                                                               "cancel refuses the claim")
    stops = expect(kind.name, "cancel stops the holder")
    if expect(kind.name, "renew") is not None:
        assert kind.renew(held, "tok1", now=later) is not stops
    assert kind.finish(held, "tok1", now=later) is not stops
    if stops:
        assert str(kind.read(held).state) == "cancelled"
    if isinstance(kind, Samples):  # the offer refused by the claim went back to waiting
        assert kind.read(waiting).state == kind.ledger_kind.waiting

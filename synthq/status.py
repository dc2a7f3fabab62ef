"""What a job is doing: counts per state, rate, ETA, failures, load per server."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from synthq.db import utcnow
from synthq.models import CallCount, Job, Sample, SampleCount
from synthq.states import INFLIGHT, SampleState

__all__ = ["JobStatus", "job_status", "state_counts", "sample_counts", "call_counts", "counted",
           "Counted"]

#: Window for the done/s rate.
RATE_WINDOW = timedelta(minutes=5)


@dataclass
class JobStatus:
    id: int
    name: str
    state: str
    model: str
    total: int
    counts: dict[str, int]
    #: Samples finished as done per second over the last RATE_WINDOW.
    done_per_s: float
    #: Seconds until every open sample is done at that rate; None if unknown.
    eta_s: float | None
    failures: dict[str, int]
    #: Retryable errors still waiting to be retried, by class.
    retrying: dict[str, int]
    inflight: dict[str, int]
    servers: list[str] = field(default_factory=list)
    #: Calls made to servers, by outcome (``ok`` or a failure class).
    calls: dict[str, int] = field(default_factory=dict)
    #: Tokenization: the job's tokenizer and version, examples still at an older
    #: version (retokenize running), token totals, and samples whose tokens
    #: differ from the ones the server reported (return_token_ids).
    #: Servers failing their health probe, with the error.
    unhealthy: dict[str, str | None] = field(default_factory=dict)
    #: Live generation workers (every job's): name, capacity, calls in flight.
    workers: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: str | None = None
    tokenize_version: int = 1
    stale_examples: int = 0
    num_tokens: int = 0
    num_supervised: int = 0
    token_mismatches: int = 0
    #: Each server's in-flight limit: ``{"limit", "auto", "reason", "floor", "cap",
    #: "history": [[unix time, limit, tok/s, done/s], ...]}`` (synthq.adaptive).
    limits: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The cost report (synthq.cost.JobCost as a dict).
    cost: dict[str, Any] = field(default_factory=dict)
    #: Jobs with regenerate=all: turns answered and turns to answer (a cut
    #: conversation counts only the turns it kept), and conversations cut short.
    regenerate: str = "last"
    turns_done: int = 0
    turns_total: int = 0
    cut: int = 0
    #: Why synthq paused the job itself (None: not paused, or paused by a user).
    pause_reason: str | None = None

    @property
    def open(self) -> int:
        """Samples not yet in a final state."""
        c = self.counts
        return sum(c.get(s, 0) for s in (SampleState.PENDING, SampleState.QUEUED,
                                          SampleState.RUNNING))

    @property
    def finished(self) -> bool:
        return self.open == 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["open"] = self.open
        data["finished"] = self.finished
        return data


def server_limits(session: Session, job: Job, *, history: bool = True
                  ) -> dict[str, dict[str, Any]]:
    """Each of the job's servers' limit now, and (auto) the reason of its last change."""
    if not job.inflight_auto:
        return {url: {"limit": job.inflight_limit, "auto": False, "reason": "fixed (--inflight)",
                      "floor": None, "cap": job.inflight_limit, "history": []}
                for url in job.servers}
    from synthq.adaptive import current_limits, start_limit

    rows = current_limits(session, list(job.servers))
    result: dict[str, dict[str, Any]] = {}
    for url in job.servers:
        row = rows.get(url)
        limit = row.limit_target if row is not None and row.limit_target is not None else \
            start_limit(job.min_inflight, job.inflight_limit)
        result[url] = {"limit": min(limit, job.inflight_limit), "auto": True,
                       "bound": row.limit if row is not None else None,
                       "reason": row.limit_reason if row is not None else "not started yet",
                       "floor": job.min_inflight, "cap": job.inflight_limit,
                       "history": list(row.limit_history or []) if row is not None and history
                       else []}
    return result


def _by_key(rows: Any) -> dict[str, int]:
    return {str(key) if key is not None else "unknown": n for key, n in rows}


@dataclass(frozen=True)
class Counted:
    """One key of the job's counters: samples in ``state`` with ``error_class`` at
    ``tokenize_version``, and the sums over them."""

    state: str
    error_class: str | None
    tokenize_version: int | None
    #: The response is stored.
    answered: bool
    n: int
    tokens: int
    supervised: int
    mismatches: int


def counted(session: Session, job_id: int) -> list[Counted]:
    """The job's counters (kept by the triggers of migration 0016): a few rows, however
    many samples; the delta rows of a key not yet folded are summed here."""
    key = (SampleCount.state, SampleCount.error_class, SampleCount.tokenize_version,
           SampleCount.answered)
    rows = session.execute(
        select(*key, func.sum(SampleCount.n), func.sum(SampleCount.tokens),
               func.sum(SampleCount.supervised), func.sum(SampleCount.mismatches))
        .where(SampleCount.job_id == job_id).group_by(*key))
    return [Counted(str(r[0]), r[1], r[2], bool(r[3]), *(int(x or 0) for x in r[4:]))
            for r in rows]


def sample_counts(session: Session, job_id: int,
                  rows: list[Counted] | None = None) -> dict[tuple[str, str | None], int]:
    """The job's samples per (state, error class)."""
    counts: dict[tuple[str, str | None], int] = {}
    for c in rows if rows is not None else counted(session, job_id):
        if c.n:
            counts[(c.state, c.error_class)] = counts.get((c.state, c.error_class), 0) + c.n
    return counts


def state_counts(session: Session, job_id: int,
                 by_class: dict[tuple[str, str | None], int] | None = None) -> dict[str, int]:
    """The job's samples per state (every state, 0 included)."""
    counts = {s.value: 0 for s in SampleState}
    for (state, _), n in (by_class if by_class is not None
                          else sample_counts(session, job_id)).items():
        counts[state] = counts.get(state, 0) + n
    return counts


def call_counts(session: Session, job_id: int) -> dict[str, int]:
    """The job's calls per outcome (``ok`` or a failure class), from the counters."""
    rows = session.execute(
        select(CallCount.outcome, func.sum(CallCount.n))
        .where(CallCount.job_id == job_id, CallCount.outcome.is_not(None))
        .group_by(CallCount.outcome))
    return {str(outcome): int(n) for outcome, n in rows if n}


def job_status(session: Session, job: Job, *, cost: bool = True) -> JobStatus:
    """The job's status; ``cost=False`` leaves out the cost report and limit history (the
    embedded loop's frequent ticks)."""
    now = utcnow()
    rows = counted(session, job.id)
    by_class = sample_counts(session, job.id, rows)
    counts = state_counts(session, job.id, by_class)
    recent = session.scalar(
        select(func.count()).select_from(Sample).where(
            Sample.job_id == job.id, Sample.state == SampleState.DONE,
            Sample.finished_at >= now - RATE_WINDOW)
    ) or 0
    # Rate over the window, or since the first sample in it finished; once
    # nothing is open, up to the last one (so a finished job keeps its rate).
    first, last = session.execute(
        select(func.min(Sample.finished_at), func.max(Sample.finished_at)).where(
            Sample.job_id == job.id, Sample.state == SampleState.DONE,
            Sample.finished_at >= now - RATE_WINDOW)
    ).one()
    is_open = any(counts[s] for s in (SampleState.PENDING, *INFLIGHT))
    end = now if is_open or last is None else last
    span = (end - first).total_seconds() if first is not None else 0.0
    rate = recent / max(span, 1.0) if recent else 0.0
    status = JobStatus(
        id=job.id, name=job.name, state=str(job.state), model=job.model,
        pause_reason=job.pause_reason,
        total=sum(counts.values()), counts=counts, done_per_s=rate, eta_s=None,
        failures=_by_key((c, n) for (state, c), n in by_class.items()
                         if state == SampleState.FAILED),
        retrying=_by_key((c, n) for (state, c), n in by_class.items()
                         if state == SampleState.PENDING and c is not None),
        inflight=_by_key(session.execute(
            select(Sample.server, func.count())
            .where(Sample.job_id == job.id, Sample.state.in_(INFLIGHT))
            .group_by(Sample.server)).tuples().all()),
        servers=list(job.servers),
        calls=call_counts(session, job.id),
    )
    if rate > 0:
        status.eta_s = status.open / rate
    status.regenerate = job.regenerate or "last"
    if status.regenerate == "all":
        from sqlalchemy import case

        kept = case((Sample.cut_at_turn.is_not(None), Sample.turn), else_=Sample.turn_count)
        done_turns, total_turns, cut = session.execute(
            select(func.coalesce(func.sum(Sample.turn), 0), func.coalesce(func.sum(kept), 0),
                   func.count(Sample.cut_at_turn))
            .where(Sample.job_id == job.id, Sample.turn_count.is_not(None))).one()
        status.turns_done, status.turns_total = int(done_turns), int(total_turns)
        status.cut = int(cut)
    from synthq.health import unhealthy

    status.unhealthy = unhealthy(session, job.servers)
    from synthq.config import get_settings
    from synthq.workers import live

    status.workers = [
        {"name": w.name, "capacity": w.capacity, "inflight": w.inflight,
         "heartbeat_age_s": round((now - w.heartbeat_at).total_seconds(), 1)}
        for w in live(session, now=now, timeout=get_settings().worker_timeout)]
    status.limits = server_limits(session, job, history=cost)
    if cost:
        from synthq.cost import job_cost

        status.cost = job_cost(session, job, remaining=status.open, now=now).to_dict()
    if job.tokenizer:
        from synthq.retokenize import eligible

        status.tokenizer, status.tokenize_version = job.tokenizer, job.tokenize_version
        # From the counters: what stale_query counts, and the done samples' token sums.
        status.stale_examples = sum(
            c.n for c in rows if c.answered and eligible(c.state, c.error_class)
            and (c.tokenize_version is None or c.tokenize_version < job.tokenize_version))
        done = [c for c in rows if c.state == SampleState.DONE]
        status.num_tokens = sum(c.tokens for c in done)
        status.num_supervised = sum(c.supervised for c in done)
        status.token_mismatches = sum(c.mismatches for c in done)
    return status

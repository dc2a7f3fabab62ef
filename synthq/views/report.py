"""What a job is doing: counts per state, rate, ETA, failures, load per server.

This module only reads, but for the cost report's fold of a job's busy time
(:mod:`synthq.store.cost` writes it back to the job's row while a status runs); every state
change is :mod:`synthq.queue.states`' (the ledger's, :mod:`synthq.queue.ledger`).

Every figure is defined once, here (and in :mod:`synthq.store.cost` for the cost
report): a few reads in plain SQL (:mod:`synthq.store.sqlread`), and Python that
computes the figures from their rows. The CLI, the API and the job page pass
a SQLAlchemy session (PostgreSQL or SQLite); the CLI's fast path
(:mod:`synthq.cli.fast`) passes a ``sqlite3`` connection, so this module and
what it imports must not load SQLAlchemy, pydantic or the models (a test
checks it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from synthq.capture.progress import CaptureProgress, capture_progress
from synthq.core.clock import SKEW_WARNING_S, utcnow
from synthq.core.defaults import StatusSettings, store_root
from synthq.core.enums import INFLIGHT, SampleState
from synthq.core.errors import retokenizable
from synthq.core.secrets import safe_keys, safe_url
from synthq.queue.limits import current_limits, start_limit
from synthq.queue.workers import holder_gone_here, live
from synthq.serving.health import unhealthy
from synthq.store.cost import CostJob, job_cost
from synthq.store.counts import call_counts, counted, sample_counts, state_counts
from synthq.store.sqlread import Reader, read_json, read_optional_time, read_time, reader_of

if TYPE_CHECKING:
    from collections.abc import Iterable

    from sqlalchemy.orm import Session

__all__ = ["JobStatus", "job_status", "StatusJob", "JobRow", "find_job_row", "server_limits"]

#: Window for the done/s rate.
RATE_WINDOW = timedelta(minutes=5)

_INFLIGHT_SQL = "(" + ", ".join(f"'{s.value}'" for s in INFLIGHT) + ")"


class StatusJob(CostJob, Protocol):
    """What a status reads of a job: a :class:`synthq.store.models.Job`, or a :class:`JobRow`."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def pause_reason(self) -> str | None: ...
    @property
    def inflight_auto(self) -> bool: ...
    @property
    def inflight_limit(self) -> int: ...
    @property
    def min_inflight(self) -> int: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def tokenize_version(self) -> int: ...


class JobRow(NamedTuple):
    """The columns of ``jobs`` a status reads, for a caller without the ORM (the CLI's fast
    path): the same attributes as :class:`synthq.store.models.Job`. (The rows here are
    NamedTuples, not dataclasses: a tenth of the cost to define, at every CLI start.)"""

    id: int
    name: str
    state: str
    model: str
    pause_reason: str | None
    servers: list[str]
    regenerate: str
    inflight_auto: bool
    inflight_limit: int
    min_inflight: int
    gpus: int
    gpu_hour_price: float | None
    busy_until: datetime | None
    busy_folded: dict[str, Any] | None
    tokenizer: str | None
    tokenize_version: int

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> JobRow:
        """From a row of ``SELECT {_JOB_COLUMNS} FROM jobs``."""
        (id_, name, state, model, pause_reason, servers, regenerate, auto, limit, floor, gpus,
         price, busy_until, busy_folded, tokenizer, version) = row
        return cls(id=id_, name=name, state=state, model=model, pause_reason=pause_reason,
                   servers=list(read_json(servers)), regenerate=regenerate,
                   inflight_auto=bool(auto), inflight_limit=limit, min_inflight=floor,
                   gpus=gpus, gpu_hour_price=price, busy_until=read_optional_time(busy_until),
                   busy_folded=read_json(busy_folded), tokenizer=tokenizer,
                   tokenize_version=version)


#: JobRow's columns, in its fields' order.
_JOB_COLUMNS = ", ".join(JobRow._fields)


def find_job_row(db: Session | Reader, ref: str) -> JobRow | None:
    """The job ``ref`` names, looked up as :func:`synthq.jobs.enqueue.find_job` does (an id,
    else a name); None when there is none (that function's error lists the jobs)."""
    reader = reader_of(db)
    found = []
    if ref.isdigit():
        found = reader.rows(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = :id",
                            {"id": int(ref)})
    if not found:
        found = reader.rows(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE name = :name",
                            {"name": ref})
    return JobRow.of(found[0]) if found else None


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
    #: Servers failing their health probe, with the error.
    unhealthy: dict[str, str | None] = field(default_factory=dict)
    #: Live generation workers (every job's): name, capacity, calls in flight.
    workers: list[dict[str, Any]] = field(default_factory=list)
    #: Tokenization: the job's tokenizer and version, examples still at an older
    #: version (retokenize running), token totals, and samples whose tokens
    #: differ from the ones the server reported (return_token_ids).
    tokenizer: str | None = None
    tokenize_version: int = 1
    stale_examples: int = 0
    num_tokens: int = 0
    num_supervised: int = 0
    token_mismatches: int = 0
    #: Each server's in-flight limit: ``{"limit", "auto", "reason", "floor", "cap",
    #: "history": [[unix time, limit, tok/s, done/s], ...]}`` (synthq.serving.adaptive).
    limits: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The cost report (synthq.store.cost.JobCost as a dict).
    cost: dict[str, Any] = field(default_factory=dict)
    #: Jobs with regenerate=all: turns answered and turns to answer (a cut
    #: conversation counts only the turns it kept), and conversations cut short.
    regenerate: str = "last"
    turns_done: int = 0
    turns_total: int = 0
    cut: int = 0
    #: Why synthq paused the job itself (None: not paused, or paused by a user).
    pause_reason: str | None = None
    #: Samples not yet in a final state (pending, queued, running); and whether none is.
    open: int = 0
    finished: bool = True
    #: Things an operator should fix that stop nothing (a worker's clock is off).
    warnings: list[str] = field(default_factory=list)
    #: The hidden-state capture stage (None: the job captures nothing).
    capture: CaptureProgress | None = None
    #: Each unfinished streamed training run's spool (``--features stream``): ``{"run",
    #: "state", "size", "bytes", "files", "high_water", "lead"}`` (bytes; lead: examples
    #: captured ahead of the trainer).
    spool: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.counts
        self.open = sum(c.get(s, 0) for s in (SampleState.PENDING, SampleState.QUEUED,
                                               SampleState.RUNNING))
        self.finished = self.open == 0

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data: what `synthq status --json` prints and what
        ``GET /api/jobs/{job}`` answers (its response model is this class)."""
        return asdict(self)


def server_limits(db: Session | Reader, job: StatusJob, *, history: bool = True
                  ) -> dict[str, dict[str, Any]]:
    """Each of the job's servers' limit now, and (auto) the reason of its last change."""
    if not job.inflight_auto:
        return {url: {"limit": job.inflight_limit, "auto": False, "reason": "fixed (--inflight)",
                      "floor": None, "cap": job.inflight_limit, "history": []}
                for url in job.servers}
    rows = current_limits(db, list(job.servers), history=history)
    result: dict[str, dict[str, Any]] = {}
    for url in job.servers:
        row = rows.get(url)
        limit = row.limit_target if row is not None else \
            start_limit(job.min_inflight, job.inflight_limit)
        result[url] = {"limit": min(limit, job.inflight_limit), "auto": True,
                       "bound": row.limit if row is not None else None,
                       "reason": row.limit_reason if row is not None else "not started yet",
                       "floor": job.min_inflight, "cap": job.inflight_limit,
                       "history": list(row.limit_history) if row is not None else []}
    return result


def _by_key(rows: Iterable[tuple[Any, Any]]) -> dict[str, int]:
    return {str(key) if key is not None else "unknown": int(n) for key, n in rows}


def job_status(db: Session | Reader, job: StatusJob, *, cost: bool = True,
               now: datetime | None = None, settings: StatusSettings | None = None
               ) -> JobStatus:
    """The job's status; ``cost=False`` leaves out the cost report and limit history (the
    embedded loop's frequent ticks). ``now`` and ``settings`` (None: the clock, and the
    environment's settings) let the CLI's fast path and tests pass their own."""
    reader = reader_of(db)
    now = now or utcnow()
    if settings is None:
        from synthq.spec.config import status_settings  # pydantic-settings: only when not given

        settings = status_settings()
    rows = counted(reader, job.id)
    by_class = sample_counts(reader, job.id, rows)
    counts = state_counts(reader, job.id, by_class)
    [(recent, first_at, last_at)] = reader.rows(
        "SELECT count(*), min(finished_at), max(finished_at) FROM samples "
        "WHERE job_id = :job_id AND state = 'done' AND finished_at >= :since",
        {"job_id": job.id, "since": now - RATE_WINDOW})
    first, last = read_optional_time(first_at), read_optional_time(last_at)
    # Rate over the window, or since the first sample in it finished; once
    # nothing is open, up to the last one (so a finished job keeps its rate).
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
        inflight=_by_key(reader.rows(
            "SELECT server, count(*) FROM samples "
            f"WHERE job_id = :job_id AND state IN {_INFLIGHT_SQL} GROUP BY server",
            {"job_id": job.id})),
        servers=list(job.servers),
        calls=call_counts(reader, job.id),
    )
    if rate > 0:
        status.eta_s = status.open / rate
    status.regenerate = job.regenerate or "last"
    if status.regenerate == "all":
        # A cut conversation counts only the turns it kept.
        [(done_turns, total_turns, cut)] = reader.rows(
            "SELECT coalesce(sum(turn), 0), coalesce(sum(CASE WHEN cut_at_turn IS NOT NULL "
            "THEN turn ELSE turn_count END), 0), count(cut_at_turn) FROM samples "
            "WHERE job_id = :job_id AND turn_count IS NOT NULL", {"job_id": job.id})
        status.turns_done, status.turns_total = int(done_turns), int(total_turns)
        status.cut = int(cut)
    status.unhealthy = unhealthy(reader, job.servers)
    status.workers = [
        {"name": w.name, "capacity": w.capacity, "inflight": w.inflight,
         "heartbeat_at": w.heartbeat_at.isoformat(), "started_at": w.started_at.isoformat(),
         "heartbeat_age_s": round((now - w.heartbeat_at).total_seconds(), 1),
         "clock_skew_s": None if w.clock_skew is None else round(w.clock_skew, 1)}
        for w in live(reader, now=now, timeout=settings.worker_timeout)]
    status.warnings += [
        f"worker {w['name']}: its clock is {abs(w['clock_skew_s']):.0f} s "
        f"{'ahead of' if w['clock_skew_s'] > 0 else 'behind'} the database's (synthq uses "
        "the database's time; fix the machine's clock: its logs are off)"
        for w in status.workers
        if w["clock_skew_s"] is not None and abs(w["clock_skew_s"]) >= SKEW_WARNING_S]
    status.warnings += orphaned_runs(reader, job.id, now=now, lease=settings.train_lease)
    status.spool = spools(reader, job.id)
    status.limits = server_limits(reader, job, history=cost)
    if cost:
        status.cost = job_cost(reader, job, remaining=status.open, now=now,
                               settings=settings).to_dict()
    if job.tokenizer:
        status.tokenizer, status.tokenize_version = job.tokenizer, job.tokenize_version
        # From the counters: what stale_query counts, and the done samples' token sums.
        status.stale_examples = sum(
            c.n for c in rows if c.answered and retokenizable(c.state, c.error_class)
            and (c.tokenize_version is None or c.tokenize_version < job.tokenize_version))
        done = [c for c in rows if c.state == SampleState.DONE]
        status.num_tokens = sum(c.tokens for c in done)
        status.num_supervised = sum(c.supervised for c in done)
        status.token_mismatches = sum(c.mismatches for c in done)
    status.capture = capture_progress(  # its URLs masked there
        reader, job.id, store=store_root(settings.capture_store))
    return _masked(status)


def spools(db: Session | Reader, job_id: int) -> list[dict[str, Any]]:
    """The spool of each of the job's unfinished streamed runs (``--features stream``)."""
    rows = reader_of(db).rows(
        "SELECT id, state, spool_size, spool_bytes, spool_files, spool_high_water, spool_lead "
        "FROM training_runs WHERE job_id = :job_id AND spool_size IS NOT NULL AND state IN "
        "('pending', 'running') ORDER BY id", {"job_id": job_id})
    return [{"run": r[0], "state": str(r[1]), "size": r[2], "bytes": r[3] or 0,
             "files": r[4] or 0, "high_water": r[5] or 0, "lead": r[6] or 0} for r in rows]


def orphaned_runs(db: Session | Reader, job_id: int, *, now: datetime,
                  lease: float) -> list[str]:
    """A line for each of the job's running training runs whose holder looks dead: its
    heartbeat older than ``lease`` seconds, or a process of this host that is gone.

    Such a run is sent again by the next readiness check (a training worker's own, or
    beat's tick); until then ``running`` alone would say it is being trained (issue 41:
    a run waited 88 s under a dead holder, and nothing said so)."""
    rows = reader_of(db).rows(
        "SELECT id, worker, heartbeat_at FROM training_runs "
        "WHERE job_id = :job_id AND state = 'running' ORDER BY id", {"job_id": job_id})
    lines = []
    for run_id, worker, beat in rows:
        age = (now - read_time(beat)).total_seconds() if beat is not None else float("inf")
        gone = holder_gone_here(worker)
        if age < lease and not gone:
            continue
        why = ("its process is gone" if gone else "no heartbeat yet" if beat is None
               else f"no heartbeat for {age:.0f} s")
        lines.append(f"training run {run_id}: its training worker {worker} looks dead ({why}); "
                     "the run is sent again to a training worker (`synthq worker --queues "
                     "train`), which resumes it from its last checkpoint")
    return lines


def _masked(status: JobStatus) -> JobStatus:
    """``status`` with every server URL's password masked: a status is only ever shown
    (CLI, ``--json``, the API, the job page), and a URL may carry a password."""
    status.servers = [safe_url(u) for u in status.servers]
    status.inflight = safe_keys(status.inflight)
    status.unhealthy = {safe_url(k): v and safe_url(v) for k, v in status.unhealthy.items()}
    status.limits = safe_keys(status.limits)
    status.pause_reason = status.pause_reason and safe_url(status.pause_reason)
    if status.cost:
        status.cost["servers"] = safe_keys(status.cost.get("servers") or {})
    return status

"""What a job cost on self-hosted GPUs: busy server time, tokens, dollars.

* **Busy time** of a job on a server: the wall time with at least one call of
  the job in flight on it (the union of its calls' intervals, from
  ``attempts`` plus the samples running now), times the GPUs behind the
  server (``--gpus``): GPU-seconds.
* **Tokens**: completion tokens of the job's successful calls; tokens/s over
  the busy time.
* With a price (``--gpu-hour-price``, or ``SYNTHQ_GPU_HOUR_PRICE``): dollars
  so far = GPU-hours × price; dollars per 1M generated tokens = $/h ÷ (tok/s ×
  3600) × 10⁶; projected remaining time = remaining samples × mean tokens per
  call (remaining turns with
  ``--regenerate all``) ÷ current tokens/s (the last minute), and its cost at the job's GPUs.

Busy time at 10⁶ calls: a status folds the calls that ended more than
``FOLD_LAG`` ago into ``jobs.busy_folded`` (at most once a minute, see
:func:`fold_busy`) and reads only the calls that ended since. Tokens and
successful calls come from the per-job counters (``call_counts``).

Where it misleads: a server shared with other jobs (or other users) is billed
to each job for the whole time the job had a call on it, so shared time is
counted once per job; an idle server between calls is not counted at all.

The reads are plain SQL (:mod:`synthq.store.sqlread`), so that the CLI's fast path
computes this same report with ``sqlite3``; this module imports no SQLAlchemy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from synthq.core.clock import utcnow
from synthq.core.defaults import StatusSettings
from synthq.core.enums import INFLIGHT, SampleState
from synthq.store.sqlread import Reader, read_time, reader_of

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["ServerCost", "JobCost", "CostJob", "job_cost", "busy_intervals", "fold_busy",
           "measure", "merge", "price_of", "remaining_calls"]

#: Samples not yet in a final state.
OPEN = (SampleState.PENDING, *INFLIGHT)
#: Window of the "current" token rate the projection uses.
CURRENT_WINDOW = timedelta(seconds=60)
#: The fold stays this far behind now: a call that ended just before is still being
#: written (the writer commits within ~50 ms).
FOLD_LAG = timedelta(seconds=10)
#: A status folds again once the fold is this much older than FOLD_LAG.
FOLD_EVERY = timedelta(seconds=60)

_OPEN_SQL = "(" + ", ".join(f"'{s.value}'" for s in OPEN) + ")"


class CostJob(Protocol):
    """What the cost report reads of a job: a :class:`synthq.store.models.Job`, or the CLI's
    fast path's :class:`synthq.views.report.JobRow`."""

    @property
    def id(self) -> int: ...
    @property
    def servers(self) -> list[str]: ...
    @property
    def regenerate(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def gpu_hour_price(self) -> float | None: ...
    @property
    def busy_until(self) -> datetime | None: ...
    @property
    def busy_folded(self) -> dict[str, Any] | None: ...


@dataclass
class ServerCost:
    busy_s: float = 0.0
    gpu_hours: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    dollars: float | None = None
    dollars_per_mtok: float | None = None


@dataclass
class JobCost:
    gpus: int
    gpu_hour_price: float | None
    busy_s: float = 0.0
    gpu_hours: float = 0.0
    tokens: int = 0
    #: Generated tokens per busy second (per server, summed over servers busy at once
    #: it is the job's rate while it runs).
    tokens_per_s: float = 0.0
    #: Tokens per second over the last minute (the projection's rate).
    current_tokens_per_s: float = 0.0
    #: Completion tokens per successful call (per sample, or per turn with --regenerate all).
    mean_tokens_per_sample: float | None = None
    #: Calls the projection counts: open samples, or their turns left (--regenerate all).
    remaining_calls: int | None = None
    dollars: float | None = None
    dollars_per_mtok: float | None = None
    remaining_s: float | None = None
    remaining_dollars: float | None = None
    servers: dict[str, ServerCost] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def merge(intervals: list[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    """The union of intervals, as disjoint ones in order."""
    out: list[tuple[datetime, datetime]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def measure(intervals: list[tuple[datetime, datetime]], start: datetime | None = None,
            end: datetime | None = None) -> float:
    """Seconds covered by disjoint ``intervals`` within [start, end] (None: unbounded)."""
    total = 0.0
    for s, e in intervals:
        s = s if start is None else max(s, start)
        e = e if end is None else min(e, end)
        if e > s:
            total += (e - s).total_seconds()
    return total


# The job's calls that ended ({filters}: after a time, started before one), merged per
# server: a running maximum of end times over the calls ordered by start (a call that
# starts after every earlier call ended opens a new interval, g), one row per interval.
_BUSY_SQL = """
SELECT server, min(s), max(e) FROM (
    SELECT server, s, e,
           sum(CASE WHEN p IS NULL OR s > p THEN 1 ELSE 0 END) OVER (
               PARTITION BY server ORDER BY s, e
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS g
    FROM (
        SELECT server, s, e,
               max(e) OVER (PARTITION BY server ORDER BY s, e
                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS p
        FROM (
            SELECT attempts.server AS server, attempts.started_at AS s,
                   attempts.ended_at AS e
            FROM attempts JOIN samples ON samples.id = attempts.sample_id
            WHERE samples.job_id = :job_id AND attempts.ended_at IS NOT NULL{filters}
        ) AS calls
    ) AS ordered
) AS grouped
GROUP BY server, g"""


def busy_intervals(db: Session | Reader, job_id: int, now: datetime, *,
                   ended_after: datetime | None = None, started_before: datetime | None = None,
                   running: bool = True) -> dict[str, list[tuple[datetime, datetime]]]:
    """Per server, the disjoint intervals with a call of the job in flight: of the calls
    that ended after ``ended_after`` and started before ``started_before`` (None: all),
    and with ``running``, the calls in flight now (from their start until now).

    The database merges overlapping calls (see ``_BUSY_SQL``), so a long busy
    stretch comes back as one row.
    """
    reader = reader_of(db)
    filters = ""
    params: dict[str, Any] = {"job_id": job_id}
    if ended_after is not None:
        filters += " AND attempts.ended_at > :ended_after"
        params["ended_after"] = ended_after
    if started_before is not None:
        filters += " AND attempts.started_at < :started_before"
        params["started_before"] = started_before
    found: dict[str, list[tuple[datetime, datetime]]] = {}
    for server, start, end in reader.rows(_BUSY_SQL.format(filters=filters), params):
        found.setdefault(server, []).append((read_time(start), read_time(end)))
    # Calls running now: from their start until now.
    if running:
        for server, start in reader.rows(
                "SELECT server, started_at FROM samples WHERE job_id = :job_id "
                "AND state = 'running' AND started_at IS NOT NULL AND server IS NOT NULL",
                {"job_id": job_id}):
            started = read_time(start)
            found.setdefault(server, []).append((started, max(started, now)))
    return {server: merge(spans) for server, spans in found.items()}


def fold_busy(db: Session | Reader, job: CostJob, now: datetime, *, store: bool = True
              ) -> tuple[datetime | None, dict[str, float]]:
    """The job's busy seconds per server up to a time T, and T (None: nothing folded).

    Every call's part before T is in the fold; a status adds the calls that
    ended after T (their part after T) and the calls running now. T moves on
    at most once a minute, to ``FOLD_LAG`` before now but never past the start
    of a call running now (so no call in flight straddles it), adding the
    parts in [old T, new T] of the calls that ended after the old T. A
    compare-and-set on the old T: two statuses folding at once write one fold.
    Exact but for a call that ended before the new T and is written after the
    fold (a writer holding answers through a database outage): its part
    before T is not counted. ``store=False`` (a read-only transaction: the
    export's snapshot) computes the new fold without writing it.
    """
    reader = reader_of(db)
    until = job.busy_until
    folded = {k: float(v) for k, v in (job.busy_folded or {}).items()}
    if until is not None and now - until < FOLD_LAG + FOLD_EVERY:
        return until, folded
    target = now - FOLD_LAG
    [(oldest,)] = reader.rows("SELECT min(started_at) FROM samples "
                              "WHERE job_id = :job_id AND state = 'running'", {"job_id": job.id})
    if oldest is not None:
        target = min(target, read_time(oldest))
    if until is not None and target <= until:
        return until, folded
    spans = busy_intervals(reader, job.id, now, ended_after=until, started_before=target,
                           running=False)
    for server, intervals in spans.items():
        folded[server] = folded.get(server, 0.0) + measure(intervals, until, target)
    if store:
        # The compare-and-set on the fold it was computed from.
        params: dict[str, Any] = {"until": target, "folded": json.dumps(folded),
                                  "job_id": job.id}
        same = "busy_until IS NULL"
        if until is not None:
            same, params["was"] = "busy_until = :was", until
        reader.write("UPDATE jobs SET busy_until = :until, busy_folded = :folded "
                     f"WHERE id = :job_id AND {same}", params)
    return target, folded


def remaining_calls(db: Session | Reader, job: CostJob, remaining: int) -> int:
    """Calls the job still has to make: ``remaining`` open samples, one call each, or for a
    multi-turn job (``--regenerate all``) the sum of their turns left."""
    if job.regenerate != "all":
        return remaining
    [(turns,)] = reader_of(db).rows(
        "SELECT coalesce(sum(CASE WHEN coalesce(turn_count, 1) - turn > 1 "
        "THEN coalesce(turn_count, 1) - turn ELSE 1 END), 0) "
        f"FROM samples WHERE job_id = :job_id AND state IN {_OPEN_SQL}", {"job_id": job.id})
    return max(int(turns or 0), remaining)


def price_of(job: CostJob, settings: StatusSettings | None = None) -> float | None:
    """The job's GPU-hour price, else SYNTHQ_GPU_HOUR_PRICE, else None."""
    if job.gpu_hour_price is not None:
        return job.gpu_hour_price
    if settings is None:
        from synthq.spec.config import status_settings  # pydantic-settings: only when not given

        settings = status_settings()
    return settings.gpu_hour_price


def job_cost(db: Session | Reader, job: CostJob, *, remaining: int,
             now: datetime | None = None, store: bool = True,
             settings: StatusSettings | None = None) -> JobCost:
    """The cost report of ``job`` (``remaining``: samples not yet in a final state;
    ``store=False`` in a read-only transaction, see :func:`fold_busy`; ``settings``:
    None reads them from the environment)."""
    reader = reader_of(db)
    now = now or utcnow()
    price = price_of(job, settings)
    gpus = max(1, job.gpus or 1)
    cost = JobCost(gpus=gpus, gpu_hour_price=price)
    until, folded = fold_busy(reader, job, now, store=store)
    recent_spans = busy_intervals(reader, job.id, now, ended_after=until)
    busy = {server: folded.get(server, 0.0) + measure(recent_spans.get(server, []), until)
            for server in set(folded) | set(recent_spans)}
    tokens: dict[str, int] = {}
    ok_calls = 0
    for server, n, sum_tokens in reader.rows(
            "SELECT server, sum(n), sum(tokens) FROM call_counts "
            "WHERE job_id = :job_id AND outcome = 'ok' GROUP BY server", {"job_id": job.id}):
        tokens[server] = int(sum_tokens or 0)
        ok_calls += int(n or 0)
    [(recent, first)] = reader.rows(
        "SELECT coalesce(sum(attempts.completion_tokens), 0), min(attempts.ended_at) "
        "FROM attempts JOIN samples ON samples.id = attempts.sample_id "
        "WHERE samples.job_id = :job_id AND attempts.outcome = 'ok' "
        "AND attempts.ended_at >= :since", {"job_id": job.id, "since": now - CURRENT_WINDOW})
    for server in sorted(set(busy) | set(tokens)):
        seconds = busy.get(server, 0.0)
        n = tokens.get(server, 0)
        sc = ServerCost(busy_s=seconds, gpu_hours=seconds * gpus / 3600.0, tokens=n,
                        tokens_per_s=n / seconds if seconds > 0 else 0.0)
        if price is not None:
            sc.dollars = sc.gpu_hours * price
            if sc.tokens_per_s > 0:
                sc.dollars_per_mtok = price * gpus / (sc.tokens_per_s * 3600.0) * 1e6
        cost.servers[server] = sc
    cost.busy_s = sum(x.busy_s for x in cost.servers.values())
    cost.gpu_hours = sum(x.gpu_hours for x in cost.servers.values())
    cost.tokens = sum(x.tokens for x in cost.servers.values())
    cost.tokens_per_s = cost.tokens / cost.busy_s if cost.busy_s > 0 else 0.0
    if recent and first is not None:
        span = max(1.0, min(CURRENT_WINDOW.total_seconds(),
                            (now - read_time(first)).total_seconds()))
        cost.current_tokens_per_s = int(recent) / span
    if ok_calls:
        cost.mean_tokens_per_sample = cost.tokens / ok_calls
    if price is not None:
        cost.dollars = cost.gpu_hours * price
        if cost.tokens:
            # $/h of GPUs ÷ (tokens/s × 3600) × 10⁶, over all servers at once.
            cost.dollars_per_mtok = cost.dollars / cost.tokens * 1e6
    if remaining and cost.mean_tokens_per_sample and cost.current_tokens_per_s > 0:
        # Calls still to make: one per open sample, or with --regenerate all the turns
        # each open sample has left (its current one included); the mean is per call.
        calls = remaining_calls(reader, job, remaining)
        cost.remaining_calls = calls
        cost.remaining_s = calls * cost.mean_tokens_per_sample / cost.current_tokens_per_s
        if price is not None:
            servers = max(1, len(job.servers))
            cost.remaining_dollars = cost.remaining_s / 3600.0 * price * gpus * servers
    elif not remaining:
        cost.remaining_s = 0.0
        cost.remaining_dollars = 0.0 if price is not None else None
    return cost

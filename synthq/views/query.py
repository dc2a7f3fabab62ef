"""Read-only views of jobs and samples for the REST API and the job page.

Nothing here writes: changes go through :mod:`synthq.queue.states` (and
:func:`synthq.jobs.enqueue.enqueue`). The CLI's ``status`` shares
:func:`synthq.views.report.job_status`; this module adds what a web page needs:
job lists, filtered sample pages (keyset pagination), one sample with its
attempts and loss mask, samples done per minute, and the figures behind
``/metrics``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from synthq.core.enums import INFLIGHT, SampleState
from synthq.core.packing import unpack_ids, unpack_mask
from synthq.store.db import safe_url, utcnow
from synthq.store.models import Attempt, CallCount, Job, Sample, SampleCount, Server, Worker

__all__ = ["JobSummary", "list_jobs", "SampleRow", "list_samples", "SampleDetail", "AttemptDetail",
           "sample_detail", "mask_segments", "done_per_minute", "MetricsSnapshot",
           "metrics_snapshot", "LATENCY_BUCKETS", "TTFT_BUCKETS"]


@dataclass
class JobSummary:
    id: int
    name: str
    state: str
    model: str
    created_at: datetime
    counts: dict[str, int]


def list_jobs(session: Session) -> list[JobSummary]:
    """Every job, oldest first, with its counts per state (one grouped query)."""
    counts: dict[int, dict[str, int]] = {}
    for job_id, state, n in session.execute(  # the counters of migration 0016
            select(SampleCount.job_id, SampleCount.state, func.sum(SampleCount.n))
            .group_by(SampleCount.job_id, SampleCount.state)):
        counts.setdefault(job_id, {s.value: 0 for s in SampleState})[str(state)] = int(n)
    return [JobSummary(j.id, j.name, str(j.state), j.model, j.created_at,
                       counts.get(j.id, {s.value: 0 for s in SampleState}))
            for j in session.scalars(select(Job).order_by(Job.id))]


@dataclass
class SampleRow:
    id: int
    dataset_index: int
    source_id: str | None
    state: str
    attempts: int
    server: str | None
    error_class: str | None
    error_message: str | None
    finish_reason: str | None
    completion_tokens: int | None
    num_tokens: int | None
    num_supervised: int | None
    updated_at: datetime


def list_samples(session: Session, job_id: int, *, state: str | None = None,
                 error_class: str | None = None, server: str | None = None, after: int = 0,
                 limit: int = 100) -> tuple[list[SampleRow], int | None]:
    """A page of a job's samples in id order, after ``after``; and the next page's ``after``."""
    conds = [Sample.job_id == job_id, Sample.id > after]
    if state:
        conds.append(Sample.state == state)
    if error_class:
        conds.append(Sample.error_class == error_class)
    if server and "***@" in server:
        # The masked form the API shows (password as ***): the job's servers it stands for.
        from synthq.store.models import Job

        servers = session.scalar(select(Job.servers).where(Job.id == job_id)) or []
        conds.append(Sample.server.in_([u for u in servers if safe_url(u) == server]))
    elif server:
        conds.append(Sample.server == server)
    rows = session.execute(
        select(Sample.id, Sample.dataset_index, Sample.source_id, Sample.state, Sample.attempts,
               Sample.server, Sample.error_class, Sample.error_message, Sample.finish_reason,
               Sample.completion_tokens, Sample.num_tokens, Sample.num_supervised,
               Sample.updated_at)
        .where(*conds).order_by(Sample.id).limit(limit + 1)).all()
    page = [SampleRow(r[0], r[1], r[2], str(r[3]), r[4], _url(r[5]), r[6], _url(r[7]), r[8],
                      r[9], r[10], r[11], r[12]) for r in rows[:limit]]
    return page, (page[-1].id if len(rows) > limit else None)


def _url(text: str | None) -> str | None:
    """A URL (or a message that may hold one) with its password masked."""
    return safe_url(text) if text else text


@dataclass
class MaskSegment:
    """A run of tokens that are all supervised or all not."""

    supervised: bool
    tokens: int
    #: The run decoded (None when no tokenizer file could be read here).
    text: str | None


@dataclass
class AttemptDetail:
    """One call of a sample to a server (a row of ``attempts``), as it is shown."""

    id: int
    server: str
    worker: str | None
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error_message: str | None
    latency_s: float | None
    ttft_s: float | None
    completion_tokens: int | None
    turn: int | None = None


@dataclass
class SampleDetail:
    """One sample in full: what ``GET /api/samples/{id}`` answers (its response model is
    this class) and what `synthq sample --json` prints. Server URLs are masked."""

    id: int
    job_id: int
    job_name: str
    dataset_index: int
    source_id: str | None
    state: str
    attempts: int
    server: str | None
    error_class: str | None
    error_message: str | None
    prompt: list[dict[str, Any]] | None
    response_content: str | None
    reasoning_content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    num_tokens: int | None
    num_supervised: int | None
    tokenize_version: int | None
    created_at: datetime
    finished_at: datetime | None
    attempt_log: list[AttemptDetail] = field(default_factory=list)
    #: The example's tokens in runs of supervised / not supervised.
    mask: list[MaskSegment] = field(default_factory=list)
    #: The row's tools and the answer's tool calls (None: none).
    tools: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    #: Regenerating every turn: the next turn, how many, the answers so far, a cut.
    turn: int = 0
    turn_count: int | None = None
    turns: list[dict[str, Any]] | None = None
    cut_at_turn: int | None = None
    cut_reason: str | None = None
    #: Settings of this sample over its job's (``synthq requeue --max-tokens`` ...).
    overrides: dict[str, Any] | None = None
    #: ``--examples per-turn``: its examples, end to end in ``input_ids``:
    #: ``[{"turn", "tokens", "supervised"}, ...]`` (None: one example).
    examples: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_detail(session: Session, sample_id: int, *, decode: bool = True) -> SampleDetail | None:
    """One sample: prompt, answer, reasoning, every attempt, token counts and mask runs."""
    smp = session.get(Sample, sample_id)
    if smp is None:
        return None
    job = session.get(Job, smp.job_id)
    assert job is not None
    attempts = session.scalars(select(Attempt).where(Attempt.sample_id == sample_id)
                               .order_by(Attempt.id)).all()
    detail = SampleDetail(
        id=smp.id, job_id=smp.job_id, job_name=job.name, dataset_index=smp.dataset_index,
        source_id=smp.source_id, state=str(smp.state), attempts=smp.attempts,
        server=_url(smp.server), error_class=smp.error_class,
        error_message=_url(smp.error_message),
        prompt=smp.prompt, response_content=smp.response_content,
        reasoning_content=smp.reasoning_content, finish_reason=smp.finish_reason,
        prompt_tokens=smp.prompt_tokens, completion_tokens=smp.completion_tokens,
        num_tokens=smp.num_tokens, num_supervised=smp.num_supervised,
        tokenize_version=smp.tokenize_version, created_at=smp.created_at,
        finished_at=smp.finished_at,
        attempt_log=[AttemptDetail(
            id=a.id, server=safe_url(a.server), worker=a.worker, started_at=a.started_at,
            ended_at=a.ended_at, outcome=a.outcome, error_message=_url(a.error_message),
            latency_s=a.latency_s, ttft_s=a.ttft_s, completion_tokens=a.completion_tokens,
            turn=a.turn) for a in attempts],
        tools=smp.tools, tool_calls=smp.tool_calls, turn=smp.turn or 0,
        turn_count=smp.turn_count, turns=smp.turns, cut_at_turn=smp.cut_at_turn,
        examples=smp.examples,
        cut_reason=smp.cut_reason, overrides=smp.overrides or None)
    if smp.input_ids is not None and smp.loss_mask is not None and smp.num_tokens:
        detail.mask = mask_segments(smp.input_ids, smp.loss_mask, smp.num_tokens,
                                    job.tokenizer if decode else None)
    return detail


def mask_segments(input_ids: bytes, loss_mask: bytes, num_tokens: int,
                  tokenizer: str | None) -> list[MaskSegment]:
    """Runs of supervised and unsupervised tokens, decoded when the tokenizer file is here.

    Decoding uses the ``tokenizers`` library on the tokenizer's
    ``tokenizer.json`` (a local directory or the Hugging Face cache), not
    ``transformers``: the API process must not import torch.
    """
    ids = unpack_ids(input_ids)
    assert ids is not None
    mask = unpack_mask(loss_mask, num_tokens)
    tok = _fast_tokenizer(tokenizer) if tokenizer else None
    segments: list[MaskSegment] = []
    start = 0
    for i in range(1, num_tokens + 1):
        if i == num_tokens or mask[i] != mask[start]:
            text = (tok.decode(ids[start:i].tolist(), skip_special_tokens=False)
                    if tok is not None else None)
            segments.append(MaskSegment(bool(mask[start]), i - start, text))
            start = i
    return segments


@lru_cache(maxsize=8)
def _fast_tokenizer(path_or_id: str) -> Any:
    from tokenizers import Tokenizer

    local = Path(path_or_id).expanduser() / "tokenizer.json"
    if local.is_file():
        return Tokenizer.from_file(str(local))
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path_or_id, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a repo id: no text, ids only
        return None
    return Tokenizer.from_file(cached) if isinstance(cached, str) else None


def done_per_minute(session: Session, job_id: int, *, minutes: int = 60,
                    now: datetime | None = None) -> list[tuple[datetime, int]]:
    """Samples finished as done in each of the last ``minutes`` minutes, oldest first."""
    now = now or utcnow()
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    times = session.scalars(select(Sample.finished_at).where(
        Sample.job_id == job_id, Sample.state == SampleState.DONE,
        Sample.finished_at >= start)).all()
    buckets = [0] * minutes
    for t in times:
        if t is None:
            continue
        index = int((t - start).total_seconds() // 60)
        if 0 <= index < minutes:
            buckets[index] += 1
    return [(start + timedelta(minutes=i), n) for i, n in enumerate(buckets)]


#: Histogram buckets (seconds) of call latency and time to first token.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class MetricsSnapshot:
    #: (job name, state) → samples.
    samples: dict[tuple[str, str], int]
    #: server → samples queued or running.
    inflight: dict[str, int]
    #: server → healthy (1) or not (0), for servers probed.
    healthy: dict[str, int]
    #: (server, outcome) → calls.
    calls: dict[tuple[str, str], int]
    #: server → (cumulative bucket counts, count, sum) for latency and time to first token.
    latency: dict[str, tuple[list[int], int, float]]
    ttft: dict[str, tuple[list[int], int, float]]
    #: server → completion tokens of successful calls.
    generated_tokens: dict[str, int]
    #: worker name → (last heartbeat unix time, capacity, in flight).
    workers: dict[str, tuple[float, int, int]]


def _histograms(session: Session, column: Any, buckets: tuple[float, ...],
                where: Sequence[Any] = ()) -> dict[str, tuple[list[int], int, float]]:
    cols = [func.count().filter(column <= b) for b in buckets]
    rows = session.execute(
        select(Attempt.server, *cols, func.count(column), func.coalesce(func.sum(column), 0.0))
        .where(column.is_not(None), *where).group_by(Attempt.server)).all()
    return {safe_url(r[0]): ([int(x) for x in r[1:1 + len(buckets)]], int(r[-2]),
                             float(r[-1])) for r in rows}


@dataclass
class _AttemptFigures:
    """The ``attempts`` side of a scrape: calls, tokens and both histograms."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    latency: dict[str, tuple[list[int], int, float]] = field(default_factory=dict)
    ttft: dict[str, tuple[list[int], int, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, session: Session, lo: int, hi: int | None, *,
             counts: bool = True) -> _AttemptFigures:
        """The figures of the attempts with ``lo < id <= hi`` (one index range scan);
        ``counts=False``: the histograms only (calls and tokens come from call_counts)."""
        where = [Attempt.id > lo] + ([Attempt.id <= hi] if hi is not None else [])
        calls: dict[tuple[str, str], int] = {}
        tokens: dict[str, int] = {}
        if counts:
            calls = {(safe_url(server), outcome or "running"): n for server, outcome, n in
                     session.execute(select(Attempt.server, Attempt.outcome, func.count())
                                     .where(*where).group_by(Attempt.server, Attempt.outcome))}
            tokens = {safe_url(server): int(n or 0) for server, n in session.execute(
                select(Attempt.server, func.sum(Attempt.completion_tokens))
                .where(Attempt.outcome == "ok", *where).group_by(Attempt.server))}
        return cls(calls, tokens, _histograms(session, Attempt.latency_s, LATENCY_BUCKETS, where),
                   _histograms(session, Attempt.ttft_s, TTFT_BUCKETS, where))

    def plus(self, other: _AttemptFigures) -> _AttemptFigures:
        def add_hist(a: dict[str, tuple[list[int], int, float]],
                     b: dict[str, tuple[list[int], int, float]]
                     ) -> dict[str, tuple[list[int], int, float]]:
            out = dict(a)
            for key, (buckets, n, total) in b.items():
                if key in out:
                    mine = out[key]
                    out[key] = ([x + y for x, y in zip(mine[0], buckets, strict=True)],
                                mine[1] + n, mine[2] + total)
                else:
                    out[key] = (list(buckets), n, total)
            return out

        calls, tokens = dict(self.calls), dict(self.tokens)
        for call, n in other.calls.items():
            calls[call] = calls.get(call, 0) + n
        for server, t in other.tokens.items():
            tokens[server] = tokens.get(server, 0) + t
        return _AttemptFigures(calls, tokens, add_hist(self.latency, other.latency),
                               add_hist(self.ttft, other.ttft))


@dataclass
class _Rollup:
    """Attempts with ``id <= upto``, summed once; a scrape reads only the rows after.

    ``attempts`` is insert-only, but ids are taken before their transaction
    commits: a row with an id below the newest one may still become visible.
    So on PostgreSQL a scrape notes the id sequence's position and the
    snapshot's ``xmax``; once every transaction older than that ``xmax`` has
    ended (a later snapshot's ``xmin`` passed it), no row at or below that
    position can still appear, and it is folded in. On SQLite (one writer at a
    time) whatever is visible is final.
    """

    upto: int = 0
    figures: _AttemptFigures = field(default_factory=_AttemptFigures)
    #: ``(sequence position, snapshot xmax)`` noted by earlier scrapes, oldest first.
    marks: list[tuple[int, int]] = field(default_factory=list)


#: One per engine (a new engine, e.g. after ``dispose_engines``, starts afresh).
_rollups: weakref.WeakKeyDictionary[Any, _Rollup] = weakref.WeakKeyDictionary()
_rollup_lock = threading.Lock()


def _attempt_figures(session: Session) -> _AttemptFigures:
    """Every attempt's figures, reading only the rows since the last safe point."""
    bind = session.get_bind()
    with _rollup_lock:
        rollup = _rollups.setdefault(bind.engine, _Rollup())
        if bind.dialect.name == "postgresql":
            xmin, xmax, position = session.execute(text(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint, "
                "pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
                "coalesce(pg_sequence_last_value("
                "pg_get_serial_sequence('attempts', 'id')::regclass), 0)")).one()
            if position < rollup.upto:  # the table was emptied and its ids restarted
                rollup = _rollups[bind.engine] = _Rollup()
            safe = [m for m in rollup.marks if m[1] <= xmin]
            rollup.marks = [m for m in rollup.marks if m[1] > xmin][-100:]
            rollup.marks.append((int(position), int(xmax)))
            target = max((m[0] for m in safe), default=rollup.upto)
        else:
            target = int(session.scalar(select(func.coalesce(func.max(Attempt.id), 0))) or 0)
            if target < rollup.upto:
                rollup = _rollups[bind.engine] = _Rollup()
        if target > rollup.upto:
            rollup.figures = rollup.figures.plus(
                _AttemptFigures.read(session, rollup.upto, target, counts=False))
            rollup.upto = target
        return rollup.figures.plus(_AttemptFigures.read(session, rollup.upto, None,
                                                        counts=False))


def _call_figures(session: Session) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """Calls per (server, outcome) and tokens of successful calls per server, from the
    counters the triggers keep (migration 0016): a few rows, however many attempts."""
    calls: dict[tuple[str, str], int] = {}
    tokens: dict[str, int] = {}
    for server, outcome, n, t in session.execute(
            select(CallCount.server, CallCount.outcome, func.sum(CallCount.n),
                   func.sum(CallCount.tokens))
            .group_by(CallCount.server, CallCount.outcome)):
        if not n:
            continue
        key = (safe_url(server), outcome or "running")
        calls[key] = calls.get(key, 0) + int(n)
        if outcome == "ok":
            tokens[key[0]] = tokens.get(key[0], 0) + int(t or 0)
    return calls, tokens


def metrics_snapshot(session: Session) -> MetricsSnapshot:
    """What ``/metrics`` reports, read from SQL (so every process's work is counted).

    Calls and tokens come from ``call_counts`` (kept by triggers). The latency
    histograms are cumulative counters kept in this process (:class:`_Rollup`):
    a scrape scans the attempts since the last safe point, not the whole table
    (the first scrape of a process reads it all once).
    """
    samples = {(name, str(state)): int(n) for name, state, n in session.execute(
        select(Job.name, SampleCount.state, func.sum(SampleCount.n))
        .join(SampleCount, SampleCount.job_id == Job.id)
        .group_by(Job.name, SampleCount.state)) if n}
    inflight = {safe_url(server or ""): n for server, n in session.execute(
        select(Sample.server, func.count()).where(Sample.state.in_(INFLIGHT),
                                                  Sample.server.is_not(None))
        .group_by(Sample.server))}
    healthy = {safe_url(url): int(ok) for url, ok in session.execute(
        select(Server.url, Server.healthy))}
    attempts = _attempt_figures(session)
    calls, tokens = _call_figures(session)
    workers = {w.name: (w.heartbeat_at.timestamp(), w.capacity, w.inflight)
               for w in session.scalars(select(Worker))}
    return MetricsSnapshot(samples, inflight, healthy, calls, attempts.latency,
                           attempts.ttft, tokens, workers)


def to_json(obj: Any) -> str:
    return json.dumps(obj, default=str)


@dataclass
class CostSnapshot:
    #: server → its adaptive target limit (servers of --inflight auto jobs).
    limits: dict[str, int]
    #: job name → the cost report (synthq.store.cost.JobCost as a dict), for unfinished jobs.
    costs: dict[str, dict[str, Any]]


def cost_snapshot(session: Session) -> CostSnapshot:
    """What ``/metrics`` reports about adaptive limits and cost (jobs not finished)."""
    from synthq.core.enums import JobState
    from synthq.store.cost import job_cost

    limits = {safe_url(url): int(limit or 0) for url, limit in session.execute(
        select(Server.url, Server.limit_target).where(Server.limit_target.is_not(None)))}
    costs = {}
    for job in session.scalars(select(Job).where(Job.state.in_(
            [JobState.ACTIVE, JobState.PAUSED]))):
        remaining = session.scalar(select(func.sum(SampleCount.n)).where(
            SampleCount.job_id == job.id, SampleCount.state.in_(
                [SampleState.PENDING, *INFLIGHT]))) or 0
        costs[job.name] = job_cost(session, job, remaining=remaining).to_dict()
    return CostSnapshot(limits, costs)

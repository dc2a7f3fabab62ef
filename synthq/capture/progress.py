"""A job's capture stage as a status shows it: captures per state, failures with their
reason, bytes on disk against what is left to write and the store's free space.

The reads are plain SQL (:mod:`synthq.store.sqlread`), as the rest of a status's, so that
``synthq status`` (its fast path too), ``GET /api/jobs/{id}``, the job page and
``/metrics`` show the same figures from one definition; this module loads neither
SQLAlchemy nor the models. :func:`plan` is the stage's disk plan
(:func:`synthq.capture.stage.plan` is this one over a session).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from synthq.capture.plan import AUTO, DTYPES, Plan, auto_dtype, layers_for, target_config
from synthq.capture.store import Store
from synthq.core.defaults import store_root
from synthq.core.enums import CaptureState, SampleState
from synthq.core.errors import UserError
from synthq.core.secrets import safe_url
from synthq.spec.jobspec import default
from synthq.store.sqlread import Reader, read_json

#: ``store_root`` is synthq.core.defaults' (a low module: config reads it too); named here for
#: the capture stage's readers.
__all__ = ["CaptureProgress", "CaptureCounts", "capture_progress", "counts", "plan",
           "store_root"]

#: Characters of a failure's message a status shows.
MESSAGE_CHARS = 300


class _CaptureJob(NamedTuple):
    """The columns of ``jobs`` the capture figures read (what :func:`layers_for` reads)."""

    capture_servers: list[str]
    capture_layers: list[int] | None
    capture_dtype: str
    train_target: str | None
    tokenizer: str | None
    #: Why synthq stopped the stage (synthq.queue.streaks); None: it runs.
    capture_stopped: str | None = None


def _job(reader: Reader, job_id: int) -> _CaptureJob | None:
    found = reader.rows("SELECT capture_servers, capture_layers, capture_dtype, train_target, "
                        "tokenizer, capture_stopped FROM jobs WHERE id = :id", {"id": job_id})
    if not found:
        return None
    servers, layers, dtype, target, tokenizer, stopped = found[0]
    return _CaptureJob(list(read_json(servers) or []), read_json(layers),
                       dtype or default("capture_dtype"), target, tokenizer, stopped)


@dataclass
class CaptureCounts:
    """The ``captures`` rows of a job, summed."""

    total: int = 0
    by_state: dict[str, int] = field(default_factory=dict)
    #: Failed captures by class.
    failures: dict[str, int] = field(default_factory=dict)
    #: Pending captures that failed before and wait for their retry, by class.
    retrying: dict[str, int] = field(default_factory=dict)
    #: Bytes and tokens of the done captures' files.
    bytes: int = 0
    tokens: int = 0
    #: Calls made to capture servers.
    calls: int = 0

    @property
    def done(self) -> int:
        return self.by_state.get(CaptureState.DONE, 0)

    @property
    def open(self) -> int:
        return self.by_state.get(CaptureState.PENDING, 0) + \
            self.by_state.get(CaptureState.RUNNING, 0)


def counts(reader: Reader, job_id: int) -> CaptureCounts:
    out = CaptureCounts()
    for state, error_class, n, nbytes, tokens, calls in reader.rows(
            "SELECT state, error_class, count(*), coalesce(sum(bytes), 0), "
            "coalesce(sum(num_tokens), 0), coalesce(sum(attempts), 0) FROM captures "
            "WHERE job_id = :job_id GROUP BY state, error_class", {"job_id": job_id}):
        state, n = str(state), int(n)
        out.total += n
        out.by_state[state] = out.by_state.get(state, 0) + n
        out.calls += int(calls)
        cls = error_class or "error"
        if state == CaptureState.FAILED:
            out.failures[cls] = out.failures.get(cls, 0) + n
        elif state == CaptureState.PENDING and error_class is not None:
            out.retrying[cls] = out.retrying.get(cls, 0) + n
        elif state == CaptureState.DONE:
            out.bytes += int(nbytes)
            out.tokens += int(tokens)
    return out


def plan(reader: Reader, job_id: int, job: Any, *, free: int) -> Plan:
    """What the job's captures not yet done will take on disk (``job``: its capture
    columns, a :class:`synthq.store.models.Job` or a row of them). Raises :class:`UserError`
    when the layers are unknown (no ``capture_layers``, no target config)."""
    layers = layers_for(job)
    [(samples, tokens)] = reader.rows(
        "SELECT count(*), coalesce(sum(num_tokens), 0) FROM samples WHERE job_id = :job_id "
        "AND input_ids IS NOT NULL AND id NOT IN (SELECT sample_id FROM captures "
        "WHERE job_id = :job_id AND state = :done)",
        {"job_id": job_id, "done": CaptureState.DONE.value})
    config = target_config(job.train_target, job.tokenizer)
    hidden = int(config["hidden_size"]) if config and "hidden_size" in config else None
    row = reader.rows("SELECT bytes, num_tokens, dtype FROM captures WHERE job_id = "
                      ":job_id AND state = :done AND num_tokens > 0 ORDER BY id LIMIT 1",
                      {"job_id": job_id, "done": CaptureState.DONE.value})
    if hidden is None and row:  # from a file already captured: bytes / (tokens × layers × width)
        nbytes, ntokens, stored = row[0]
        hidden = int(nbytes / ntokens / len(layers) / DTYPES.get(stored, 4))
    dtype, source = job.capture_dtype or AUTO, "set with --dtype"
    if dtype == AUTO:
        dtype, source = auto_dtype(config, row[0][2] if row else None)
    return Plan(int(samples), int(tokens), layers, dtype, hidden, free, source)


@dataclass
class CaptureProgress:
    """A job's capture stage in a status (``JobStatus.capture``; None: the job captures
    nothing): the one record of it, in ``synthq status --json``, ``synthq capture --json``
    and the API alike."""

    #: The job's capture servers, passwords masked.
    servers: list[str]
    #: Captures: tokenized samples (done, with input_ids) the stage has or will have.
    total: int
    #: Captures per state (pending, running, done, failed), zeros included.
    counts: dict[str, int]
    #: Of them, done: checked files in the store.
    done: int
    #: Of ``total``, done samples the stage has not picked up yet (it adds them as it runs).
    waiting: int
    #: Failed captures by class, and one reason per class (its latest message).
    failures: dict[str, int]
    reasons: dict[str, str]
    #: Pending captures waiting for a retry, by the class of their last failure.
    retrying: dict[str, int]
    #: Calls made to capture servers.
    calls: int
    #: The done captures' files: bytes on disk and tokens.
    bytes: int
    tokens: int
    #: Layers and stored dtype (None: the layers are unknown until --layers or a target).
    layers: list[int] | None
    dtype: str
    #: Bytes the captures not yet done will take (None: unknown until the first file).
    projected_bytes: int | None
    #: Free space where the store lives.
    free_bytes: int | None
    #: Why synthq stopped the stage: a server failed several captures in a row the same
    #: way (synthq.queue.streaks); None: it runs.
    stopped: str | None = None

    @property
    def over_budget(self) -> bool:
        """What is left to write does not fit in the store's free space."""
        return (self.projected_bytes is not None and self.free_bytes is not None
                and self.projected_bytes > self.free_bytes)

    def lines(self) -> list[str]:
        """The stage in a few lines of text (`synthq status`, the job page)."""
        c = self.counts
        where = ", ".join(self.servers) or "no capture server"
        waiting = f", {self.waiting:,} not picked up yet" if self.waiting else ""
        out = [f"capture: {self.done:,}/{self.total:,} done, {c['running']:,} running, "
               f"{c['pending']:,} pending, {c['failed']:,} failed{waiting} ({where})"]
        if self.stopped:
            out.append(self.stopped)
        left = ("size of the rest unknown until the first file" if self.projected_bytes is None
                else f"about {size(self.projected_bytes)} more to write")
        free = "" if self.free_bytes is None else f", {size(self.free_bytes)} free"
        budget = ": does not fit, free space or store --dtype bfloat16" \
            if self.over_budget else ""
        layers = f"layers {self.layers} as {self.dtype}" if self.layers else self.dtype
        out.append(f"capture disk: {size(self.bytes)} on disk ({self.tokens:,} tokens, "
                   f"{layers}), {left}{free}{budget}")
        for cls, n in sorted(self.failures.items(), key=lambda x: -x[1]):
            reason = self.reasons.get(cls)
            out.append(f"capture failed: {cls} {n:,}" + (f": {reason}" if reason else ""))
        if self.retrying:
            out.append("capture waiting to retry: " + ", ".join(
                f"{k} {v:,}" for k, v in sorted(self.retrying.items())))
        return out


def size(n: int) -> str:
    """Bytes for people: ``512 B``, ``1.5 MB``, ``3.20 GB``, ``1.10 TB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("TB", "GB") else \
                f"{n / scale:.1f} {unit}"
    return f"{n} B"


def capture_progress(reader: Reader, job_id: int, *, store: str | Path
                     ) -> CaptureProgress | None:
    """The job's capture stage, or None when it has neither capture servers nor captures."""
    job = _job(reader, job_id)
    if job is None:
        return None
    rows = counts(reader, job_id)
    if not job.capture_servers and not rows.total:
        return None
    [(waiting,)] = reader.rows(
        "SELECT count(*) FROM samples WHERE job_id = :job_id AND state = :done AND "
        "input_ids IS NOT NULL AND NOT EXISTS (SELECT 1 FROM captures "
        "WHERE captures.sample_id = samples.id)",
        {"job_id": job_id, "done": SampleState.DONE.value})
    reasons = {str(cls or "error"): safe_url(str(message or ""))[:MESSAGE_CHARS]
               for cls, message in reader.rows(
                   "SELECT error_class, error_message FROM captures WHERE id IN ("
                   "SELECT max(id) FROM captures WHERE job_id = :job_id AND state = :failed "
                   "GROUP BY error_class)",
                   {"job_id": job_id, "failed": CaptureState.FAILED.value})}
    try:
        free: int | None = Store(Path(store)).free_bytes()
    except OSError:
        free = None
    layers: list[int] | None
    dtype = job.capture_dtype
    try:
        p = plan(reader, job_id, job, free=free or 0)
        layers, projected, dtype = p.layers, p.projected, p.dtype
    except UserError:
        layers, projected = None, None
    return CaptureProgress(
        servers=[safe_url(u) for u in job.capture_servers],
        total=rows.total + int(waiting),
        counts={s.value: rows.by_state.get(s.value, 0) for s in CaptureState},
        done=rows.by_state.get(CaptureState.DONE.value, 0),
        waiting=int(waiting), failures=rows.failures, reasons=reasons,
        retrying=rows.retrying, calls=rows.calls, bytes=rows.bytes, tokens=rows.tokens,
        layers=layers, dtype=dtype, projected_bytes=projected, free_bytes=free,
        stopped=job.capture_stopped and safe_url(job.capture_stopped))

"""The schema: jobs, their samples, and one row per call to a server.

Typed SQLAlchemy 2 models; the Alembic migrations in ``migrations/`` must
produce exactly this metadata (a test checks it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from synthq.core.enums import CaptureState, JobState, RunState, SampleState, SpoolState
from synthq.spec.jobspec import default, mask_for

__all__ = ["Base", "Job", "Sample", "Attempt", "SampleCount", "CallCount", "Server", "Worker",
           "TrainingRun", "UTCDateTime", "ApiSession", "Capture", "CaptureCall", "SpoolItem"]

# Stable constraint names, so migrations and models compare equal.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Primary keys: 64-bit on PostgreSQL; INTEGER PRIMARY KEY (the rowid) on SQLite.
IdType = BigInteger().with_variant(Integer(), "sqlite")
JsonType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use synthq.store.db.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


def _enum(cls: type) -> Enum:
    return Enum(cls, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e],
                validate_strings=True, create_constraint=False)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JsonType}


class Job(Base):
    """One generation job: a dataset sent to one model on one or more servers."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    model: Mapped[str] = mapped_column(String(200))
    #: Base URLs of the OpenAI-compatible servers (``http://host:8000/v1``).
    servers: Mapped[list[str]] = mapped_column(JsonType)
    #: Sampling parameters sent with every request (temperature, top_p, ...).
    sampling: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    #: Extra request fields (chat_template_kwargs, return_token_ids, ...).
    extra_body: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    max_tokens: Mapped[int] = mapped_column(Integer)
    #: Seconds one call may take in all.
    total_timeout: Mapped[float] = mapped_column(Float)
    #: Seconds without a streamed chunk before the call counts as stalled.
    stall_timeout: Mapped[float] = mapped_column(Float)
    max_attempts: Mapped[int] = mapped_column(Integer)
    backoff_base: Mapped[float] = mapped_column(Float)
    backoff_cap: Mapped[float] = mapped_column(Float)
    #: Most requests in flight (queued + running) on each server.
    inflight_limit: Mapped[int] = mapped_column(Integer)
    #: ``--inflight auto``: the servers' adaptive limits (synthq.serving.adaptive) apply, within
    #: ``min_inflight`` and ``inflight_limit`` (then the hard cap, ``--max-inflight``).
    inflight_auto: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    min_inflight: Mapped[int] = mapped_column(Integer, default=4, server_default="4")
    #: GPUs behind each of the job's servers, and the price of one GPU-hour (None:
    #: SYNTHQ_GPU_HOUR_PRICE, or no dollar figures), for the cost report.
    gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    gpu_hour_price: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The cost report's busy seconds per server, folded up to ``busy_until``
    #: (synthq.store.cost.fold_busy): a status adds only the calls that ended after it.
    busy_until: Mapped[datetime | None] = mapped_column(nullable=True)
    busy_folded: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    #: Bytes of streamed response after which a call fails as response_too_large.
    max_response_bytes: Mapped[int] = mapped_column(Integer, default=4 << 20,
                                                    server_default=str(4 << 20))
    #: Keep answers cut by max_tokens (finish_reason=length) as done.
    keep_truncated: Mapped[bool] = mapped_column(Boolean, default=False)
    #: Stream each answer (the stall clock, partial progress); False: one plain
    #: non-streamed call per sample, cheaper, with the total timeout only.
    stream: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    state: Mapped[JobState] = mapped_column(_enum(JobState), default=JobState.ACTIVE)
    #: Why synthq paused the job itself (a URL without /v1); None for a user's pause.
    pause_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Where the samples came from (a path or a Hugging Face id), for people.
    dataset: Mapped[str] = mapped_column(Text, default="")

    # Tokenization (synthq.data.tokenize). No tokenizer: a sample is done once its
    # response is stored.
    #: Path or Hugging Face id of the target model's tokenizer.
    tokenizer: Mapped[str | None] = mapped_column(String(500))
    #: Chat template text overriding the tokenizer's own (from --chat-template FILE).
    chat_template: Mapped[str | None] = mapped_column(Text)
    #: Extra variables for the template, e.g. {"enable_thinking": true}.
    chat_template_kwargs: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict,
                                                                server_default="{}")
    max_seq_len: Mapped[int] = mapped_column(Integer, default=4096, server_default="4096")
    #: ``keep``: reasoning is rendered into the assistant turn and supervised; ``drop``.
    reasoning: Mapped[str] = mapped_column(String(8), default="keep", server_default="keep")
    #: Markers wrapped around reasoning when the template has no reasoning_content.
    think_open: Mapped[str] = mapped_column(String(64), default="<think>\n",
                                            server_default="<think>\n")
    think_close: Mapped[str] = mapped_column(String(64), default="\n</think>\n\n",
                                             server_default="\n</think>\n\n")
    #: ``last_turn`` (the generated answer) or ``all_assistant_turns`` (its default:
    #: synthq.spec.jobspec.mask_for).
    mask: Mapped[str] = mapped_column(String(24), default=mask_for(None),
                                      server_default=mask_for(None))
    #: ``last``: regenerate the last assistant turn; ``all``: every assistant turn,
    #: each on the regenerated history (synthq.data.turns).
    regenerate: Mapped[str] = mapped_column(String(8), default="last", server_default="last")
    #: ``conversation``: one training example per sample; ``per-turn``: with
    #: regenerate=all, one per regenerated turn (synthq.data.examples).
    examples: Mapped[str] = mapped_column(String(16), default="conversation",
                                          server_default="conversation")
    #: ``drop``: earlier regenerated turns are sent with their content only; ``keep``:
    #: with their reasoning_content too.
    history_reasoning: Mapped[str] = mapped_column(String(8), default="drop",
                                                   server_default="drop")
    #: Bumped by ``synthq retokenize``; samples tokenized at an older version are stale.
    tokenize_version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    #: The prompt rule and content-key form the job's samples were made under
    #: (synthq.data.dataset.KEY_VERSION): 1 for jobs made before the prompt kept a
    #: trailing user turn, 2 since. A job keeps its rule for life.
    key_version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Training (synthq.training): when the readiness check starts a run, and on what.
    #: ``ready`` (98 % of non-skipped samples done, none in flight), ``done:F``,
    #: ``count:N`` or ``never``. Nothing starts by itself without ``train_target``.
    train_when: Mapped[str] = mapped_column(String(32), default="ready", server_default="ready")
    #: The target model (local path or Hugging Face id) a drafter is trained for.
    train_target: Mapped[str | None] = mapped_column(String(1000))
    #: Hyperparameters for runs the readiness check starts (TrainConfig fields).
    train_settings: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict,
                                                          server_default="{}")
    #: The generation settings the samples' content keys were made under, once
    #: ``synthq requeue --model`` moved the job to another model (None before):
    #: the same dataset enqueued again still matches its samples.
    key_settings: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    # Hidden-state capture (synthq.capture): a stage after generation, through a
    # vLLM started with ``extract_hidden_states`` and synthq's connector.
    #: Base URLs of the capture servers (empty: the job captures nothing).
    capture_servers: Mapped[list[str]] = mapped_column(JsonType, default=list,
                                                       server_default="[]")
    #: ``output_hidden_states`` indices captured (None: the drafter's three plus the
    #: last layer's, from the target's config).
    capture_layers: Mapped[list[int] | None] = mapped_column(JsonType, nullable=True)
    #: The stored dtype: ``auto`` (the engine's own: a bf16 engine's files stay bf16),
    #: ``float32``, ``bfloat16``, ``float16`` or ``float8_e4m3`` (synthq.spec.jobspec.CAPTURE
    #: declares them).
    capture_dtype: Mapped[str] = mapped_column(String(16), default=default("capture_dtype"),
                                               server_default=str(default("capture_dtype")))
    #: Most capture requests in flight on each capture server.
    capture_limit: Mapped[int] = mapped_column(Integer, default=default("capture_limit"),
                                               server_default=str(default("capture_limit")))
    #: Seconds one capture call may take; None: the service's ``capture_timeout``.
    capture_timeout: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: ``stage``: the capture stage's own calls capture each done sample; ``inline``: the
    #: final answer's call captures it too (the generation server is the capture server,
    #: ``include_output_tokens``), the stage only where that file fails (synthq.capture).
    capture_mode: Mapped[str] = mapped_column(String(8), default=default("capture_mode"),
                                              server_default=str(default("capture_mode")))
    #: Why synthq stopped the capture stage (identical failures in a row on one server,
    #: synthq.queue.streaks); None: it runs. ``synthq capture JOB --retry-failed`` clears it.
    capture_stopped: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Capture server URL → the folder where its engine writes files, as this machine
    #: sees it (vLLM's stock connector names files by request id: synthq takes them
    #: only from there, synthq.capture.confine).
    capture_files: Mapped[dict[str, str]] = mapped_column(JsonType, default=dict,
                                                          server_default="{}")
    #: Every move of the job's remaining work (``synthq requeue --model/--server``):
    #: ``{"at", "model": [from, to], "servers": [from, to], "requeued"}``.
    moves: Mapped[list[dict[str, Any]]] = mapped_column(JsonType, default=list,
                                                        server_default="[]")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    samples: Mapped[list[Sample]] = relationship(back_populates="job", lazy="raise")

    def generation_settings(self) -> dict[str, Any]:
        """What makes two generations of one prompt the same work (part of the content key)."""
        from synthq.spec.jobspec import generation_settings

        return generation_settings(lambda column: getattr(self, column))

    def key_generation_settings(self) -> dict[str, Any]:
        """The settings new rows' content keys are computed under (those of the job's
        first model, if it moved), so that a dataset enqueued again adds nothing."""
        return self.key_settings or self.generation_settings()


class Sample(Base):
    """One prompt of a job and everything that happened to it."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("job_id", "content_key"),
        # The dispatcher: due pending samples of a job, oldest first.
        Index("ix_samples_dispatch", "job_id", "state", "next_attempt_at", "id"),
        # In-flight count per server, and the lease sweep.
        Index("ix_samples_server_state", "server", "state"),
        Index("ix_samples_state_lease", "state", "expires_at"),
        # Rates for `status`.
        Index("ix_samples_job_finished", "job_id", "finished_at"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    #: sha256 of the prompt messages, the job's generation settings and its key_version.
    content_key: Mapped[str] = mapped_column(String(64))
    dataset_index: Mapped[int] = mapped_column(Integer)
    #: The dataset row's own id (its ``id``, ``uuid``, ... or ``--id-field``), as text.
    source_id: Mapped[str | None] = mapped_column(Text)
    #: The prompt: OpenAI messages, up to and including the last user turn
    #: (jobs of key_version 1: up to, not including, the last assistant turn).
    prompt: Mapped[list[dict[str, str]] | None] = mapped_column(JsonType, nullable=True)
    state: Mapped[SampleState] = mapped_column(_enum(SampleState))
    #: Calls made to a server for this sample (since the last requeue).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: A pending sample is due at this time (later than now while backing off).
    next_attempt_at: Mapped[datetime | None]
    #: Queued: deadline to be claimed. Running: the worker's lease.
    expires_at: Mapped[datetime | None]
    #: Random token; every transition out of queued/running must present it.
    claim: Mapped[str | None] = mapped_column(String(32))
    worker: Mapped[str | None] = mapped_column(String(200))
    server: Mapped[str | None] = mapped_column(String(500))
    error_class: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    response_content: Mapped[str | None] = mapped_column(Text)
    reasoning_content: Mapped[str | None] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    #: Token ids the server returned (vLLM ``return_token_ids``), little-endian int32.
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    # The training example (synthq.data.tokenize), written with the done transition.
    #: Token ids, little-endian int32.
    input_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    #: Characters replaced by U+FFFD so the response could be stored, by kind
    #: (``invalid_utf8``, ``nul``, ``surrogate``); None when none were.
    repairs: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    #: The server of the last failed call: a retry prefers another one.
    last_server: Mapped[str | None] = mapped_column(String(500))
    #: Loss mask, one bit per token (numpy.packbits order).
    loss_mask: Mapped[bytes | None] = mapped_column(LargeBinary)
    num_tokens: Mapped[int | None] = mapped_column(Integer)
    num_supervised: Mapped[int | None] = mapped_column(Integer)
    #: Several examples in ``input_ids``/``loss_mask`` (jobs with examples=per-turn),
    #: concatenated in this order: ``[{"turn", "tokens", "supervised"}, ...]``; None:
    #: one example (synthq.data.examples).
    examples: Mapped[list[dict[str, Any]] | None] = mapped_column(JsonType, nullable=True)
    #: The job's tokenize_version this result was computed at.
    tokenize_version: Mapped[int | None] = mapped_column(Integer)
    #: The row's ``{"tools": [...], "tool_choice": ...}``, sent with every call (None: no tools).
    tools: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    #: The tool calls of the (last) answer, OpenAI form.
    tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JsonType, nullable=True)
    # Regenerating every turn (jobs with regenerate=all; synthq.data.turns).
    #: The next turn to generate (0-based); the answers of the turns before it are stored.
    turn: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: Turns of the conversation (None: last-turn jobs, one call).
    turn_count: Mapped[int | None] = mapped_column(Integer)
    #: The answers so far, one per turn: ``{"content", "reasoning_content", "tool_calls",
    #: "finish_reason", "prompt_tokens", "completion_tokens"}``.
    turns: Mapped[list[dict[str, Any]] | None] = mapped_column(JsonType, nullable=True)
    #: The conversation ended after this turn (0-based): its answer did not fit the
    #: dataset's tool results. Why, in ``cut_reason``.
    cut_at_turn: Mapped[int | None] = mapped_column(Integer)
    cut_reason: Mapped[str | None] = mapped_column(Text)
    #: Settings of this sample that differ from its job's (``synthq requeue --max-tokens``
    #: ...): max_tokens, temperature, top_p, total_timeout, stall_timeout, max_attempts,
    #: extra_body, chat_template_kwargs.
    overrides: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    #: The server's completion token ids differ from ours (None: not compared).
    token_mismatch: Mapped[bool | None] = mapped_column(Boolean)
    #: The file name (``synthq_name``) the final answer's call asked the engine to write
    #: its hidden states under (jobs with capture_mode=inline); None: none asked.
    inline_capture: Mapped[str | None] = mapped_column(String(300), nullable=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    queued_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="samples", lazy="raise")


class Attempt(Base):
    """One call to a server for one sample: when, where, how it ended."""

    __tablename__ = "attempts"
    __table_args__ = (
        # The dispatcher's health check: a server's latest calls.
        Index("ix_attempts_server_id", "server", "id"),
        # The cost report: calls that ended after its fold, and in the last minute.
        Index("ix_attempts_ended_at", "ended_at"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    sample_id: Mapped[int] = mapped_column(
        ForeignKey("samples.id", ondelete="CASCADE"), index=True
    )
    server: Mapped[str] = mapped_column(String(500))
    worker: Mapped[str | None] = mapped_column(String(200))
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    #: ``ok``, a failure class, or ``lost`` (the worker died mid-call).
    outcome: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    latency_s: Mapped[float | None] = mapped_column(Float)
    #: Seconds to the first streamed chunk.
    ttft_s: Mapped[float | None] = mapped_column(Float)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    #: The turn this call generated (0-based; jobs with regenerate=all), None otherwise.
    turn: Mapped[int | None] = mapped_column(Integer)


class SampleCount(Base):
    """Samples per (job, state, error class, tokenize version, response stored), kept by
    triggers (migration 0016).

    On PostgreSQL each statement that changes samples appends delta rows (no
    writer waits on a hot counter row); a key may have several rows until the
    sweep folds them (:func:`synthq.store.counts.compact_counts`): read ``sum(n)``.
    On SQLite one row per key. Never written by the code, except the fold.
    """

    __tablename__ = "sample_counts"
    __table_args__ = (Index("ix_sample_counts_key", "job_id", "state", "error_class",
                            "tokenize_version", "answered"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    job_id: Mapped[int] = mapped_column(IdType)
    state: Mapped[str] = mapped_column(String(16))
    error_class: Mapped[str | None] = mapped_column(String(32))
    tokenize_version: Mapped[int | None] = mapped_column(Integer)
    #: Their response is stored (what retokenize can work on).
    answered: Mapped[bool] = mapped_column(Boolean)
    #: Samples; their examples' tokens and supervised tokens; those whose tokens
    #: differ from the server's (``token_mismatch``).
    n: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    supervised: Mapped[int] = mapped_column(BigInteger)
    mismatches: Mapped[int] = mapped_column(BigInteger)


class CallCount(Base):
    """Calls (attempt rows) per (job, server, outcome) and their completion tokens, kept
    like :class:`SampleCount`. Calls are history: deleting a sample keeps its calls."""

    __tablename__ = "call_counts"
    __table_args__ = (Index("ix_call_counts_key", "job_id", "server", "outcome"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    job_id: Mapped[int] = mapped_column(IdType)
    server: Mapped[str] = mapped_column(String(500))
    outcome: Mapped[str | None] = mapped_column(String(32))
    n: Mapped[int] = mapped_column(BigInteger)
    #: Completion tokens of those calls (0 where none were reported).
    tokens: Mapped[int] = mapped_column(BigInteger)


class Server(Base):
    """The last health probe of an inference server (``GET /health``), by base URL."""

    __tablename__ = "servers"

    url: Mapped[str] = mapped_column(String(500), primary_key=True)
    #: False while the server fails its probe: the dispatcher sends it nothing.
    healthy: Mapped[bool] = mapped_column(Boolean, default=True)
    checked_at: Mapped[datetime]
    #: Probes failed in a row (0 when healthy).
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    # The adaptive in-flight limit (synthq.serving.adaptive), for jobs run with --inflight auto.
    #: The controller's limit: the dispatcher queues up to it (None: not run yet).
    limit_target: Mapped[int | None] = mapped_column(Integer)
    #: The bound on queued + running now: the target, or while a lowered target
    #: drains, what was in flight when it was lowered (it follows the calls down).
    limit: Mapped[int | None] = mapped_column(Integer)
    #: Why it last changed, for people ("48 ↓ ttft 4.1 s = 3× baseline").
    limit_reason: Mapped[str | None] = mapped_column(Text)
    #: When the controller last ran for this server.
    limit_at: Mapped[datetime | None]
    #: The controller's memory between ticks (baselines, phase), a small JSON object.
    limit_state: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    #: Recent history for the job page's chart: ``[[unix time, limit, tok/s, done/s], ...]``.
    limit_history: Mapped[list[Any] | None] = mapped_column(JsonType, nullable=True)


class Worker(Base):
    """A process that runs generation calls (a Celery worker, or ``synthq run``).

    It heart-beats every few seconds. The dispatcher queues no more samples
    than the live workers' free capacity, and the sweep returns the running
    samples of a worker that stopped heart-beating to ``pending`` at once,
    without waiting for their leases.
    """

    __tablename__ = "workers"

    #: ``host:pid:random``, unique per process start (what ``samples.worker`` holds).
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    #: Calls this process may hold in flight at once.
    capacity: Mapped[int] = mapped_column(Integer)
    #: Calls in flight at the last heartbeat.
    inflight: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
    #: Seconds this process's wall clock ran ahead of the database's at its last
    #: heartbeat (negative: behind). synthq's times are the database's either way
    #: (synthq.core.clock); ``status`` names a machine whose clock is off.
    clock_skew: Mapped[float | None] = mapped_column(Float, nullable=True)


class TrainingRun(Base):
    """One EAGLE-3 drafter training run of a job's data (synthq.training)."""

    __tablename__ = "training_runs"
    __table_args__ = (Index("ix_training_runs_job_id_state", "job_id", "state"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    state: Mapped[RunState] = mapped_column(_enum(RunState))
    #: ``auto`` (the readiness check) or ``manual`` (``synthq train``).
    trigger: Mapped[str] = mapped_column(String(16))
    #: The target model (local path or Hugging Face id).
    target: Mapped[str] = mapped_column(String(1000))
    #: The TrainConfig, as a dict (also saved inside every checkpoint).
    settings: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    #: Logged steps: ``[{"step", "loss", "acc": [7 floats], "accept", "lr", "tokens"}, ...]``.
    metrics: Mapped[list[dict[str, Any]]] = mapped_column(JsonType, default=list)
    #: Where the export, cache, checkpoints and the final drafter go.
    output_dir: Mapped[str] = mapped_column(String(1000))
    #: The latest checkpoint: a resumable step directory while running, the
    #: vLLM-loadable drafter once done.
    checkpoint: Mapped[str | None] = mapped_column(String(1000))
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    #: The step the latest (re)start resumed from (0: from scratch).
    resumed_from: Mapped[int] = mapped_column(Integer, default=0)
    #: Served acceptance length measured by greedy draft-and-verify on the held-out
    #: split (the latest evaluation; the final one once done). Trust this, not the
    #: training estimate in ``metrics``.
    eval_acceptance_length: Mapped[float | None] = mapped_column(Float)
    #: The acceptance length a real engine served with this drafter (``synthq
    #: serve-check``: its spec-decode counters, 1 + accepted / drafts, on the same
    #: held-out prompts), and which engine and version measured it.
    served_acceptance_length: Mapped[float | None] = mapped_column(Float)
    served_engine: Mapped[str | None] = mapped_column(String(64))
    served_engine_version: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    #: ``--features stream``: the spool's bound (bytes), what it holds now (bytes, files),
    #: the most it held at once (bytes), and the examples captured ahead of the trainer.
    spool_size: Mapped[int | None] = mapped_column(BigInteger)
    spool_bytes: Mapped[int | None] = mapped_column(BigInteger)
    spool_files: Mapped[int | None] = mapped_column(Integer)
    spool_high_water: Mapped[int | None] = mapped_column(BigInteger)
    spool_lead: Mapped[int | None] = mapped_column(Integer)
    #: Random token of the process that holds the run; every write presents it.
    claim: Mapped[str | None] = mapped_column(String(32))
    worker: Mapped[str | None] = mapped_column(String(200))
    #: Renewed while the run trains; a stale one is handed to another worker.
    heartbeat_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class Capture(Base):
    """One sample's captured hidden states: a file in synthq's store, and how it got there.

    The same claims, leases, attempts and failure classes as generation, in a
    table of its own: a capture never changes its sample's row.
    """

    __tablename__ = "captures"
    __table_args__ = (
        # The stage's claim: due pending captures of a job, oldest first.
        Index("ix_captures_due", "job_id", "state", "next_attempt_at", "id"),
        # In flight per capture server (the exact limit), and the lease sweep.
        Index("ix_captures_server_state", "server", "state"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    sample_id: Mapped[int] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"),
                                           unique=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    state: Mapped[CaptureState] = mapped_column(_enum(CaptureState))
    #: The sample's tokenize_version whose input_ids were captured.
    tokenize_version: Mapped[int | None] = mapped_column(Integer)
    #: Calls made to a capture server for this sample.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None]
    #: Running: the capture process's lease.
    expires_at: Mapped[datetime | None]
    #: Random token; every transition out of running must present it.
    claim: Mapped[str | None] = mapped_column(String(32))
    worker: Mapped[str | None] = mapped_column(String(200))
    server: Mapped[str | None] = mapped_column(String(500))
    error_class: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    #: The file, relative to the store (``ab/abcd...safetensors``: its own sha256).
    path: Mapped[str | None] = mapped_column(String(200))
    sha256: Mapped[str | None] = mapped_column(String(64))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    num_tokens: Mapped[int | None] = mapped_column(Integer)
    layer_ids: Mapped[list[int] | None] = mapped_column(JsonType, nullable=True)
    dtype: Mapped[str | None] = mapped_column(String(16))
    #: The engine and its version (``vllm 0.32.0``) and the model it served.
    engine: Mapped[str | None] = mapped_column(String(64))
    engine_model: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class CaptureCall(Base):
    """One call to a capture server: where and how it ended (what ``attempts`` is to
    generation). The "server is down" rule reads a server's latest calls
    (:mod:`synthq.queue.outage`), so every capture process sees one server alike."""

    __tablename__ = "capture_calls"
    __table_args__ = (
        # The down rule: a server's latest calls.
        Index("ix_capture_calls_server_id", "server", "id"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    capture_id: Mapped[int] = mapped_column(
        ForeignKey("captures.id", ondelete="CASCADE"), index=True)
    server: Mapped[str] = mapped_column(String(500))
    ended_at: Mapped[datetime]
    #: ``ok`` or a failure class.
    outcome: Mapped[str] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)


class SpoolItem(Base):
    """One example of one epoch of a streamed training run (``--features stream``): the
    spool's consumption, a kind of leased work (synthq.queue.spool_states), and the ledger's
    record of which example the run consumed in which epoch."""

    __tablename__ = "spool_items"
    __table_args__ = (
        UniqueConstraint("run_id", "epoch", "example"),
        # A rank's rows by state (the spool's files, the lead, what a commit moves).
        Index("ix_spool_items_run_rank_state", "run_id", "rank", "state"),
        # In flight per capture server (its one capture limit), and the lease sweep.
        Index("ix_spool_items_server_state", "server", "state"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"))
    epoch: Mapped[int] = mapped_column(Integer)
    #: The DDP rank whose shard holds it (its spool folder).
    rank: Mapped[int] = mapped_column(Integer)
    #: The example's id (``SAMPLE`` or ``SAMPLE:TURN``, as the export names it).
    example: Mapped[str] = mapped_column(String(64))
    state: Mapped[SpoolState] = mapped_column(_enum(SpoolState))
    #: Training: the run's claim token; the run's heartbeat is the lease of what it holds.
    claim: Mapped[str | None] = mapped_column(String(32))
    worker: Mapped[str | None] = mapped_column(String(200))
    expires_at: Mapped[datetime | None]
    #: The file in the rank's spool folder (``ab/abcd...safetensors``: its sha256), while
    #: it is there, and its size.
    path: Mapped[str | None] = mapped_column(String(200))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    #: The run's step that trained on it.
    step: Mapped[int | None] = mapped_column(Integer)
    #: The capture server of its latest capture call (while ``capturing``: the server whose
    #: capture limit it holds).
    server: Mapped[str | None] = mapped_column(String(500))
    #: Calls to a capture server that stored its file for this epoch (0: kept in the spool
    #: from an earlier epoch).
    captures: Mapped[int] = mapped_column(Integer, default=0)
    error_class: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class ApiSession(Base):
    """A login to the job page: its cookie's sha256 (never the value itself) and expiry.

    Logging out deletes the row, so the old cookie no longer opens anything.
    """

    __tablename__ = "api_sessions"

    #: sha256 hex of the random cookie value.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]

"""Request and response bodies: separate create and public shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from synthq.enqueue import JobSpec, inflight_settings
from synthq.query import SampleRow


class JobSettings(BaseModel):
    """Generation and tokenization settings, as `synthq enqueue` takes them."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="Job name [default: the dataset's file name]. "
                             "The same name and settings again adds to the job.")
    model: str = Field(description="Model name the servers serve.")
    servers: list[str] = Field(min_length=1, description="Base URLs of OpenAI-compatible "
                               "servers, e.g. http://vllm:8000/v1.")
    max_tokens: int = 4096
    temperature: float | None = None
    top_p: float | None = None
    timeout: float = Field(1800.0, description="Total seconds one call may take.")
    stall_timeout: float = 300.0
    max_attempts: int = 5
    backoff_base: float = 2.0
    backoff_cap: float = 300.0
    inflight: int | Literal["auto"] = Field(64, description="Most requests in flight per "
                                            "server, or `auto` (adaptive, per server).")
    max_inflight: int | None = Field(None, description="With inflight=auto: the hard cap per "
                                     "server [default: 256].")
    min_inflight: int | None = Field(None, description="With inflight=auto: the floor per "
                                     "server [default: 4].")
    gpus: int = Field(1, description="GPUs behind each server (cost report).")
    gpu_hour_price: float | None = Field(None, description="Dollars per GPU-hour [default: "
                                         "SYNTHQ_GPU_HOUR_PRICE].")
    keep_truncated: bool = False
    stream: bool = Field(True, description="Stream answers (stall clock). False: one plain "
                         "call per sample, less CPU, the total timeout only.")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    return_token_ids: bool = False
    id_field: str | None = None
    tokenizer: str | None = Field(None, description="The target's tokenizer (path or id).")
    chat_template: str | None = Field(None, description="Chat template text overriding the "
                                      "tokenizer's own.")
    max_seq_len: int = 4096
    reasoning: Literal["auto", "keep", "drop"] = "auto"
    mask: Literal["last_turn", "all_assistant_turns"] | None = Field(
        None, description="[default: all_assistant_turns with regenerate=all, else last_turn]")
    think_open: str = "<think>\n"
    think_close: str = "\n</think>\n\n"
    regenerate: Literal["last", "all"] = Field("last", description="last: regenerate the last "
                                               "assistant turn; all: every assistant turn, "
                                               "each on the regenerated history.")
    history_reasoning: Literal["drop", "keep"] = Field(
        "drop", description="regenerate=all: send earlier turns' reasoning_content too (keep).")
    examples: Literal["conversation", "per-turn"] | None = Field(
        None, description="regenerate=all: one training example per conversation, or one per "
        "regenerated turn [default: per-turn where the template cannot mask several turns "
        "at once, else conversation].")

    def to_spec(self, default_name: str) -> JobSpec:
        """The JobSpec `synthq enqueue` would make from the same options."""
        sampling: dict[str, Any] = {}
        if self.temperature is not None:
            sampling["temperature"] = self.temperature
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        body = dict(self.extra_body)
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.return_token_ids:
            body["return_token_ids"] = True
        return JobSpec(
            name=self.name or default_name or "job", model=self.model,
            servers=[s.rstrip("/") for s in self.servers], max_tokens=self.max_tokens,
            sampling=sampling, extra_body=body, total_timeout=self.timeout,
            stall_timeout=self.stall_timeout, max_attempts=self.max_attempts,
            backoff_base=self.backoff_base, backoff_cap=self.backoff_cap,
            **inflight_settings(self.inflight, self.max_inflight, self.min_inflight),
            gpus=self.gpus, gpu_hour_price=self.gpu_hour_price,
            keep_truncated=self.keep_truncated, stream=self.stream,
            tokenizer=self.tokenizer, chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs, max_seq_len=self.max_seq_len,
            reasoning=self.reasoning, mask=self.mask, think_open=self.think_open,
            think_close=self.think_close, regenerate=self.regenerate,
            history_reasoning=self.history_reasoning, examples=self.examples)


class JobCreate(JobSettings):
    """A job from a file on the server (under the data directory) or a Hugging Face id."""

    path: str | None = Field(None, description="A JSONL/Parquet file or directory, relative "
                             "to the server's data directory.")
    hf_dataset: str | None = Field(None, description="A Hugging Face dataset id, "
                                   "`name[:split]`.")

    @model_validator(mode="after")
    def _one_source(self) -> JobCreate:
        if (self.path is None) == (self.hf_dataset is None):
            raise ValueError("give exactly one of path and hf_dataset")
        return self


class RowError(BaseModel):
    row: int = Field(description="0-based index of the row in the file.")
    reason: str


class EnqueueResult(BaseModel):
    job_id: int
    job_name: str
    created: bool
    rows: int
    inserted: int
    duplicates: int
    skipped: int
    updated_settings: list[str]
    warnings: list[str]
    #: Every malformed row (up to 1,000) with its reason.
    bad_rows: list[RowError] = Field(default_factory=list)


# The job list's items are synthq.query.JobSummary itself.


# A job's status is synthq.status.JobStatus itself (the record `synthq status --json`
# prints): GET /api/jobs/{job} answers it as its response model, so the two cannot drift.


class TrainingRunSummary(BaseModel):
    """A drafter training run: synthq's own estimate and what a real engine served."""

    id: int
    job_id: int
    state: str
    step: int
    total_steps: int | None = None
    loss: float | None = None
    #: Teacher-forced estimate from training accuracies (optimistic).
    accept: float | None = None
    #: synthq's greedy draft-and-verify on the held-out split.
    eval_acceptance_length: float | None = None
    #: Measured by a real engine serving the drafter (``synthq serve-check``): trust this.
    served_acceptance_length: float | None = None
    served_engine: str | None = None
    served_engine_version: str | None = None
    checkpoint: str | None = None
    error: str | None = None


class JobStateChange(BaseModel):
    id: int
    name: str
    before: str
    state: str


class RequeueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    classes: list[str] = Field(default_factory=list, description="Only failures of these "
                               "classes (timeout, server_error, ...).")
    sample_ids: list[int] = Field(default_factory=list, max_length=10_000,
                                  description="Only these samples (at most 10,000 a call).")
    inflight: int | Literal["auto"] | None = Field(None, description="The servers' in-flight "
                                                   "limit from now on: a number or `auto`.")
    max_inflight: int | None = Field(None, description="With inflight=auto: the hard cap.")
    min_inflight: int | None = Field(None, description="With inflight=auto: the floor.")
    # Settings of the requeued samples only (stored per sample), as `synthq requeue` takes them.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    timeout: float | None = Field(None, description="Total seconds one call may take.")
    stall_timeout: float | None = None
    max_attempts: int | None = None
    extra_body: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def overrides(self) -> dict[str, Any]:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    total_timeout=self.timeout, stall_timeout=self.stall_timeout,
                    max_attempts=self.max_attempts, extra_body=self.extra_body,
                    chat_template_kwargs=self.chat_template_kwargs)


class RequeueResult(BaseModel):
    requeued: int


class SamplePage(BaseModel):
    #: Each sample as synthq.query.SampleRow (one record, no copy to keep in step).
    items: list[SampleRow]
    #: Pass as ``after`` for the next page; null on the last one.
    next_after: int | None


# One sample in full is synthq.query.SampleDetail itself (what `synthq sample --json`
# prints), the response model of GET /api/samples/{id}.


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["parquet", "jsonl"] = "parquet"
    shard_size: int = Field(10_000, ge=1, le=10_000_000)
    include_truncated: bool = True
    allow_stale: bool = False


class ExportPublic(BaseModel):
    id: str
    job_id: int
    format: str
    state: Literal["running", "done", "failed"]
    error: str | None
    started_at: str
    finished_at: str | None
    files: list[str]
    manifest: dict[str, Any] | None


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    detail: str

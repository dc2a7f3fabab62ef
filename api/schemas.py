"""Request and response bodies: separate create and public shapes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from synthq.jobs.enqueue import EnqueueReport, JobSpec
from synthq.spec import jobspec
from synthq.spec.jobspec import Setting
from synthq.training.runs import RunRecord
from synthq.views.query import SampleRow


def _field(s: Setting, *, requeue: bool = False) -> tuple[Any, Any]:
    """A pydantic field of setting ``s``: its type, default and description, its bounds
    and choices shown in the schema. The values are checked by synthq.spec.jobspec.check (in
    :meth:`JobSettings.to_spec` and the requeue), as the CLI's are, with the same message."""
    kinds: dict[type, Any] = {list: list[s.item], dict: dict[str, Any]}
    kind: Any = kinds.get(s.type, s.type)
    if s.name == "inflight":
        kind = int | Literal["auto"]
    extra: dict[str, Any] = {}
    if s.choices:
        extra["enum"] = list(s.choices)
    if s.low is not None:
        extra["exclusiveMinimum" if s.low_open else "minimum"] = s.low
    if s.high is not None:
        extra["exclusiveMaximum" if s.high_open else "maximum"] = s.high
    if s.max_len is not None:
        extra["maxLength"] = s.max_len
    description = (s.requeue_help if requeue and s.requeue_help else s.help).replace("`", "")
    if requeue or s.default is None and not s.required:
        omitted = "the job's" if requeue and s.requeue == "sample" else s.omitted
        if omitted:
            description += f" [default: {omitted}]"
        return kind | None, Field(None, description=description, json_schema_extra=extra)
    if s.required:
        return kind, Field(description=description, json_schema_extra=extra,
                           min_length=1 if s.type is list else None)
    if s.type is dict:
        return kind, Field(default_factory=dict, description=description,
                           json_schema_extra=extra)
    default = int(s.default) if s.name == "inflight" else s.default
    return kind, Field(default, description=description, json_schema_extra=extra)


class _JobSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    if TYPE_CHECKING:  # a field of each setting is added by create_model below
        id_field: str | None

    def to_spec(self, default_name: str) -> JobSpec:
        """The JobSpec `synthq enqueue` would make from the same options (both through
        synthq.jobs.enqueue.build_spec, which checks each value)."""
        from synthq.jobs.enqueue import build_spec

        return build_spec(self.model_dump(), source=default_name)


if TYPE_CHECKING:  # the fields are made at import; a type checker sees the base
    JobSettings = _JobSettings
else:
    #: Generation and tokenization settings, as `synthq enqueue` takes them (synthq.spec.jobspec).
    JobSettings = create_model(
        "JobSettings", __base__=_JobSettings, __doc__="Generation and tokenization settings, "
        "as `synthq enqueue` takes them.", **{s.name: _field(s) for s in jobspec.SETTINGS})


if TYPE_CHECKING:
    CaptureSettings = CaptureSettingsPublic = BaseModel
else:
    #: The capture stage's settings, as `synthq capture` takes them (synthq.spec.jobspec.CAPTURE):
    #: a setting declared there is a field here, with its checks, and nothing else is.
    CaptureSettings = create_model(
        "CaptureSettings", __config__=ConfigDict(extra="forbid"), __doc__="The capture "
        "stage's settings, as `synthq capture` takes them; an omitted one is kept.",
        **{s.name: (_field(s)[0] | None, Field(None, description=_field(s)[1].description,
                                               json_schema_extra=_field(s)[1].json_schema_extra))
           for s in jobspec.CAPTURE})
    #: The job's capture settings after a change. Those naming servers (capture_servers,
    #: capture_files) are not echoed: a URL may carry credentials, and GET /api/jobs/{id}
    #: shows the capture servers masked.
    CaptureSettingsPublic = create_model(
        "CaptureSettingsPublic", __doc__="The job's capture settings after the change (the "
        "servers' URLs are in GET /api/jobs/{id}, masked).",
        **{s.name: (_field(s)[0] | None, Field(description=_field(s)[1].description))
           for s in jobspec.CAPTURE if not s.urls})


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


def _report_fields() -> dict[str, Any]:
    """A pydantic field per field of synthq.jobs.enqueue.EnqueueReport, with its type and
    default: the API answers the record `synthq enqueue --json` prints, not a copy of it."""
    hints = get_type_hints(EnqueueReport)
    return {f.name: (hints[f.name],
                     Field(default_factory=f.default_factory)
                     if f.default_factory is not dataclasses.MISSING
                     else ... if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(EnqueueReport)}


if TYPE_CHECKING:
    EnqueueResult = BaseModel
else:
    #: The enqueue's outcome: every field of synthq.jobs.enqueue.EnqueueReport, then the
    #: malformed rows and the one-line message.
    EnqueueResult = create_model(
        "EnqueueResult", __doc__="The enqueue's report (every field `synthq enqueue --json` "
        "prints), with the malformed rows and a one-line message.", **_report_fields(),
        bad_rows=(list[RowError], Field(
            default_factory=list, description="Every malformed row (up to 1,000) with its "
            "reason: kept in the job as a skipped sample, while the other rows run (a "
            "malformed row never stops a job).")),
        message=(str, Field("", description="What happened, in one line: the job created "
                            "(or found), the samples to run, and the rows skipped.")))


# The job list's items are synthq.views.query.JobSummary itself.


# A job's status is synthq.views.report.JobStatus itself (the record `synthq status --json`
# prints): GET /api/jobs/{job} answers it as its response model, so the two cannot drift.


#: A drafter training run: synthq.training.runs.RunRecord, the record `synthq runs --json`
#: prints (one definition for both).
TrainingRunSummary = RunRecord


class JobStateChange(BaseModel):
    id: int
    name: str
    before: str
    state: str


class _RequeueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    classes: list[str] = Field(default_factory=list, description="Only failures of these "
                               "classes (timeout, server_error, ...).")
    sample_ids: list[int] = Field(default_factory=list, max_length=10_000,
                                  description="Only these samples (at most 10,000 a call).")

    def settings(self) -> dict[str, Any]:
        """The requeue's settings given (synthq.spec.jobspec.requeue_settings checks them)."""
        return {k: v for k, v in self.model_dump().items()
                if k in jobspec.BY_NAME and v is not None}


#: A requeue: which samples, and the settings of the requeued samples only (stored per
#: sample) or of the job from now on (its in-flight limit), as `synthq requeue` takes them.
if TYPE_CHECKING:
    RequeueRequest = _RequeueRequest
else:
    RequeueRequest = create_model(
        "RequeueRequest", __base__=_RequeueRequest,
        **{s.name: _field(s, requeue=True) for s in jobspec.SETTINGS if s.requeue})


class RequeueResult(BaseModel):
    requeued: int


class SamplePage(BaseModel):
    #: Each sample as synthq.views.query.SampleRow (one record, no copy to keep in step).
    items: list[SampleRow]
    #: Pass as ``after`` for the next page; null on the last one.
    next_after: int | None


# One sample in full is synthq.views.query.SampleDetail itself (what `synthq sample --json`
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

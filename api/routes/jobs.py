"""Jobs: create (server-side path, Hugging Face id, upload), list, status, steer, requeue."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, File, Form, HTTPException, Request, Response, UploadFile, status
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from api.deps import JobDep, JobRef, SessionDep, SettingsDep, job_or_404
from api.schemas import (
    CaptureSettings,
    CaptureSettingsPublic,
    EnqueueResult,
    ErrorBody,
    JobCreate,
    JobSettings,
    JobStateChange,
    RequeueRequest,
    RequeueResult,
    RowError,
    TrainingRunSummary,
)
from synthq.app import service
from synthq.core.enums import JobState
from synthq.core.errors import UserError
from synthq.jobs.enqueue import EnqueueReport, JobSpec
from synthq.spec import jobspec
from synthq.store.db import safe_url, session_scope
from synthq.views import query
from synthq.views.report import JobStatus, job_status

router = APIRouter(prefix="/api/jobs", tags=["jobs"])

ERRORS: dict[int | str, dict[str, object]] = {
    404: {"model": ErrorBody, "description": "No such job."},
    422: {"model": ErrorBody, "description": "Invalid input."},
}
#: Creating a job: also 403 for a server outside SYNTHQ_ALLOWED_SERVERS.
CREATE_ERRORS: dict[int | str, dict[str, object]] = {
    **ERRORS, 403: {"model": ErrorBody, "description": "A server outside "
                    "SYNTHQ_ALLOWED_SERVERS."}}


def _result(r: EnqueueReport, bad: list[tuple[int, str]]) -> EnqueueResult:
    return EnqueueResult(**asdict(r), bad_rows=[RowError(row=i, reason=reason)
                                               for i, reason in bad],
                         message=_message(r, bad))


def _message(r: EnqueueReport, bad: list[tuple[int, str]]) -> str:
    """``job up (id 3) created: 8 rows read, 5 new samples to run; 3 malformed rows
    skipped (rows 1, 3, 7; bad_rows gives each reason)``."""
    line = (f"job {r.job_name} (id {r.job_id}) {'created' if r.created else 'found'}: "
            f"{r.rows:,} rows read, {r.inserted - r.skipped:,} new samples to run, "
            f"{r.duplicates:,} already in the job")
    if r.skipped:
        rows = ", ".join(str(i) for i, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
        line += (f"; {r.skipped:,} malformed rows skipped (rows {rows}, counted from 0; "
                 "bad_rows gives each reason)")
    return line


_JOB_LIST = TypeAdapter(list[query.JobSummary])


def _job_list_json() -> bytes:
    with session_scope() as session:
        jobs = query.list_jobs(session)
    return _JOB_LIST.dump_json(_JOB_LIST.validate_python(jobs, from_attributes=True))


@router.get("", response_model=list[query.JobSummary], summary="List jobs")
async def list_jobs(request: Request) -> Response:
    # Identical lists at once share one query (api.coalesce); a change through the API
    # shows on the next read, one made elsewhere within 1 s.
    body = await request.app.state.reads.get("/api/jobs", _job_list_json)
    return Response(body, media_type="application/json")


#: A Hugging Face dataset id: ``name``, ``owner/name``, optionally ``:split``.
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?"
                   r"(:[A-Za-z0-9_.-]{1,64})?$")
HF_ID_ERROR = ("hf_dataset must be a Hugging Face dataset id (name or owner/name, optionally "
               ":split); for a file on the server, give path (relative to the data directory)")


def _hf_source(hf: str) -> str:
    """``hf`` if it can only mean a Hub dataset; never a file of the server (one message)."""
    name = hf.rpartition(":")[0] if ":" in hf else hf
    if not HF_ID.match(hf) or ".." in hf or os.path.lexists(name) or os.path.lexists(hf):
        raise HTTPException(422, HF_ID_ERROR)
    return hf


#: A Hugging Face model id: ``name`` or ``owner/name`` (no split, no revision).
HF_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?$")


def _tokenizer_source(data_dir: Path, tokenizer: str | None) -> str | None:
    """``tokenizer`` as the API may load it: a Hub model id, or a folder inside the data
    directory (made absolute); never another path of the server (``/etc``, ``~``, ``..``),
    which transformers would open and parse. Confined as ``hf_dataset`` and ``path`` are."""
    if tokenizer is None:
        return None
    root = data_dir.expanduser()
    if HF_MODEL_ID.match(tokenizer) and ".." not in tokenizer and \
            not os.path.lexists(tokenizer) and not os.path.lexists(root / tokenizer):
        return tokenizer
    try:
        path = service.data_path(data_dir, tokenizer)
    except UserError:
        raise HTTPException(422, "tokenizer must be a Hugging Face model id (name or "
                            "owner/name) or a folder inside the data directory") from None
    if not path.is_dir():
        raise HTTPException(422, "tokenizer must be a folder (holding tokenizer.json), not a "
                            "file")
    return str(path)


def _scrub(message: str, *paths: tuple[str, str]) -> str:
    """An error message without the server's own paths (temp folders, data directory)."""
    for path, shown in (*paths, (os.getcwd() + os.sep, "")):
        message = message.replace(path, shown)
    return safe_url(message)


def check_servers(servers: list[str]) -> None:
    """403 for a server outside SYNTHQ_ALLOWED_SERVERS (before anything is sent to it)."""
    from synthq.core.secrets import refused_servers
    from synthq.spec.config import get_settings

    why = refused_servers(servers, get_settings().allowed_server_patterns)
    if why is not None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, why)


def _check_model(spec: JobSpec) -> list[str]:
    """The CLI's checks of the servers (synthq.app.service.preflight): a server that lists its
    models but not this one, or a capture server that does not answer, is a 422."""
    spec.check()
    check_servers(jobspec.urls(spec))  # before the probe: the API host fetches nothing else
    return service.preflight(spec)


def _created(report: EnqueueReport, bad: list[tuple[int, str]], warnings: list[str]) -> Response:
    report.warnings[:0] = warnings
    result = _result(report, bad)
    # Malformed rows never stop a job (docs/design.md, invariant 8): the job is made and
    # its good rows run, so the answer is 201, its body naming each row skipped and why.
    return JSONResponse(result.model_dump(mode="json"), status_code=status.HTTP_201_CREATED)


@router.post("", response_model=EnqueueResult, status_code=status.HTTP_201_CREATED,
             responses=CREATE_ERRORS, summary="Create a job (or add to one) from a server-side "
             "path or a Hugging Face dataset")
def create_job(body: JobCreate, settings: SettingsDep) -> Response:
    if body.path is not None:
        source = str(service.data_path(settings.data_dir, body.path))
    else:
        source = _hf_source(str(body.hf_dataset))
    name = Path(source.rstrip("/")).name.split(".")[0]
    # Confined before the spec is made: its checks would open the path otherwise.
    body = body.model_copy(update={
        "tokenizer": _tokenizer_source(settings.data_dir, body.tokenizer)})
    spec = body.to_spec(name)
    warnings = _check_model(spec)
    root = str(settings.data_dir.expanduser().resolve())
    try:
        report, bad = service.enqueue_file(spec, source, id_field=body.id_field)
    except UserError as exc:
        raise UserError(_scrub(str(exc), (root + os.sep, ""), (root, "."))) from None
    return _created(report, bad, warnings)


@router.post("/upload", response_model=EnqueueResult, status_code=status.HTTP_201_CREATED,
             responses={**CREATE_ERRORS, 413: {"model": ErrorBody,
                                               "description": "File too large."}},
             summary="Create a job (or add to one) from an uploaded JSONL or Parquet file")
def upload_job(file: Annotated[UploadFile, File(description="JSONL (.jsonl, .json, .gz) or "
                                                 "Parquet file.")],
               spec: Annotated[str, Form(description="JobSettings as a JSON object.")],
               settings: SettingsDep) -> Response:
    try:
        job_settings = JobSettings.model_validate(json.loads(spec))
    except (ValueError, ValidationError) as exc:
        raise HTTPException(422,
                            f"spec is not valid JobSettings JSON: {exc}") from None
    filename = Path(file.filename or "upload.jsonl").name
    suffix = _upload_suffix(filename)
    job_settings = job_settings.model_copy(update={
        "tokenizer": _tokenizer_source(settings.data_dir, job_settings.tokenizer)})
    job_spec = job_settings.to_spec(filename.split(".")[0])
    warnings = _check_model(job_spec)
    limit = settings.api_upload_max_bytes
    settings.uploads_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.uploads_dir) as tmp:
        # A .gz is stored decompressed: the limit holds for what is read, not what was sent.
        path = Path(tmp) / f"upload{suffix.removesuffix('.gz')}"
        with path.open("wb") as out:
            gz = suffix.endswith(".gz")
            reader = gzip.GzipFile(fileobj=file.file, mode="rb") if gz else file.file
            size = 0
            try:
                while chunk := reader.read(1 << 20):
                    size += len(chunk)
                    if size > limit:
                        what = "decompressed file" if reader is not file.file else "file"
                        raise HTTPException(413, f"{what} is over {limit:,} bytes")
                    out.write(chunk)
            except (OSError, EOFError, zlib.error) as exc:
                raise HTTPException(422, f"{filename} is not a valid gzip file: "
                                    f"{type(exc).__name__}") from None
        if suffix == ".parquet":
            _check_parquet_size(path, limit)
        try:
            report, bad = service.enqueue_file(job_spec, str(path),
                                               id_field=job_settings.id_field)
        except UserError as exc:
            raise UserError(_scrub(str(exc), (str(path), filename), (tmp, "."))) from None
        shutil.rmtree(tmp, ignore_errors=True)
    return _created(report, bad, warnings)


def _check_parquet_size(path: Path, limit: int) -> None:
    """A Parquet file's uncompressed size (from its footer) counts against the limit too."""
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    except Exception:  # noqa: BLE001 - not Parquet: the dataset reader says why
        return
    if size > limit:
        raise HTTPException(413, f"uncompressed file is over {limit:,} bytes")


def _upload_suffix(filename: str) -> str:
    """The data suffix of an uploaded file's name; 422 for any other."""
    lower = filename.lower()
    for suffix in (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet"):
        if lower.endswith(suffix):
            return suffix
    if "." not in filename:
        return ".jsonl"
    raise HTTPException(422, "the file name must end in .jsonl, .json, .jsonl.gz, .json.gz or "
                        ".parquet")


@router.get("/{job}", response_model=JobStatus, responses=ERRORS,
            summary="Counts per state, done/s, ETA, failures, calls, load, workers")
def get_job(job: JobDep, session: SessionDep) -> JobStatus:
    # The record `synthq status --json` prints, as it is (its URLs masked there).
    return job_status(session, job)


@router.get("/{job}/training-runs", response_model=list[TrainingRunSummary], responses=ERRORS,
            summary="The job's drafter training runs: eval and served acceptance length")
def get_training_runs(job: JobDep, session: SessionDep) -> list[TrainingRunSummary]:
    from synthq.training.runs import list_runs  # no torch

    return [TrainingRunSummary(**r) for r in list_runs(session, job.id)]


def _set_state(ref: str, target: JobState) -> JobStateChange:
    with session_scope() as s:
        job = job_or_404(s, ref)
        before = service.set_job_state(s, job, target)
        return JobStateChange(id=job.id, name=job.name, before=before, state=str(job.state))


@router.post("/{job}/pause", response_model=JobStateChange, responses=ERRORS,
             summary="Stop dispatching the job's samples")
def pause(job: JobRef) -> JobStateChange:
    return _set_state(job, JobState.PAUSED)


@router.post("/{job}/resume", response_model=JobStateChange, responses=ERRORS,
             summary="Dispatch a paused job again")
def resume(job: JobRef) -> JobStateChange:
    return _set_state(job, JobState.ACTIVE)


@router.post("/{job}/cancel", response_model=JobStateChange, responses=ERRORS,
             summary="Stop a job for good (its data stays)")
def cancel(job: JobRef) -> JobStateChange:
    return _set_state(job, JobState.CANCELLED)


@router.put("/{job}/capture", response_model=CaptureSettingsPublic, responses=ERRORS,
            summary="Set the job's capture settings, as `synthq capture` does (an omitted "
            "one is kept); the stage runs under `synthq capture` or the tick")
def set_capture(job: JobRef, body: CaptureSettings,
                settings: SettingsDep) -> CaptureSettingsPublic:
    given = jobspec.check_values(body.model_dump(exclude_unset=True))
    check_servers(jobspec.named_urls(given))  # before the probe, as at create
    if given.get("train_target") is not None:  # a folder the server opens: confined
        given["train_target"] = str(_data_folder(settings.data_dir, given["train_target"],
                                                 "train_target"))
    if given.get("capture_files"):  # folders the server reads and deletes in: confined
        given["capture_files"] = {
            url: str(_data_folder(settings.data_dir, folder, "capture_files")) if folder else ""
            for url, folder in given["capture_files"].items()}
    with session_scope() as s:
        return CaptureSettingsPublic(**service.set_capture(s, job_or_404(s, job), given))


def _data_folder(data_dir: Path, relative: str, name: str) -> Path:
    """``relative``: a folder inside the data directory, or a 422 naming ``name``."""
    try:
        folder = service.data_path(data_dir, relative)
    except UserError:
        raise HTTPException(422, f"{name} must be a folder inside the data "
                            "directory") from None
    if not folder.is_dir():
        raise HTTPException(422, f"{name} must be a folder"
                            + (" (holding config.json)" if name == "train_target" else ""))
    return folder


@router.post("/{job}/requeue", response_model=RequeueResult, responses=ERRORS,
             summary="Failed samples (all, of some classes, or by id) back to pending")
def requeue(job: JobRef, body: RequeueRequest) -> RequeueResult:
    settings = body.settings()
    with session_scope() as s:
        j = job_or_404(s, job)
        n = service.requeue_with(s, j, classes=body.classes, sample_ids=body.sample_ids,
                                 settings=settings)
        return RequeueResult(requeued=n)

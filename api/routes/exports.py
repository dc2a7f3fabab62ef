"""Exports: start one as a background task, follow it, download its files."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status
from fastapi.responses import FileResponse

from api.deps import JobDep, SettingsDep
from api.routes.jobs import ERRORS
from api.schemas import ErrorBody, ExportPublic, ExportRequest
from synthq.jobs import export_runs

router = APIRouter(tags=["exports"])

RunId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="Export id.")]


@router.post("/api/jobs/{job}/exports", response_model=ExportPublic,
             responses={**ERRORS, 429: {"model": ErrorBody, "description": "Too many exports "
                                        "running."}},
             status_code=status.HTTP_202_ACCEPTED,
             summary="Start exporting the job's done samples (Parquet or JSONL shards)")
def start_export(job: JobDep, body: ExportRequest, settings: SettingsDep) -> ExportPublic:
    if body.format == "parquet" and not job.tokenizer:
        # Known now: refuse up front rather than answer 202 and fail in the background.
        raise HTTPException(422, "job has no tokenizer: parquet needs input_ids; use format "
                            "jsonl or set one with synthq retokenize")
    try:
        run = export_runs.start(settings.exports_dir, job.id, fmt=body.format,
                                shard_size=body.shard_size,
                                include_truncated=body.include_truncated,
                                allow_stale=body.allow_stale)
    except export_runs.Busy as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc),
                            headers={"Retry-After": "30"}) from None
    return ExportPublic(**run.to_dict())


def _run(settings: SettingsDep, export_id: str) -> export_runs.ExportRun:
    run = export_runs.get(settings.exports_dir, export_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no export {export_id}")
    return run


@router.get("/api/exports/{export_id}", response_model=ExportPublic,
            responses={404: ERRORS[404]}, summary="An export's state, files and manifest")
def get_export(export_id: RunId, settings: SettingsDep) -> ExportPublic:
    return ExportPublic(**_run(settings, export_id).to_dict())


@router.get("/api/exports/{export_id}/files/{name}", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}},
                       404: ERRORS[404]},
            summary="Download one file of a finished export (a shard or manifest.json)")
def download(export_id: RunId, name: Annotated[str, Path(max_length=200)],
             settings: SettingsDep) -> FileResponse:
    path = export_runs.file_path(settings.exports_dir, _run(settings, export_id), name)
    if path is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no file {name} in this export")
    return FileResponse(path, filename=name, media_type="application/octet-stream")

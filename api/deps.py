"""Dependencies shared by the routes (``Annotated`` aliases)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, status
from sqlalchemy.orm import Session

from api.config import ApiSettings, api_settings
from synthq.core.errors import UserError
from synthq.jobs.enqueue import find_job
from synthq.store.db import session_scope
from synthq.store.models import Job


def get_session() -> Iterator[Session]:
    """A read session; routes that write open their own transaction (session_scope)."""
    with session_scope() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[ApiSettings, Depends(api_settings)]
JobRef = Annotated[str, Path(description="Job id or name.", max_length=200)]


def job_or_404(session: Session, ref: str) -> Job:
    if "\x00" in ref or ref.isdigit() and (not ref.isascii() or int(ref) > 2**62):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such job")
    try:
        return find_job(session, ref)
    except UserError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None


def get_job(session: SessionDep, job: JobRef) -> Job:
    return job_or_404(session, job)


JobDep = Annotated[Job, Depends(get_job)]

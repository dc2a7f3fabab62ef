"""Samples: a job's samples with filters and keyset pagination; one sample in full."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status

from api.deps import JobDep, SessionDep
from api.routes.jobs import ERRORS
from api.schemas import SamplePage
from synthq.core.enums import SampleState
from synthq.views import query

router = APIRouter(tags=["samples"])


@router.get("/api/jobs/{job}/samples", response_model=SamplePage, responses=ERRORS,
            summary="A job's samples in id order, filtered; pass next_after as after")
def list_samples(
    job: JobDep, session: SessionDep,
    state: Annotated[SampleState | None, Query()] = None,
    error_class: Annotated[str | None, Query(max_length=32)] = None,
    server: Annotated[str | None, Query(max_length=500)] = None,
    after: Annotated[int, Query(ge=0, le=2**62, description="Last id of the previous "
                                "page.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SamplePage:
    items, next_after = query.list_samples(session, job.id, state=state,
                                           error_class=error_class, server=server,
                                           after=after, limit=limit)
    return SamplePage(items=items, next_after=next_after)


@router.get("/api/samples/{sample_id}", response_model=query.SampleDetail,
            responses={404: ERRORS[404]},
            summary="One sample: prompt, answer, reasoning, attempts, tokens, mask runs")
def get_sample(sample_id: Annotated[int, Path(ge=1, le=2**62)],
               session: SessionDep) -> query.SampleDetail:
    detail = query.sample_detail(session, sample_id)
    if detail is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no sample {sample_id}")
    return detail  # the record `synthq sample --json` prints

"""The job page at /ui: server-rendered Jinja templates, no front-end build step.

Pages read through :mod:`synthq.views.query` and :func:`synthq.views.report.job_status`;
their forms change state through :mod:`synthq.app.service`, like the API routes.
The token is typed once at /ui/login and kept as an HttpOnly, SameSite=Strict
session cookie; every form carries a CSRF field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Form, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from api.auth import (
    COOKIE,
    CsrfDep,
    UiDep,
    check_token,
    csrf_value,
    end_session,
    new_session,
    session_of,
)
from api.deps import JobRef, SessionDep, SettingsDep, job_or_404
from synthq.app import service
from synthq.capture.progress import size
from synthq.core.enums import JobState
from synthq.core.errors import UserError
from synthq.queue.workers import live
from synthq.spec.config import get_settings
from synthq.store.db import safe_url, session_scope, utcnow
from synthq.views import query
from synthq.views.report import job_status

router = APIRouter(prefix="/ui", include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).resolve().parents[1] / "templates"))
templates.env.filters["safe_url"] = safe_url
templates.env.globals["size"] = size


def _page(request: Request, name: str, code: int = 200, **context: object) -> HTMLResponse:
    from api.config import api_settings

    # No session, no CSRF token (the login page shows none).
    settings = api_settings()
    session = session_of(request) if settings.auth_enabled else None
    context.setdefault("csrf", csrf_value(settings, session) if session else "")
    return templates.TemplateResponse(request, name, context, status_code=code)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request) -> HTMLResponse:
    return _page(request, "login.html", error=None)


@router.post("/login", response_class=HTMLResponse)
def login(request: Request, settings: SettingsDep,
          token: Annotated[str, Form(max_length=1000)] = "") -> Response:
    if settings.auth_enabled and not check_token(settings, token):
        return _page(request, "login.html", code=status.HTTP_401_UNAUTHORIZED,
                     error="wrong token")
    response = RedirectResponse("/ui", status_code=status.HTTP_303_SEE_OTHER)
    if settings.auth_enabled:
        https = (request.url.scheme == "https" or request.headers.get(
            "x-forwarded-proto", "").split(",")[0].strip().lower() == "https")
        response.set_cookie(COOKIE, new_session(settings), httponly=True, samesite="strict",
                            secure=settings.api_secure_cookie or https, path="/",
                            max_age=int(settings.api_session_hours * 3600))
    return response


@router.post("/logout", dependencies=[CsrfDep])
def logout(request: Request) -> Response:
    response = RedirectResponse("/ui/login", status_code=status.HTTP_303_SEE_OTHER)
    if (value := request.cookies.get(COOKIE)) is not None:
        end_session(value)  # the old cookie opens nothing any more
    response.delete_cookie(COOKIE, path="/")
    return response


@router.get("", response_class=HTMLResponse, dependencies=[UiDep])
def jobs_page(request: Request, session: SessionDep) -> HTMLResponse:
    return _page(request, "jobs.html", jobs=query.list_jobs(session))


@router.get("/jobs/{job}", response_class=HTMLResponse, dependencies=[UiDep])
def job_page(request: Request, job: JobRef, session: SessionDep,
             message: str | None = None) -> HTMLResponse:
    j = job_or_404(session, job)
    st = job_status(session, j)
    chart = query.done_per_minute(session, j.id, minutes=60)
    failed, _ = query.list_samples(session, j.id, state="failed", limit=20)
    recent, _ = query.list_samples(session, j.id, limit=20)
    workers = live(session, now=utcnow(), timeout=get_settings().worker_timeout)
    from synthq.training.runs import list_runs  # no torch

    return _page(request, "job.html", job=st, chart=chart, peak=max(n for _, n in chart) or 1,
                 failed=failed, recent=recent, workers=workers, message=message,
                 states=[s.value for s in JobState], limit_charts=_limit_charts(st.limits),
                 runs=list_runs(session, j.id))


def _limit_charts(limits: dict[str, dict[str, object]]) -> list[dict[str, object]]:
    """Per server: its limit and reason, and SVG polylines (600×100) of the adaptive
    limit and of tokens/s over the stored history (synthq.serving.adaptive.HISTORY points)."""
    charts = []
    for url, lim in limits.items():
        history = lim.get("history") or []
        assert isinstance(history, list)
        entry: dict[str, object] = {"url": safe_url(url), "limit": lim.get("limit"),
                                    "auto": lim.get("auto"), "reason": lim.get("reason"),
                                    "limit_points": "", "tps_points": ""}
        if len(history) >= 2:
            t0, t1 = history[0][0], history[-1][0]
            span = max(t1 - t0, 1e-9)
            top_limit = max(p[1] for p in history) or 1
            top_tps = max(p[2] for p in history) or 1
            entry["limit_points"] = " ".join(
                f"{600 * (p[0] - t0) / span:.1f},{100 - 95 * p[1] / top_limit:.1f}"
                for p in history)
            entry["tps_points"] = " ".join(
                f"{600 * (p[0] - t0) / span:.1f},{100 - 95 * p[2] / top_tps:.1f}"
                for p in history)
            entry.update(top_limit=top_limit, top_tps=round(top_tps), span_s=round(span))
        charts.append(entry)
    return charts


def _back(job: str, message: str) -> Response:
    from urllib.parse import quote

    return RedirectResponse(f"/ui/jobs/{quote(job, safe='')}?message={quote(message)}",
                            status_code=status.HTTP_303_SEE_OTHER)


@router.post("/jobs/{job}/requeue", dependencies=[CsrfDep])
def requeue(job: JobRef, error_class: Annotated[str, Form(max_length=32)] = "") -> Response:
    with session_scope() as s:
        j = job_or_404(s, job)
        try:
            n = service.requeue(s, j, classes=[error_class] if error_class else [])
        except UserError as exc:
            return _back(job, str(exc))
    what = f"{error_class} " if error_class else ""
    return _back(job, f"requeued {n:,} failed {what}samples")


@router.post("/jobs/{job}/state", dependencies=[CsrfDep])
def set_state(job: JobRef, target: Annotated[JobState, Form()]) -> Response:
    with session_scope() as s:
        j = job_or_404(s, job)
        try:
            before = service.set_job_state(s, j, target)
        except UserError as exc:
            return _back(job, str(exc))
    return _back(job, f"job {before} → {target}")


@router.get("/samples/{sample_id}", response_class=HTMLResponse, dependencies=[UiDep])
def sample_page(request: Request, sample_id: int, session: SessionDep) -> HTMLResponse:
    detail = query.sample_detail(session, sample_id) if 0 < sample_id < 2**62 else None
    if detail is None:
        return _page(request, "missing.html", code=404, what=f"sample {sample_id}")
    return _page(request, "sample.html", s=detail)

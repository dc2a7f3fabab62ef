"""Health (process up), readiness (database and broker), metrics, and the OpenAPI docs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.auth import TokenDep
from api.schemas import Health
from synthq.config import get_settings
from synthq.db import get_engine, safe_url

public = APIRouter(tags=["system"])
private = APIRouter(tags=["system"], dependencies=[TokenDep])


@public.get("/health", response_model=Health, summary="The process is up (no auth)")
def health() -> Health:
    return Health(status="ok")


def _reason(exc: Exception) -> str:
    first = (str(exc).splitlines() or [""])[0][:200]
    return safe_url(f"{type(exc).__name__}: {first}")


@public.get("/ready", response_model=Health, responses={503: {"model": Health}},
            summary="The database and the broker answer (no auth)")
def ready() -> Response:
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        checks["database"] = _reason(exc)
    broker = get_settings().broker_url
    if broker:
        import redis

        try:
            client = redis.Redis.from_url(broker, socket_timeout=2, socket_connect_timeout=2)
            try:
                client.ping()
            finally:
                client.close()
            checks["broker"] = "ok"
        except Exception as exc:  # noqa: BLE001
            checks["broker"] = _reason(exc)
    else:
        checks["broker"] = "none (embedded mode)"
    ok = all(v == "ok" or v.startswith("none") for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@private.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}}},
             summary="Prometheus metrics, read from SQL")
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


@private.get("/openapi.json", include_in_schema=False)
def openapi(request: Request) -> dict[str, Any]:
    return request.app.openapi()  # type: ignore[no-any-return]


@private.get("/docs", include_in_schema=False, response_class=HTMLResponse)
def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="synthq API")

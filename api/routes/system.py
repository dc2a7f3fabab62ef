"""Health (process up), readiness (database and broker), metrics, and the OpenAPI docs."""

from __future__ import annotations

import logging
from html import escape
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.auth import TokenDep
from api.guard import RETRY_AFTER_S, outage
from api.schemas import Health
from synthq.spec.config import get_settings
from synthq.store.db import get_engine, safe_url

log = logging.getLogger("synthq.api")

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
    # No auth: says only ok or unavailable; the cause (host, port, error) goes to the log.
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        outage.failed(_reason(exc))
        checks["database"] = "unavailable"
    broker = get_settings().broker_url
    if broker:
        from synthq.queue.broker import ping

        try:
            ping(broker)
            checks["broker"] = "ok"
        except Exception as exc:  # noqa: BLE001
            log.warning("/ready: broker unavailable: %s", _reason(exc))
            checks["broker"] = "unavailable"
    else:
        checks["broker"] = "none (embedded mode)"
    ok = all(v == "ok" or v.startswith("none") for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503,
                        headers=None if ok else {"Retry-After": str(RETRY_AFTER_S)})


@private.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}}},
             summary="Prometheus metrics, read from SQL")
async def metrics(request: Request) -> Response:
    # Scrapes at once share one SQL read (api.coalesce): a scrape may be up to 1 s old.
    registry = request.app.state.metrics
    body = await request.app.state.reads.get("/metrics", lambda: generate_latest(registry))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@private.get("/openapi.json", include_in_schema=False)
def openapi(request: Request) -> dict[str, Any]:
    return request.app.openapi()  # type: ignore[no-any-return]


@private.get("/docs", include_in_schema=False, response_class=HTMLResponse)
def docs(request: Request) -> HTMLResponse:
    """The routes, from the OpenAPI schema, as a plain page: no script from a CDN."""
    schema = request.app.openapi()
    rows = []
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            params = ", ".join(p["name"] for p in op.get("parameters", []))
            rows.append(f"<tr><td><code>{escape(method.upper())}</code></td>"
                        f"<td><code>{escape(path)}</code></td><td>{escape(params)}</td>"
                        f"<td>{escape(op.get('summary', ''))}</td></tr>")
    html = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>synthq API</title>"
            f"</head><body style='font:14px system-ui;margin:24px'><h1>synthq API</h1>"
            f"<p>Every route but /health and /ready needs <code>Authorization: Bearer "
            f"&lt;SYNTHQ_API_TOKEN&gt;</code>. The full schema: <a href='/openapi.json'>"
            f"/openapi.json</a>; the job page: <a href='/ui'>/ui</a>.</p>"
            f"<table cellpadding=4><tr><th>method</th><th>path</th><th>parameters</th>"
            f"<th>what</th></tr>{''.join(rows)}</table></body></html>")
    return HTMLResponse(html)

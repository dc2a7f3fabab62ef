"""The synthq REST API and job page: ``uvicorn api.app:app`` or ``synthq api``.

Routes are thin: each one validates its input, calls the same ``synthq``
function the CLI calls, and maps the result (or a :class:`UserError`) to HTTP.
Every route but ``/health`` and ``/ready`` needs the bearer token
(``SYNTHQ_API_TOKEN``); the app refuses to start without a real one unless
``SYNTHQ_API_DEV=1``. The API never imports torch (``synthq api`` hides it, so
that transformers, used to check a new job's tokenizer, does not load it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse, RedirectResponse, Response
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeout

if os.environ.get("SYNTHQ_API_HIDE_TORCH") == "1" and "torch" not in sys.modules:
    # transformers imports torch whenever it is installed; None makes it absent.
    sys.modules["torch"] = None  # type: ignore[assignment]

from api import metrics  # noqa: E402
from api.auth import NotLoggedIn, TokenDep  # noqa: E402
from api.coalesce import Coalescer  # noqa: E402
from api.config import api_settings  # noqa: E402
from api.guard import RETRY_AFTER_S, Guard, outage  # noqa: E402
from api.routes import exports, jobs, samples, system, ui  # noqa: E402
from synthq.core.errors import UserError  # noqa: E402
from synthq.store.db import safe_url  # noqa: E402

__all__ = ["app", "create_app", "ROUTERS"]

#: Every router of the app (tests walk them: no route escapes the auth checks).
ROUTERS = (system.public, system.private, jobs.router, samples.router, exports.router,
           ui.router)

log = logging.getLogger("synthq.api")

DESCRIPTION = """Jobs, samples, requeue and exports of synthq, the EAGLE-3 training-data queue.

Every route but `/health` and `/ready` needs `Authorization: Bearer <SYNTHQ_API_TOKEN>`.
The job page is at [/ui](/ui).
"""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = api_settings()
    settings.check()  # no token, or the placeholder: refuse to start
    if not settings.auth_enabled:
        log.warning("SYNTHQ_API_DEV=1 and no SYNTHQ_API_TOKEN: the API has NO authentication")
    yield


def db_slots() -> int:
    """Requests that may use the database at once: the pool, less the exports' share.

    Each request holds at most one connection at a time, so with no more
    requests than connections none waits for one (see :mod:`api.guard`).
    """
    from synthq.jobs.export_runs import MAX_RUNNING
    from synthq.spec.config import get_settings

    s = get_settings()
    pool = 96 if s.database_url.startswith("sqlite") else s.db_pool_size + s.db_max_overflow
    return max(1, min(pool - MAX_RUNNING, 32))


def create_app() -> FastAPI:
    app = FastAPI(title="synthq", version="1", description=DESCRIPTION, lifespan=_lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics.registry()
    app.state.reads = Coalescer()
    app.add_middleware(Guard, upload_limit=lambda: api_settings().api_upload_max_bytes,
                       slots=db_slots(), on_write=app.state.reads.invalidate)
    app.include_router(system.public)
    app.include_router(system.private)
    for router in (jobs.router, samples.router, exports.router):
        app.include_router(router, dependencies=[TokenDep])
    app.include_router(ui.router)

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> Response:
        return JSONResponse({"detail": safe_url(str(exc))},
                            status_code=422)

    @app.exception_handler(StatementError)
    async def _bad_value(request: Request, exc: StatementError) -> Response:
        # A value the database cannot hold (NUL in text, an integer out of range).
        if isinstance(exc, DataError) or isinstance(exc.orig, ValueError | OverflowError):
            return JSONResponse({"detail": "a value is not valid for the database "
                                 "(NUL character or out of range)"},
                                status_code=422)
        raise exc

    def _unavailable(exc: Exception) -> Response:
        first = (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0][:300]
        outage.failed(safe_url(f"{type(exc).__name__}: {first}"))
        return JSONResponse({"detail": "the database is unavailable; retry later"},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(DBAPIError)
    async def _db_error(request: Request, exc: DBAPIError) -> Response:
        # Unreachable, restarted, out of connections: 503, the cause logged once.
        if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated:
            return _unavailable(exc)
        return await _bad_value(request, exc)

    @app.exception_handler(PoolTimeout)
    async def _pool_timeout(request: Request, exc: PoolTimeout) -> Response:
        return _unavailable(exc)

    @app.exception_handler(NotLoggedIn)
    async def _login(request: Request, exc: NotLoggedIn) -> Response:
        return RedirectResponse("/ui/login", status_code=status.HTTP_303_SEE_OTHER)

    @app.get("/", include_in_schema=False)
    def root() -> Response:
        return RedirectResponse("/ui", status_code=status.HTTP_307_TEMPORARY_REDIRECT)

    return app


app = create_app()

"""Who may call: a bearer token on every route but /health and /ready.

Scripts send ``Authorization: Bearer TOKEN``. The job page's login form takes
the token once and sets a cookie (HttpOnly, SameSite=Strict, Secure over
HTTPS or behind ``X-Forwarded-Proto: https``, expiring after
``SYNTHQ_API_SESSION_HOURS``) holding a random value made for this login; the
database keeps only its sha256 and expiry (``api_sessions``), so logging out
revokes it. The cookie is accepted for reads, and for the page's own forms
together with their CSRF field, an HMAC of the session value (no session, no
CSRF token). Comparisons are constant-time. Expired logins are deleted by a
login or a session check, at most once every 10 minutes per API process.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import Depends, Form, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.config import ApiSettings, api_settings

__all__ = ["COOKIE", "new_session", "end_session", "session_of", "csrf_value", "check_token",
           "require_token", "require_ui", "require_csrf", "TokenDep", "UiDep", "CsrfDep",
           "NotLoggedIn"]

COOKIE = "synthq_session"


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


#: Seconds between two deletions of expired logins by one API process.
PRUNE_EVERY_S = 600.0
_pruned_at: float | None = None


def _prune_expired(s: Any, now: datetime) -> None:
    """Delete expired logins, at most once per PRUNE_EVERY_S per process: a session check
    is a read on every page view, and the table only needs keeping small, not exact."""
    global _pruned_at
    from sqlalchemy import delete

    from synthq.store.models import ApiSession

    if _pruned_at is not None and time.monotonic() - _pruned_at < PRUNE_EVERY_S:
        return
    _pruned_at = time.monotonic()
    s.execute(delete(ApiSession).where(ApiSession.expires_at < now))


def new_session(settings: ApiSettings) -> str:
    """A new login: a random cookie value, its sha256 stored with its expiry."""
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import ApiSession

    value = secrets.token_urlsafe(32)
    now = utcnow()
    with session_scope() as s:
        _prune_expired(s, now)
        s.add(ApiSession(id=_digest(value), created_at=now,
                         expires_at=now + timedelta(hours=settings.api_session_hours)))
    return value


def end_session(value: str) -> None:
    from sqlalchemy import delete

    from synthq.store.db import session_scope
    from synthq.store.models import ApiSession

    with session_scope() as s:
        s.execute(delete(ApiSession).where(ApiSession.id == _digest(value)))


def session_of(request: Request) -> str | None:
    """The request's session cookie value if it names a live login, else None."""
    from sqlalchemy import select

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import ApiSession

    value = request.cookies.get(COOKIE)
    if not value or len(value) > 100:
        return None
    now = utcnow()
    with session_scope() as s:
        _prune_expired(s, now)
        found = s.scalar(select(ApiSession.id).where(ApiSession.id == _digest(value),
                                                     ApiSession.expires_at > now))
    return value if found is not None else None


def csrf_value(settings: ApiSettings, session: str) -> str:
    """The CSRF field of ``session``'s forms: an HMAC of it, keyed by the token."""
    key = settings.api_token.get_secret_value().encode()
    return hmac.new(key, f"synthq-ui-csrf:{session}".encode(), hashlib.sha256).hexdigest()


def check_token(settings: ApiSettings, presented: str) -> bool:
    expected = settings.api_token.get_secret_value()
    return hmac.compare_digest(presented.encode(), expected.encode())


_bearer_scheme = HTTPBearer(auto_error=False, description="SYNTHQ_API_TOKEN")


def _has_session(request: Request, settings: ApiSettings) -> bool:
    return session_of(request) is not None


async def require_token(request: Request, credentials: Annotated[
        HTTPAuthorizationCredentials | None, Security(_bearer_scheme)] = None) -> None:
    """The API's routes: a bearer token, or the page's session cookie for reads.

    Async, so that the usual case (a token: no I/O) costs no trip to a worker
    thread; only a cookie's database lookup goes to one.
    """
    settings = api_settings()
    if not settings.auth_enabled:
        return
    if credentials is not None and check_token(settings, credentials.credentials):
        return
    if request.method in ("GET", "HEAD") and COOKIE in request.cookies and \
            await run_in_threadpool(_has_session, request, settings):
        return
    raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                        headers={"WWW-Authenticate": "Bearer"})


class NotLoggedIn(Exception):
    """A page asked for without the session cookie: answered with the login page."""


def require_ui(request: Request) -> None:
    settings = api_settings()
    if settings.auth_enabled and not _has_session(request, settings):
        raise NotLoggedIn()


def require_csrf(request: Request, csrf: Annotated[str, Form()] = "") -> None:
    settings = api_settings()
    if not settings.auth_enabled:
        return
    session = session_of(request)
    if session is None:
        raise NotLoggedIn()
    if not hmac.compare_digest(csrf.encode(), csrf_value(settings, session).encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong CSRF token")


TokenDep = Depends(require_token)
UiDep = Depends(require_ui)
CsrfDep = Depends(require_csrf)

"""Who may call: a bearer token on every route but /health and /ready.

Scripts send ``Authorization: Bearer TOKEN``. The job page's login form takes
the token once and keeps a session value derived from it (an HMAC, not the
token itself) in a cookie marked HttpOnly and SameSite=Strict; that cookie
is accepted for reads, and for the page's own forms together with their
CSRF field. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Form, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.config import ApiSettings, api_settings

__all__ = ["COOKIE", "session_value", "csrf_value", "check_token", "require_token",
           "require_ui", "require_csrf", "TokenDep", "UiDep", "CsrfDep", "NotLoggedIn"]

COOKIE = "synthq_session"


def _derive(settings: ApiSettings, purpose: str) -> str:
    key = settings.api_token.get_secret_value().encode()
    return hmac.new(key, purpose.encode(), hashlib.sha256).hexdigest()


def session_value(settings: ApiSettings) -> str:
    return _derive(settings, "synthq-ui-session")


def csrf_value(settings: ApiSettings) -> str:
    return _derive(settings, "synthq-ui-csrf")


def check_token(settings: ApiSettings, presented: str) -> bool:
    expected = settings.api_token.get_secret_value()
    return hmac.compare_digest(presented.encode(), expected.encode())


_bearer_scheme = HTTPBearer(auto_error=False, description="SYNTHQ_API_TOKEN")


def _has_session(request: Request, settings: ApiSettings) -> bool:
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and hmac.compare_digest(cookie.encode(),
                                                      session_value(settings).encode())


def require_token(request: Request, credentials: Annotated[
        HTTPAuthorizationCredentials | None, Security(_bearer_scheme)] = None) -> None:
    """The API's routes: a bearer token, or the page's session cookie for reads."""
    settings = api_settings()
    if not settings.auth_enabled:
        return
    if credentials is not None and check_token(settings, credentials.credentials):
        return
    if request.method in ("GET", "HEAD") and _has_session(request, settings):
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
    require_ui(request)
    settings = api_settings()
    if settings.auth_enabled and not hmac.compare_digest(csrf.encode(),
                                                         csrf_value(settings).encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong CSRF token")


TokenDep = Depends(require_token)
UiDep = Depends(require_ui)
CsrfDep = Depends(require_csrf)

"""Auth: every route but /health and /ready refuses a missing or wrong token; the
API refuses to start without a real token; the page's cookie and CSRF field."""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import AUTH, TOKEN
from support import run_cli

pytestmark = pytest.mark.integration

PUBLIC = {"/health", "/ready"}


def _concrete(path: str) -> str:
    return re.sub(r"\{export_id\}", "0123456789abcdef", re.sub(r"\{[^}]+\}", "1", path))


def test_every_schema_route_refuses_a_missing_or_wrong_token(client: Any) -> None:
    schema = client.get("/openapi.json").json()
    assert "bearer" in str(schema["components"]["securitySchemes"]).lower()
    checked = 0
    for path, methods in schema["paths"].items():
        for method in methods:
            url = _concrete(path)
            for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token"},
                            {"Authorization": f"Basic {TOKEN}"}):
                r = client.request(method, url, headers=headers)
                if path in PUBLIC:
                    assert r.status_code in (200, 503), (method, path, r.status_code)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.headers["www-authenticate"] == "Bearer"
            checked += 1
    assert checked >= 15
    # Routes outside the schema too: the docs, and the page (which sends you to log in).
    for url in ("/openapi.json", "/docs", "/metrics"):
        assert client.get(url, headers={"Authorization": ""}).status_code == 401
    for url in ("/ui", "/ui/jobs/1", "/ui/samples/1"):
        r = client.get(url, headers={"Authorization": ""}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"


def test_every_route_is_in_the_schema_or_known(client: Any) -> None:
    """A route added outside the schema must be listed here, so the walk above sees it."""
    from fastapi.routing import APIRoute

    from api.app import ROUTERS

    schema_paths = set(client.get("/openapi.json").json()["paths"])
    routes = [r for router in ROUTERS for r in router.routes]
    routes += [r for r in client.app.routes if isinstance(r, APIRoute)]
    others = {r.path for r in routes if r.path not in schema_paths}
    assert others == {"/", "/openapi.json", "/docs", "/ui/login", "/ui/logout", "/ui",
                      "/ui/jobs/{job}", "/ui/jobs/{job}/requeue", "/ui/jobs/{job}/state",
                      "/ui/samples/{sample_id}"}


def test_the_page_cookie_is_httponly_strict_and_forms_need_csrf(
        client: Any, sample_factory: Any) -> None:
    from synthq.store.counts import state_counts
    from synthq.store.db import session_scope

    sid = sample_factory("failed", error_class="timeout")
    r = client.post("/ui/login", data={"token": "wrong"}, headers={"Authorization": ""})
    assert r.status_code == 401 and "wrong token" in r.text
    r = client.post("/ui/login", data={"token": TOKEN}, headers={"Authorization": ""},
                    follow_redirects=False)
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert TOKEN not in cookie  # a derived session value, not the token
    page = client.get("/ui/jobs/1", headers={"Authorization": ""})
    assert page.status_code == 200 and "timeout" in page.text
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert csrf
    # No CSRF field, or a wrong one: refused, nothing requeued.
    for data in ({"error_class": "timeout"}, {"error_class": "timeout", "csrf": "0" * 64}):
        r = client.post("/ui/jobs/1/requeue", data=data, headers={"Authorization": ""})
        assert r.status_code == 403
    with session_scope() as s:
        assert state_counts(s, 1)["failed"] == 1
    r = client.post("/ui/jobs/1/requeue", data={"error_class": "timeout", "csrf": csrf[1]},
                    headers={"Authorization": ""}, follow_redirects=False)
    assert r.status_code == 303
    with session_scope() as s:
        assert state_counts(s, 1)["pending"] == 1
    # The cookie opens reads of the API, never writes.
    assert client.get("/api/jobs", headers={"Authorization": ""}).status_code == 200
    assert client.post("/api/jobs/1/pause", headers={"Authorization": ""}).status_code == 401
    assert sid


@pytest.mark.parametrize("token", [None, "change-me-api-token", "short"])
def test_the_app_refuses_to_start_without_a_real_token(
        pg: str, monkeypatch: pytest.MonkeyPatch, token: str | None) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.config import api_settings

    if token is None:
        monkeypatch.delenv("SYNTHQ_API_TOKEN", raising=False)
    else:
        monkeypatch.setenv("SYNTHQ_API_TOKEN", token)
    monkeypatch.delenv("SYNTHQ_API_DEV", raising=False)
    api_settings.cache_clear()
    with pytest.raises(RuntimeError, match="SYNTHQ_API_TOKEN"), TestClient(create_app()):
        pass
    monkeypatch.setenv("SYNTHQ_API_DEV", "1")
    api_settings.cache_clear()
    with TestClient(create_app()) as c:
        assert c.get("/health").status_code == 200
    api_settings.cache_clear()


def test_synthq_api_refuses_the_placeholder(pg: str) -> None:
    from support import child_env

    for token in ("", "change-me-api-token"):
        r = run_cli("api", "--port", "1", check=False,
                    env=child_env(SYNTHQ_API_TOKEN=token, SYNTHQ_API_DEV="0"))
        assert r.returncode == 2 and "SYNTHQ_API_TOKEN" in r.stderr, r.stderr


def test_settings_refuse_placeholder_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.spec.config import Settings

    with pytest.raises(ValueError, match="placeholder"):
        Settings(database_url="postgresql://synthq:change-me-postgres-password@db/synthq")
    with pytest.raises(ValueError, match="placeholder"):
        Settings(broker_url="redis://:change-me-redis@redis:6379/0")
    Settings(database_url="postgresql://synthq:s3cr3t-real@db/synthq")


def test_auth_header_is_also_accepted_case_insensitively(client: Any) -> None:
    assert client.get("/api/jobs", headers={"Authorization": f"bearer {TOKEN}"}).status_code \
        == 200
    assert client.get("/api/jobs", headers=AUTH).status_code == 200

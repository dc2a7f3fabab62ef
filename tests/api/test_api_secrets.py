"""No secret in any response or log line; the API process never imports torch;
Flower needs basic auth, its /metrics too."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH, TOKEN, settle
from support import REPO, Proc, child_env, free_port, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

INFERENCE_KEY = "sk-inference-7d1e44b09a"
DB_PASSWORD = "pg-pass-c93a1f07"
FLOWER_PASSWORD = "flower-pass-2b8e61d4"


def test_no_secret_in_responses_or_logs(api_server: Callable[..., Any],
                                        simulator: Callable[..., Any],
                                        job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0")
    report = job_factory(["a", "b [[sim:error]]"], servers=[sim.url], max_attempts=1)
    settle(report.job_id)
    server = api_server(SYNTHQ_API_KEY=INFERENCE_KEY)
    # A second API whose database URL carries a password and cannot be reached.
    broken = api_server(SYNTHQ_DATABASE_URL=f"postgresql://synthq:{DB_PASSWORD}@127.0.0.1:9/x",
                        SYNTHQ_BROKER_URL=f"redis://:{DB_PASSWORD}@127.0.0.1:9/0")
    bodies: list[str] = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        for url in ("/health", "/ready", "/metrics", "/openapi.json", "/docs", "/api/jobs",
                    f"/api/jobs/{report.job_id}", f"/api/jobs/{report.job_id}/samples",
                    "/api/samples/1", "/api/samples/2", "/ui/login"):
            r = c.get(url)
            assert r.status_code == 200, (url, r.text)
            bodies.append(r.text)
        r = c.post("/ui/login", data={"token": TOKEN})
        bodies.append(r.text)
        bodies.append(c.get(f"/ui/jobs/{report.job_id}").text)
        bodies.append(c.get("/api/jobs", headers={"Authorization": "Bearer wrong"}).text)
    with httpx.Client(base_url=broken.url, headers=AUTH, timeout=30) as c:
        r = c.get("/ready")
        assert r.status_code == 503
        assert r.json()["checks"]["database"] != "ok" and r.json()["checks"]["broker"] != "ok"
        bodies.append(r.text)
        # /ready (no auth) says only that: no host, port or error text.
        assert r.json()["checks"] == {"database": "unavailable", "broker": "unavailable"}
        assert "127.0.0.1" not in r.text and "Error" not in r.text
        # The database is down: every route answers 503 JSON with Retry-After.
        for method, url in (("GET", "/api/jobs"), ("GET", "/api/jobs/1"),
                            ("GET", "/api/jobs/1/samples"), ("GET", "/api/samples/1"),
                            ("GET", "/metrics"), ("POST", "/api/jobs/1/pause"),
                            ("POST", "/api/jobs/1/requeue"), ("GET", "/ui"),
                            ("GET", "/api/jobs")):
            r = c.request(method, url, json={} if method == "POST" else None,
                          headers={"Cookie": "synthq_session=x"})
            assert r.status_code == 503, (url, r.text)
            assert r.headers["retry-after"] and "unavailable" in r.json()["detail"]
            assert "Traceback" not in r.text
            bodies.append(r.text)
    server.stop()
    broken.stop()
    # The cause is logged once for the outage, not once per request; no traceback.
    assert broken.log().count("database unavailable:") == 1, broken.log()
    assert "Traceback" not in broken.log()
    everything = "\n".join(bodies) + server.log() + broken.log()
    assert "GET /api/jobs" in server.log()  # the access log was written
    for secret in (TOKEN, INFERENCE_KEY, DB_PASSWORD):
        assert secret not in everything, secret


def test_api_code_never_imports_torch(pg: str, simulator: Callable[..., Any],
                                      job_factory: Callable[..., Any], tmp_path: Path) -> None:
    """Without the guard `synthq api` sets, the routes (sample masks decoded) load no torch."""
    import chat_tokenizers as ct

    sim = simulator("--latency", "0")
    report = job_factory(["hello"], servers=[sim.url], tokenizer=ct.qwen3(tmp_path / "tok"))
    settle(report.job_id)
    code = f"""
import sys
from fastapi.testclient import TestClient
from api.app import create_app
with TestClient(create_app(), headers={AUTH!r}) as c:
    for url in ("/api/jobs", "/api/jobs/1", "/api/samples/1", "/ui/samples/1", "/metrics"):
        assert c.get(url).status_code == 200, url
    mask = c.get("/api/samples/1").json()["mask"]
    assert any(m["supervised"] and m["text"].endswith("<|im_end|>") for m in mask), mask
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=child_env(SYNTHQ_API_TOKEN=TOKEN), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert report


def _wait_http(url: str, proc: Proc, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(proc.log())
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"flower did not start: {proc.log()}")


def test_flower_needs_basic_auth_and_protects_metrics(pg: str, redis_url: str,
                                                      tmp_path: Path) -> None:
    refused = run_cli("flower", check=False, env=child_env(FLOWER_BASIC_AUTH="",
                                                           SYNTHQ_API_DEV="0"))
    assert refused.returncode == 2 and "FLOWER_BASIC_AUTH" in refused.stderr
    placeholder = run_cli("flower", check=False, env=child_env(
        FLOWER_BASIC_AUTH="admin:change-me-flower-password", SYNTHQ_API_DEV="0"))
    assert placeholder.returncode == 2 and "placeholder" in placeholder.stderr
    comma = run_cli("flower", check=False, env=child_env(
        FLOWER_BASIC_AUTH="admin:flower,pass-2b8e61d4", SYNTHQ_API_DEV="0"))
    assert comma.returncode == 2 and "may not hold a comma" in comma.stderr
    port = free_port()
    proc = Proc([sys.executable, "-m", "synthq.cli", "flower", "--port", str(port)],
                child_env(FLOWER_BASIC_AUTH=f"admin:{FLOWER_PASSWORD}"), tmp_path / "flower.log")
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/healthcheck", proc)
        assert httpx.get(f"{base}/healthcheck").status_code == 200
        for path in ("/metrics", "/api/workers", "/"):
            assert httpx.get(f"{base}{path}").status_code == 401, path
            assert httpx.get(f"{base}{path}", auth=("admin", "wrong")).status_code == 401
        ok = httpx.get(f"{base}/metrics", auth=("admin", FLOWER_PASSWORD))
        assert ok.status_code == 200 and "flower_" in ok.text
        page = httpx.get(f"{base}/", auth=("admin", FLOWER_PASSWORD))
        assert page.status_code == 200 and page.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    finally:
        proc.stop()
    assert FLOWER_PASSWORD not in proc.log()


def test_flower_max_tasks_of_the_user_replaces_the_default() -> None:
    from synthq.cli.api import FLOWER_MAX_TASKS, flower_args

    assert flower_args(5555, "0.0.0.0", []) == [
        "--port=5555", "--address=0.0.0.0", f"--max-tasks={FLOWER_MAX_TASKS}"]
    for given in (["--max-tasks=100000"], ["--max_tasks", "100000"]):
        args = flower_args(5555, "0.0.0.0", given)
        assert args == ["--port=5555", "--address=0.0.0.0", *given]

"""The API under a hostile client: server files, upload sizes, sessions, headers, bad input."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import AUTH, TOKEN

pytestmark = pytest.mark.integration


def spec(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "servers": ["http://127.0.0.1:9/v1"], "max_tokens": 32,
            **extra}


def _jobs(client: Any) -> int:
    return len(client.get("/api/jobs").json())


def test_hf_dataset_never_reads_a_server_file(client: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"prompt": "the secret"}) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.jsonl").write_text(json.dumps({"prompt": "also secret"}) + "\n")
    monkeypatch.chdir(tmp_path)  # relative names too: "sub" is a folder here
    answers = set()
    for hf in (str(secret), "secret.jsonl", "sub", "sub/x.jsonl", "../etc/passwd",
               str(tmp_path / "missing.jsonl"), "~/x", "a/../../b"):
        r = client.post("/api/jobs", json={**spec(), "hf_dataset": hf})
        assert r.status_code == 422, (hf, r.text)
        answers.add(r.json()["detail"])
    # One answer for files that exist and files that do not: no existence oracle.
    assert len(answers) == 1 and "Hugging Face dataset id" in answers.pop()
    assert _jobs(client) == 0


def test_a_folder_linking_out_of_the_data_dir_is_refused(client: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "set").mkdir(parents=True)
    (data / "set" / "ok.jsonl").write_text(json.dumps({"prompt": "in"}) + "\n")
    (tmp_path / "secret.jsonl").write_text(json.dumps({"prompt": "out"}) + "\n")
    os.symlink(tmp_path / "secret.jsonl", data / "set" / "link.jsonl")
    os.symlink(tmp_path / "secret.jsonl", data / "top.jsonl")
    for path in ("set", "top.jsonl"):
        r = client.post("/api/jobs", json={**spec(), "path": path})
        assert r.status_code == 422 and "inside the data directory" in r.text, r.text
        assert str(tmp_path) not in r.text
    assert _jobs(client) == 0


def test_upload_limits_count_what_is_read(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.config import api_settings
    from synthq.data.dataset import read as dataset

    monkeypatch.setenv("SYNTHQ_API_UPLOAD_MAX_BYTES", "100000")
    api_settings.cache_clear()
    row = json.dumps({"prompt": "hi"}).encode() + b"\n"
    # A gzip bomb: 10 MB of zeros compress to ~10 kB; refused at 100 kB decompressed.
    bomb = gzip.compress(row + b"0" * 10_000_000)
    assert len(bomb) < 100_000
    r = client.post("/api/jobs/upload", files={"file": ("b.jsonl.gz", io.BytesIO(bomb))},
                    data={"spec": json.dumps(spec())})
    assert r.status_code == 413 and "decompressed" in r.json()["detail"]
    # A line over the line limit is a skipped row, read through without holding it.
    monkeypatch.setattr(dataset, "MAX_LINE_BYTES", 1000)
    body = row + b'{"prompt": "' + b"x" * 50_000 + b'"}\n' + row
    r = client.post("/api/jobs/upload", files={"file": ("long.jsonl", io.BytesIO(body))},
                    data={"spec": json.dumps(spec(name="long"))})
    assert r.status_code == 201, r.text
    assert r.json()["bad_rows"] == [{"row": 1, "reason": "line is over 0 MiB"}]
    # A 301-character suffix: 422, not ENAMETOOLONG.
    r = client.post("/api/jobs/upload", files={"file": ("x." + "a" * 301, io.BytesIO(row))},
                    data={"spec": json.dumps(spec())})
    assert r.status_code == 422 and "file name must end" in r.json()["detail"]
    # Errors name the file as uploaded, never the server's temp folder.
    r = client.post("/api/jobs/upload", files={"file": ("bad.parquet", io.BytesIO(row))},
                    data={"spec": json.dumps(spec())})
    assert r.status_code == 422 and "bad.parquet" in r.text, r.text
    assert "uploads" not in r.text and "/tmp" not in r.text
    api_settings.cache_clear()


def _raw_upload(url: str, *, length: int | None, send: int) -> tuple[int, int]:
    """POST an upload's headers, then up to ``send`` bytes; (status, bytes sent)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    # A small send buffer: what counts as sent is what left this process, not a queue.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    head = (f"POST /api/jobs/upload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\n")
    head += f"Content-Length: {length}\r\n" if length is not None else \
        "Transfer-Encoding: chunked\r\n"
    sock.sendall((head + "\r\n").encode())
    sent = 0
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
    chunk = b"x" * 65536
    answer = b""
    while sent < send:
        if select.select([sock], [], [], 0)[0]:
            break  # the answer is here
        data = part + chunk if sent == 0 else chunk
        if length is None:
            data = f"{len(data):x}\r\n".encode() + data + b"\r\n"
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(data)
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        answer = sock.recv(4096)
    sock.close()
    match = re.match(rb"HTTP/1.1 (\d+)", answer)
    assert match, answer[:200]
    return int(match.group(1)), sent


def test_an_upload_over_the_limit_is_refused_before_its_body(
        api_server: Callable[..., Any]) -> None:
    # 8 MB: well above what the two kernels' socket buffers hold in flight on loopback.
    limit = 8_000_000
    server = api_server(SYNTHQ_API_UPLOAD_MAX_BYTES=str(limit))
    # Content-Length over the limit: 413 before a byte of the body is sent.
    status, sent = _raw_upload(server.url, length=10**10, send=0)
    assert status == 413 and sent == 0
    # No Content-Length (chunked): cut once the limit is passed.
    status, sent = _raw_upload(server.url, length=None, send=10 * limit)
    assert status == 413 and sent < 2 * limit, sent


def test_sessions_are_per_login_and_logout_revokes_them(client: Any, monkeypatch:
                                                        pytest.MonkeyPatch,
                                                        sample_factory: Any) -> None:
    from api.config import api_settings

    sample_factory("failed", error_class="timeout")
    nobody = {"Authorization": ""}
    login_page = client.get("/ui/login", headers=nobody).text
    assert 'name="csrf"' not in login_page  # no session, no CSRF token

    def login(**headers: str) -> tuple[str, str]:
        client.cookies.clear()
        r = client.post("/ui/login", data={"token": TOKEN}, headers={**nobody, **headers},
                        follow_redirects=False)
        assert r.status_code == 303
        header = r.headers["set-cookie"]
        value = re.match(r"synthq_session=([^;]+);", header)
        assert value, header
        return header, value[1]

    header_a, a = login()
    header_b, b = login()
    assert a != b  # random per login
    assert "max-age=" in header_a.lower() and "secure" not in header_a.lower()
    header_https, _ = login(**{"X-Forwarded-Proto": "https"})
    assert "secure" in header_https.lower()
    client.cookies.clear()
    page = client.get("/ui/jobs/1", headers=nobody, cookies={"synthq_session": a})
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert page.status_code == 200 and csrf
    r = client.post("/ui/logout", data={"csrf": csrf[1]}, headers=nobody,
                    cookies={"synthq_session": a}, follow_redirects=False)
    assert r.status_code == 303
    # The old cookie and its scraped CSRF token open nothing any more.
    client.cookies.clear()
    r = client.get("/ui/jobs/1", headers=nobody, cookies={"synthq_session": a},
                   follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    r = client.post("/ui/jobs/1/state", data={"target": "cancelled", "csrf": csrf[1]},
                    headers=nobody, cookies={"synthq_session": a}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    assert client.get("/api/jobs/1", headers=nobody,
                      cookies={"synthq_session": a}).status_code == 401
    assert client.get("/api/jobs/1").json()["state"] == "active"
    # The other login still works; an expired one does not.
    assert client.get("/ui", headers=nobody, cookies={"synthq_session": b}).status_code == 200
    monkeypatch.setenv("SYNTHQ_API_SESSION_HOURS", "0.000001")  # 3.6 ms
    api_settings.cache_clear()
    _, old = login()
    client.cookies.clear()
    time.sleep(0.05)
    r = client.get("/ui", headers=nobody, cookies={"synthq_session": old},
                   follow_redirects=False)
    assert r.status_code == 303
    api_settings.cache_clear()


def test_headers_docs_and_ready(client: Any) -> None:
    for url in ("/ui/login", "/api/jobs", "/docs", "/health"):
        r = client.get(url)
        assert r.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    docs = client.get("/docs").text
    assert "/api/jobs/{job}/requeue" in docs and "<script" not in docs and "cdn" not in docs
    ready = client.get("/ready", headers={"Authorization": ""})
    assert ready.json()["checks"]["database"] == "ok"


def test_bad_input_is_422_not_500(client: Any, job_factory: Any, sample_factory: Any,
                                  tmp_path: Path) -> None:
    report = job_factory(["a"], servers=["http://user:pw@127.0.0.1:9/v1"])
    sample_factory("failed", job_id=report.job_id, error_class="timeout",
                   server="http://user:pw@127.0.0.1:9/v1")
    r = client.post(f"/api/jobs/{report.job_id}/requeue",
                    json={"sample_ids": list(range(200_000))})
    assert r.status_code == 422
    for name in ("a/b", "two\nlines", "evil\u202etxt.exe"):
        r = client.post("/api/jobs/upload", files={"file": ("x.jsonl", io.BytesIO(b'{"prompt"'
                                                                                    b': "x"}'))},
                        data={"spec": json.dumps(spec(name=name))})
        assert r.status_code == 422 and "job name may not hold" in r.json()["detail"], name
    # The masked server URL the API shows works as a filter.
    shown = client.get(f"/api/jobs/{report.job_id}").json()["servers"][0]
    assert "***" in shown and "pw" not in shown
    items = client.get(f"/api/jobs/{report.job_id}/samples",
                       params={"server": shown}).json()["items"]
    assert len(items) == 1 and items[0]["error_class"] == "timeout"
    # A server-side file with bad rows: 201 like an upload, the good rows kept and run.
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "mixed.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    r = client.post("/api/jobs", json={**spec(), "path": "mixed.jsonl"})
    assert r.status_code == 201 and r.json()["inserted"] == 2, r.text
    assert "1 malformed rows skipped (rows 1," in r.json()["message"], r.text
    assert [e["row"] for e in r.json()["bad_rows"]] == [1]
    assert str(data) not in r.text


def test_the_api_checks_the_model_like_the_cli(client: Any,
                                               simulator: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0")
    r = client.post("/api/jobs/upload", files={"file": ("m.jsonl", io.BytesIO(b'{"prompt": '
                                                                              b'"x"}'))},
                    data={"spec": json.dumps(spec(model="other", servers=[sim.url]))})
    assert r.status_code == 422 and "does not serve model 'other'" in r.json()["detail"]
    assert _jobs(client) == 0


def test_exports_are_capped_and_a_dead_one_is_failed(tmp_path: Path, pg: str) -> None:
    from synthq.jobs import export_runs

    root = tmp_path / "exports"
    root.mkdir()
    # Two running (fresh status files): a third is refused.
    for i in range(export_runs.MAX_RUNNING):
        run = export_runs.ExportRun(id=f"{i:016x}", job_id=1, format="jsonl")
        export_runs._save(root, run)
    with pytest.raises(export_runs.Busy):
        export_runs.start(root, 1, fmt="jsonl")
    # The API process running one stopped: its file goes stale, it reads as failed.
    (root / ".0000000000000000.tmp-abc").mkdir()
    old = time.time() - export_runs.STALE_S - 1
    os.utime(root / "0000000000000000.json", (old, old))
    run = export_runs.get(root, "0000000000000000")
    assert run is not None and run.state == "failed" and "stopped" in (run.error or "")
    assert not (root / ".0000000000000000.tmp-abc").exists()
    assert len(export_runs.running(root)) == 1


def test_busy_database_slots_answer_503_not_500() -> None:
    """More requests than slots wait on the event loop; past the wait, 503 with Retry-After."""
    import asyncio

    import httpx

    from api.guard import Guard

    release = asyncio.Event()

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = Guard(slow_app, upload_limit=lambda: 100, slots=1, wait_s=0.2)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard),
                                     base_url="http://t") as c:
            first = asyncio.create_task(c.get("/api/jobs"))
            await asyncio.sleep(0.05)
            second = await c.get("/api/jobs")
            release.set()
            return await first, second

    first, second = asyncio.run(go())
    assert first.status_code == 200 and first.headers["x-frame-options"] == "DENY"
    assert second.status_code == 503 and second.headers["retry-after"] == "5"
    assert "busy" in second.json()["detail"]


def test_a_parquet_upload_counts_its_uncompressed_size(client: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from api.config import api_settings

    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": ["x" * 1_000_000]}), path, compression="zstd")
    assert path.stat().st_size < 100_000
    monkeypatch.setenv("SYNTHQ_API_UPLOAD_MAX_BYTES", "200000")
    api_settings.cache_clear()
    r = client.post("/api/jobs/upload", files={"file": ("big.parquet", path.read_bytes())},
                    data={"spec": json.dumps(spec())})
    assert r.status_code == 413 and "uncompressed" in r.json()["detail"], r.text
    api_settings.cache_clear()


def test_an_exhausted_pool_is_503_not_500(api_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from synthq.spec.config import get_settings
    from synthq.store.db import dispose_engines, get_engine

    monkeypatch.setenv("SYNTHQ_DB_POOL_SIZE", "1")
    monkeypatch.setenv("SYNTHQ_DB_MAX_OVERFLOW", "0")
    dispose_engines()
    get_settings.cache_clear()
    try:
        engine = get_engine()
        engine.pool._timeout = 0.2  # type: ignore[attr-defined]
        with engine.connect(), TestClient(create_app(), headers=AUTH) as c:
            r = c.get("/api/jobs")  # the only connection is held above
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert "unavailable" in r.json()["detail"]
    finally:
        dispose_engines()
        get_settings.cache_clear()


def test_expired_logins_are_pruned_by_session_checks(client: Any) -> None:
    """Not only at login: a session check deletes expired ones, at most every 10 minutes."""
    from datetime import timedelta

    from sqlalchemy import func, select

    from api import auth
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import ApiSession

    def expired(tag: str) -> None:
        then = utcnow() - timedelta(hours=2)
        with session_scope() as s:
            s.add(ApiSession(id=tag * 64, created_at=then, expires_at=then))

    def left() -> int:
        with session_scope() as s:
            return s.scalar(select(func.count()).where(
                ApiSession.id.in_(["a" * 64, "b" * 64]))) or 0

    def check() -> None:
        client.get("/ui", headers={"Authorization": ""}, cookies={"synthq_session": "x"},
                   follow_redirects=False)

    auth._pruned_at = None
    expired("a")
    check()
    assert left() == 0
    expired("b")
    check()
    assert left() == 1  # pruned a moment ago: this check only reads
    auth._pruned_at -= auth.PRUNE_EVERY_S + 1
    check()
    assert left() == 0


@pytest.mark.processes
@pytest.mark.parametrize("hours", ["abc", "0"])
def test_a_bad_session_hours_is_one_line(hours: str) -> None:
    from support import child_env, run_cli

    r = run_cli("api", "--port", "1", env=child_env(SYNTHQ_API_TOKEN=TOKEN,
                                                    SYNTHQ_API_SESSION_HOURS=hours),
                timeout=30, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "invalid setting SYNTHQ_API_SESSION_HOURS" in r.stderr

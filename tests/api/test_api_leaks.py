"""What may leave the API host, over real HTTP and PostgreSQL: the chat template it renders
is bounded, the servers it names are allowed, their passwords are masked everywhere, the
tokenizer it opens is confined; and the API and the CLI answer with one record."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH, settle
from support import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

PASSWORD = "hunter2-5ab07c"
INFERENCE_KEY = "sk-inference-leak-41c9e2"


def _spec(server: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "servers": [server], "max_tokens": 16, **extra}


def _vm_hwm_mb(pid: int) -> float:
    """Peak resident memory of process ``pid`` (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_hostile_chat_template_is_refused_fast_and_the_tokenizer_is_confined(
        api_server: Callable[..., Any], tmp_path: Path) -> None:
    import chat_tokenizers as ct

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    tok = Path(ct.qwen3(data / "tok")).relative_to(data)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    server = api_server()
    unreachable = "http://127.0.0.1:9/v1"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=90) as c:
        # Item 11: the tokenizer is a Hub id or a folder inside the data directory, never
        # another path of the API host (today /etc/passwd is handed to transformers).
        for path in ("/etc/passwd", "/etc", "../secret", "~", str(tmp_path), "p.jsonl"):
            r = c.post("/api/jobs", json={**_spec(unreachable), "path": "p.jsonl",
                                          "tokenizer": path})
            assert r.status_code == 422, (path, r.text)
            detail = r.json()["detail"]
            assert "\n" not in detail and "tokenizer must be" in detail, (path, detail)
        # Item 5: a template that builds 800 MB or loops 10^10 times is refused within
        # seconds, with one line, and stores no job; the API's memory stays small.
        hostile = {"big": "{% set x = 'a' * 800000000 %}{{ x | length }}",
                   "loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                            "{% endfor %}{% endfor %}"}
        for name, template in hostile.items():
            started = time.monotonic()
            r = c.post("/api/jobs", json={**_spec(unreachable), "path": "p.jsonl",
                                          "name": name, "tokenizer": str(tok),
                                          "chat_template": template, "reasoning": "drop"})
            took = time.monotonic() - started
            assert r.status_code == 422, (name, r.text)
            detail = r.json()["detail"]
            assert "\n" not in detail and "synthq's limit" in detail, (name, detail)
            # The tokenizer's load is most of it (seconds on a loaded machine): the
            # render itself stops at synthq.data.sandbox.PROBE_SECONDS.
            assert took < 45, (name, took)
        names = [j["name"] for j in c.get("/api/jobs").json()]
        assert not set(hostile) & set(names), names
        assert _vm_hwm_mb(server.proc.pid) < 900, _vm_hwm_mb(server.proc.pid)
        # The tokenizer's own template, from a folder inside the data directory: accepted.
        r = c.post("/api/jobs", json={**_spec(unreachable), "path": "p.jsonl", "name": "ok",
                                      "tokenizer": str(tok)})
        assert r.status_code == 201, r.text
        detail = c.get(f"/api/jobs/{r.json()['job_id']}").json()
        assert detail["tokenizer"] == str((data / tok).resolve())


class _Recorder(ThreadingHTTPServer):
    """An OpenAI-compatible server that answers "ok" and records each call's
    Authorization header."""

    def __init__(self) -> None:
        self.auth: list[str] = []
        super().__init__(("127.0.0.1", 0), _RecorderHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _RecorderHandler(BaseHTTPRequestHandler):
    server: _Recorder

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the models list and health probes
        self._send(json.dumps({"object": "list", "data": [{"id": "sim-model"}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.auth.append(self.headers.get("Authorization", ""))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if not body.get("stream"):
            self._send(json.dumps({
                "id": "r", "object": "chat.completion", "created": 0, "model": "sim-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}], "usage": usage}).encode())
            return
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": usage}]
        head = {"id": "r", "object": "chat.completion.chunk", "created": 0,
                "model": "sim-model"}
        events = "".join(f"data: {json.dumps({**head, **c})}\n\n" for c in chunks)
        self._send((events + "data: [DONE]\n\n").encode(), "text/event-stream")


@pytest.fixture
def recorders() -> Iterator[Callable[[], _Recorder]]:
    started: list[_Recorder] = []

    def start() -> _Recorder:
        rec = _Recorder()
        threading.Thread(target=rec.serve_forever, daemon=True).start()
        started.append(rec)
        return rec

    yield start
    for rec in started:
        rec.shutdown()
        rec.server_close()


def test_servers_outside_the_allow_list_are_refused_and_get_no_key(
        api_server: Callable[..., Any], recorders: Callable[[], _Recorder],
        job_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
        ) -> None:
    from synthq.spec.config import get_settings

    allowed, other = recorders(), recorders()
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    port = allowed.server_address[1]
    strict = api_server(SYNTHQ_ALLOWED_SERVERS=f"127.0.0.1:{port}")
    unset = api_server(SYNTHQ_ALLOWED_SERVERS="")
    with httpx.Client(base_url=strict.url, headers=AUTH, timeout=60) as c:
        r = c.post("/api/jobs", json={**_spec(other.url), "path": "p.jsonl", "name": "other"})
        assert r.status_code == 403, r.text
        assert "not in SYNTHQ_ALLOWED_SERVERS" in r.json()["detail"]
        # A look-alike host is no match: `*` stays within one label.
        r = c.post("/api/jobs", json={**_spec(f"http://127.0.0.1.nip.io:{port}/v1"),
                                      "path": "p.jsonl", "name": "alike"})
        assert r.status_code == 403, r.text
        r = c.post("/api/jobs", json={**_spec(allowed.url), "path": "p.jsonl", "name": "mine"})
        assert r.status_code == 201, r.text
    with httpx.Client(base_url=unset.url, headers=AUTH, timeout=60) as c:
        r = c.post("/api/jobs", json={**_spec(allowed.url), "path": "p.jsonl", "name": "x"})
        assert r.status_code == 403 and "accepts no server URL" in r.json()["detail"], r.text
    assert other.auth == []  # the API probed nothing outside the list

    # A worker sends SYNTHQ_API_KEY only to the listed hosts: a job on both servers (made
    # by the CLI, which may name any) reaches both, the key only the allowed one.
    monkeypatch.setenv("SYNTHQ_API_KEY", INFERENCE_KEY)
    monkeypatch.setenv("SYNTHQ_ALLOWED_SERVERS", f"127.0.0.1:{port}")
    get_settings.cache_clear()
    report = job_factory([f"q{i}" for i in range(8)], servers=[allowed.url, other.url],
                         inflight_limit=2)
    settle(report.job_id)
    assert allowed.auth and other.auth, (allowed.auth, other.auth)
    assert set(allowed.auth) == {f"Bearer {INFERENCE_KEY}"}, allowed.auth
    assert not any(INFERENCE_KEY in a for a in other.auth), other.auth


def _same_shape(cli: Any, api: Any, where: str = "") -> None:
    """The CLI's JSON and the API's hold the same fields, recursively, and the same
    values (a datetime in either's ISO form)."""
    if isinstance(cli, dict) and isinstance(api, dict):
        assert set(cli) == set(api), (where, set(cli) ^ set(api))
        for key in cli:
            _same_shape(cli[key], api[key], f"{where}.{key}")
    elif isinstance(cli, list) and isinstance(api, list):
        assert len(cli) == len(api), where
        for i, (a, b) in enumerate(zip(cli, api, strict=True)):
            _same_shape(a, b, f"{where}[{i}]")
    elif isinstance(cli, str) and isinstance(api, str) and cli != api:
        assert datetime.fromisoformat(cli) == datetime.fromisoformat(api), (where, cli, api)
    elif not (isinstance(cli, float | int) and isinstance(api, float | int)):
        assert cli == api, (where, cli, api)


def test_one_record_for_the_api_and_the_cli_and_no_password_anywhere(
        api_server: Callable[..., Any], simulator: Callable[..., Any],
        job_factory: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0")
    secret_url = sim.url.replace("http://", f"http://user:{PASSWORD}@")
    report = job_factory(["a", "b [[sim:error]]"], servers=[secret_url], max_attempts=1,
                         gpu_hour_price=2.0)
    settle(report.job_id)
    server = api_server()
    texts: list[str] = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        api_job = c.get(f"/api/jobs/{report.job_id}").json()
        cli_text = run_cli("status", str(report.job_id), "--json").stdout
        cli_job = json.loads(cli_text)
        texts.append(cli_text)
        # Fields that move between the two reads: the rate window and the workers' ages.
        for moving in ("done_per_s", "eta_s", "workers", "cost"):
            api_job.pop(moving), cli_job.pop(moving)
        _same_shape(cli_job, api_job)
        assert "token_mismatches" in api_job  # shown by the CLI, missing from the API once
        sample_ids = [s["id"] for s in c.get(
            f"/api/jobs/{report.job_id}/samples").json()["items"]]
        for sid in sample_ids:
            api_sample = c.get(f"/api/samples/{sid}").json()
            cli_sample = json.loads(run_cli("sample", str(sid), "--json").stdout)
            _same_shape(cli_sample, api_sample)
            texts += [json.dumps(api_sample), json.dumps(cli_sample)]
        texts.append(run_cli("sample", str(sample_ids[0])).stdout)
        run = c.post(f"/api/jobs/{report.job_id}/exports", json={"format": "jsonl"}).json()
        for _ in range(200):
            run = c.get(f"/api/exports/{run['id']}").json()
            if run["state"] != "running":
                break
            time.sleep(0.05)
        assert run["state"] == "done", run
        assert run["manifest"]["cost"]["servers"], run["manifest"]
        texts += [json.dumps(run),
                  c.get(f"/api/exports/{run['id']}/files/manifest.json").text,
                  c.get(f"/api/jobs/{report.job_id}").text]
    texts.append(run_cli("status", str(report.job_id)).stdout)
    run_cli("export", str(report.job_id), "--format", "jsonl", "--out", str(tmp_path / "x"))
    texts.append((tmp_path / "x" / "manifest.json").read_text())
    everything = "\n".join(texts)
    assert "user:***@" in everything  # the server is shown, its password is not
    assert PASSWORD not in everything

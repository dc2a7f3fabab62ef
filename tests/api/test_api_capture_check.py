"""Issue 41 item 6, over real HTTP: 40 job creations naming a capture server that trickles
``/models`` a byte at a time left 32 requests stuck and 8 at 503, and ``/api/jobs`` and
``/ready`` gave no answer within 15 s. The check of a job's capture servers is bounded
(synthq.capture.stage.check_answer): each creation is refused within seconds, and the
API keeps answering meanwhile."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH
from hostile_capture import HostileServer, Request

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.processes]


def _trickle_models(server: HostileServer, conn: socket.socket, req: Request) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n")
    server.trickle(conn, b" " * 100_000, 0.5)


def test_forty_creations_naming_a_trickling_capture_server_leave_the_api_answering(
        api_server: Callable[..., Any], tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    api = api_server()
    trickle = HostileServer(_trickle_models)
    codes: list[int | str] = []
    lock = threading.Lock()

    def create(i: int) -> None:
        body = {"model": "m", "servers": ["http://127.0.0.1:9/v1"], "path": "p.jsonl",
                "name": f"j{i}", "capture_servers": [trickle.url]}
        try:
            with httpx.Client(base_url=api.url, headers=AUTH, timeout=60) as c:
                code: int | str = c.post("/api/jobs", json=body).status_code
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=create, args=(i,), daemon=True) for i in range(40)]
    try:
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0)  # the creations are on their way; the reads below go among them
        answered: dict[str, float] = {}
        with httpx.Client(base_url=api.url, headers=AUTH, timeout=15) as c:
            for path in ("/ready", "/api/jobs"):
                t0 = time.monotonic()
                try:
                    r = c.get(path)
                    assert r.status_code == 200, (path, r.status_code, r.text)
                    answered[path] = time.monotonic() - t0
                except httpx.TimeoutException:
                    answered[path] = float("inf")
        for t in threads:
            t.join(max(0.0, started + 60 - time.monotonic()))
        took = time.monotonic() - started
    finally:
        trickle.close()  # releases what the old code left hanging
        for t in threads:
            t.join(30)
    print(f"\n40 creations naming a trickling capture server: {sorted(set(map(str, codes)))} "
          f"in {took:.1f} s; /ready {answered['/ready']:.2f} s, /api/jobs "
          f"{answered['/api/jobs']:.2f} s; {trickle.requests.get('GET')} GETs")
    assert all(v < 10 for v in answered.values()), answered
    assert len(codes) == 40 and set(codes) == {422}, codes
    assert took < 30, took

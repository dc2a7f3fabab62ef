"""``synthq serve-check`` waits for the engine it is pointed at: the walkthroughs start vLLM
with its drafter in the background and run serve-check on the next line, minutes before
vLLM has loaded (it used to fail at once with a connection error)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from synthq.core.errors import UserError
from synthq.testing.procs import free_port
from synthq.training.served import wait_serving


class _Models(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"object": "list", "data": [{"id": "smol"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def late_server() -> Iterator[str]:
    """A server that starts listening 1.5 s after the test starts waiting."""
    port = free_port()
    servers: list[ThreadingHTTPServer] = []

    def start() -> None:
        time.sleep(1.5)
        server = ThreadingHTTPServer(("127.0.0.1", port), _Models)
        servers.append(server)
        server.serve_forever()

    threading.Thread(target=start, daemon=True).start()
    yield f"http://127.0.0.1:{port}/v1"
    for server in servers:
        server.shutdown()


def test_it_waits_for_a_server_still_starting(late_server: str) -> None:
    told: list[str] = []
    t0 = time.monotonic()
    wait_serving(late_server, "smol", timeout=30, notice=told.append)
    assert 1.0 < time.monotonic() - t0 < 30
    assert len(told) == 1 and "waiting for" in told[0] and "smol" in told[0], told


def test_it_gives_up_with_one_line_when_the_time_is_up() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(UserError, match=r"did not answer within 1 s \(ConnectError"):
        wait_serving(url, "smol", timeout=1)


def test_another_model_is_refused_at_once(late_server: str) -> None:
    with pytest.raises(UserError, match=r"serves \['smol'\], not 'llama'"):
        wait_serving(late_server, "llama", timeout=30)

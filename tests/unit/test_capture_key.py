"""The capture stage sends SYNTHQ_API_KEY only to hosts SYNTHQ_ALLOWED_SERVERS allows, as
the generation calls do (issue 24 item 8): two real HTTP servers on this host, one allowed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from synthq.capture.stage import server_key
from synthq.spec.config import get_settings


@pytest.fixture
def servers() -> Iterator[list[tuple[ThreadingHTTPServer, list[str | None]]]]:
    made = []
    for _ in range(2):
        seen: list[str | None] = []

        class Handler(BaseHTTPRequestHandler):
            heard = seen  # this server's own list

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.heard.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append((server, seen))
    yield made
    for server, _ in made:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("allow_first_only", [True, False])
def test_the_key_goes_to_allowed_capture_servers_only(
        servers: list[tuple[ThreadingHTTPServer, list[str | None]]],
        monkeypatch: pytest.MonkeyPatch, allow_first_only: bool) -> None:
    (first, seen_first), (second, seen_second) = servers
    monkeypatch.setenv("SYNTHQ_API_KEY", "sk-capture-secret")
    monkeypatch.setenv("SYNTHQ_ALLOWED_SERVERS",
                       f"127.0.0.1:{first.server_address[1]}" if allow_first_only else "")
    get_settings.cache_clear()
    try:
        with httpx.Client(auth=server_key) as client:
            for server in (first, second):
                client.get(f"http://127.0.0.1:{server.server_address[1]}/v1/models")
    finally:
        get_settings.cache_clear()
    assert seen_first == ["Bearer sk-capture-secret"]
    # No allow-list: every server is the operator's, as for generation.
    assert seen_second == ([None] if allow_first_only else ["Bearer sk-capture-secret"])

"""Issue 18 at the inference boundary: Retry-After on 5xx, what a broken connection
says, and the `import httpx` race."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import threading

import httpx2
import pytest

from synthq.core import errors
from synthq.serving.inference import ChatRequest, InferenceClient

REQUEST = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)


def _call(client: InferenceClient) -> None:
    async def go() -> None:
        try:
            await client.chat(REQUEST, total_timeout=5, stall_timeout=5)
        finally:
            await client.close()

    asyncio.run(go())


@pytest.mark.parametrize(("status", "cls"), [(503, errors.ServerError), (500, errors.ServerError),
                                             (429, errors.RateLimited)])
def test_retry_after_is_honoured_on_5xx_as_on_429(status: int, cls: type) -> None:
    client = InferenceClient("http://sim.test/v1", transport=httpx2.MockTransport(
        lambda req: httpx2.Response(status, json={"error": {"message": "busy"}},
                                    headers={"retry-after": "5"})))
    with pytest.raises(cls) as info:
        _call(client)
    assert info.value.retry_after == 5.0 and info.value.overload
    assert str(info.value).startswith(f"HTTP {status} (Retry-After 5 s): ")


def test_5xx_without_retry_after_is_not_an_overload() -> None:
    client = InferenceClient("http://sim.test/v1", transport=httpx2.MockTransport(
        lambda req: httpx2.Response(503, json={"error": {"message": "busy"}})))
    with pytest.raises(errors.ServerError) as info:
        _call(client)
    assert info.value.retry_after is None and not info.value.overload
    assert str(info.value).startswith("HTTP 503: ")


def test_connection_closed_before_the_headers_is_named() -> None:
    """A real server that reads the request and closes: the stored message says so, not
    only openai's "APIConnectionError: Connection error."."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        data = b""
        while b"\r\n\r\n" not in data:  # the whole request, so the close is a FIN, not RST
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(errors.ConnectionFailed) as info:
            _call(InferenceClient(f"http://127.0.0.1:{port}/v1"))
    finally:
        thread.join(5)
        server.close()
    message = str(info.value)
    # The call posts through httpx itself (not openai's request path): the transport's own
    # error is the message, no "Connection error." wrapper to see through.
    assert message.startswith(("APIConnectionError: Connection error. (",
                               "RemoteProtocolError: ")), message
    assert "disconnected without sending a response" in message.lower(), message


RACE = textwrap.dedent('''
    import asyncio, sys, threading
    import httpx2
    import synthq.serving.health, synthq.serving.inference  # a worker's imports before its calls
    from synthq.serving.inference import ChatRequest, InferenceClient

    BODY = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}'
            b"\\n\\ndata: [DONE]\\n\\n")

    def handler(request):
        return httpx2.Response(200, content=BODY, headers={"content-type": "text/event-stream"})

    async def main():
        client = InferenceClient("http://sim.test/v1", transport=httpx2.MockTransport(handler))
        req = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        await client.chat(req, total_timeout=5, stall_timeout=5)  # warm-up
        importer = threading.Thread(target=lambda: __import__("httpx"))
        importer.start()
        res = await asyncio.gather(*(client.chat(req, total_timeout=5, stall_timeout=5)
                                     for _ in range(300)), return_exceptions=True)
        importer.join()
        bad = [r for r in res if isinstance(r, BaseException)]
        print("failed", len(bad), sorted({type(b).__name__ for b in bad}))

    asyncio.run(main())
''')


@pytest.mark.processes
def test_import_httpx_in_another_thread_during_calls() -> None:
    """D: a first `import httpx` in another thread while calls run showed openai a
    half-imported module (AttributeError; 8 to 25 of 300 calls lost here before).
    Now httpx is loaded with synthq.serving.inference, before any call."""
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "failed 0 []", out.stdout


def _full(kind: str) -> Exception:
    import sqlite3

    import psycopg.errors
    from sqlalchemy.exc import OperationalError

    if kind == "sqlite":
        return OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))
    return OperationalError("INSERT", {}, psycopg.errors.DiskFull(
        "could not extend file \"base/16384/2619\": No space left on device"))


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_disk_full_is_recognised_and_not_retried(kind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """C: SQLite's "database or disk is full" and PostgreSQL's 53100 are not transient:
    with_db_retry raises DiskFull at once (before: retried as an outage)."""
    from sqlalchemy.exc import OperationalError

    from synthq.store.db import disk_full, with_db_retry

    assert disk_full(_full(kind))
    assert not disk_full(OperationalError("SELECT", {}, Exception("connection refused")))
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", "sqlite:////data/volume/synthq.db")
    from synthq.spec.config import get_settings

    get_settings.cache_clear()
    tries = []

    def write() -> None:
        tries.append(1)
        raise _full(kind)

    try:
        with pytest.raises(errors.DiskFull, match="^disk full at /data/volume: free space and "
                                                  "run the same command again$"):
            with_db_retry(write, attempts=20)
    finally:
        get_settings.cache_clear()
    assert len(tries) == 1


def test_writer_holds_answers_through_a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """C: the batch writer keeps the writes in hand while the disk is full (says so once,
    in ``disk_full``), commits them when space returns; ``abandon()`` fails them at once."""
    import time

    from synthq.serving.writer import Writer

    full = {"left": 3}
    committed: list[list[object]] = []

    def transaction(writes: list[object]) -> list[object]:
        if full["left"]:
            full["left"] -= 1
            raise _full("postgresql")
        committed.append(writes)
        return [True for _ in writes]

    monkeypatch.setattr(Writer, "_transaction", staticmethod(transaction))
    writer = Writer(retry_seconds=60)
    try:
        future = writer.submit(lambda s, now: True)
        deadline = time.monotonic() + 5
        while writer.disk_full is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.disk_full and "53100" not in writer.disk_full  # the message, not a code
        assert future.result(timeout=10) is True  # written once space returned
        assert writer.disk_full is None and len(committed) == 1
        full["left"] = 10**6
        held = writer.submit(lambda s, now: True)
        while writer.disk_full is None:
            time.sleep(0.01)
        writer.abandon()
        with pytest.raises(errors.DiskFull):
            held.result(timeout=10)
    finally:
        writer.close(timeout=10)

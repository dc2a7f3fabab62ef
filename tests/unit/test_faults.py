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

from synthq import errors
from synthq.inference import ChatRequest, InferenceClient

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
        for _ in range(1):
            conn, _ = server.accept()
            conn.recv(65536)
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
    assert message.startswith("APIConnectionError: Connection error. (")
    assert "disconnected without sending a response" in message.lower(), message


RACE = textwrap.dedent('''
    import asyncio, sys, threading
    import httpx2
    import synthq.health, synthq.inference  # what a worker has imported before its calls
    from synthq.inference import ChatRequest, InferenceClient

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


def test_import_httpx_in_another_thread_during_calls() -> None:
    """D: a first `import httpx` in another thread while calls run showed openai a
    half-imported module (AttributeError; 8 to 25 of 300 calls lost here before).
    Now httpx is loaded with synthq.inference, before any call."""
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "failed 0 []", out.stdout

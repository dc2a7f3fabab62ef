"""A call's HTTP as synthq sends and reads it, against a raw asyncio server that frames
and splits the body as a hostile or merely unusual server would: the request sent to the
connection pool without httpx's per-request layers (``synthq.serving.transport.Direct``), and
the chunked body unframed by synthq (:func:`synthq.core.netio.chunked_body`) instead of one
h11 event per chunk.

Every good body must read as h11 reads it, whatever the chunk sizes, extensions,
trailers and socket splits; every malformed one fails the call as a broken response
and its connection is not reused; a good one leaves its keep-alive connection usable.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from synthq.core import errors, netio
from synthq.serving.inference import ChatRequest, InferenceClient

TOKENS = ["Hel", "lo", ", ", "wör", "ld", "!"] * 3
TEXT = "".join(TOKENS)


def sse_body() -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in TOKENS]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(TOKENS),
                                            "total_tokens": 3 + len(TOKENS)}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def chunked(body: bytes, rng: random.Random, *, ext: bool = False,
            trailer: bytes = b"") -> bytes:
    """``body`` in chunks of random sizes (1-40 bytes), with extensions and blanks after
    the size when ``ext``, ended by the last chunk and ``trailer`` lines."""
    out, i = [], 0
    while i < len(body):
        n = rng.randint(1, 40)
        size = f"{min(n, len(body) - i):x}".encode()
        if ext and rng.random() < 0.5:
            size = size.upper() + rng.choice([b";a=1", b";name=\"v\"", b"  ", b"; x"])
        out.append(size + b"\r\n" + body[i:i + n] + b"\r\n")
        i += n
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """Answers each request on a connection with ``respond(reader, writer, n)`` (n: the
    request's number on the server); counts connections."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                self.requests += 1
                await self.respond(reader, writer, self.requests)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def write_split(writer: asyncio.StreamWriter, data: bytes, rng: random.Random) -> None:
    """``data`` in random pieces of 1-9 bytes, each its own write and drain."""
    i = 0
    while i < len(data):
        n = rng.randint(1, 9) if len(data) < 8192 else 4096
        writer.write(data[i:i + n])
        await writer.drain()
        await asyncio.sleep(0)
        i += n


def request() -> ChatRequest:
    return ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=64)


async def chat(url: str, calls: int = 1, stall: float = 5.0) -> list[Any]:
    client = InferenceClient(url, max_connections=1)
    try:
        out: list[Any] = []
        for _ in range(calls):
            try:
                out.append(await client.chat(request(), total_timeout=10, stall_timeout=stall))
            except errors.SampleError as exc:
                out.append(exc)
        return out
    finally:
        await client.close()


@pytest.fixture
def unframed(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each body was unframed by synthq (True) or left to h11 (False)."""
    seen: list[bool] = []
    real = netio.chunked_body

    def spy(stream: Any) -> Any:
        body = real(stream)
        seen.append(body is not None)
        return body

    monkeypatch.setattr(netio, "chunked_body", spy)
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_a_chunked_answer_split_anywhere_reads_whole_on_one_connection(
        seed: int, unframed: list[bool]) -> None:
    rng = random.Random(seed)
    trailers = [b"", b"x-checksum: abc\r\n", b"a: 1\r\nb: 2\r\n"]

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        body = chunked(sse_body(), rng, ext=True, trailer=rng.choice(trailers))
        await write_split(writer, HEAD + body, rng)

    async def main() -> tuple[list[Any], int]:
        server = RawServer(respond)
        async with server as url:
            results = await chat(url, calls=3)
        return results, server.connections

    results, connections = asyncio.run(main())
    for r in results:
        assert not isinstance(r, Exception), r
        assert r.content == TEXT and r.finish_reason == "stop" and r.completion_tokens == 18
    assert unframed == [True, True, True]
    assert connections == 1  # each response ended in h11's state: the connection was reused


def test_the_body_after_the_headers_in_the_same_read_is_not_lost(unframed: list[bool]) -> None:
    """Headers and the whole body in one write: h11 has read part of the body with the
    headers, and that part is taken from it."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        writer.write(HEAD + chunked(sse_body(), random.Random(n)))
        await writer.drain()

    async def main() -> list[Any]:
        async with RawServer(respond) as url:
            return await chat(url, calls=2)

    results = asyncio.run(main())
    assert [r.content for r in results] == [TEXT, TEXT]
    assert unframed == [True, True]


MALFORMED = {
    "footer": lambda body: body.replace(b"\r\n", b"\r\r", 2).replace(b"\r\r", b"\r\n", 1),
    "header": lambda body: b"zz\r\n" + body,
    "negative": lambda body: b"-1\r\n" + body,
    "endless-header": lambda body: b"1" + b" " * 65536,  # and nothing more: no CRLF, no close
    "huge-size": lambda body: b"f" * 21 + b"\r\n" + body,
    "trailer": lambda body: body[:-2] + b"no colon here\r\n\r\n",
    "cut-mid-chunk": lambda body: body[:len(body) // 2],
    "cut-before-last": lambda body: body[:body.rindex(b"0\r\n")],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_chunked_body_fails_the_call_and_its_connection(case: str) -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        body = chunked(sse_body(), random.Random(n))
        if n == 1:
            writer.write(HEAD)
            await write_split(writer, MALFORMED[case](body), random.Random(0))
            if case.startswith("cut"):
                writer.close()
            return
        writer.write(HEAD + body)
        await writer.drain()

    async def main() -> tuple[list[Any], int]:
        server = RawServer(respond)
        async with server as url:
            results = await chat(url, calls=2, stall=2.0)
        return results, server.connections

    results, connections = asyncio.run(main())
    # A ServerError at once: not a stall (2 s), not a body grown without bound.
    assert isinstance(results[0], errors.ServerError), results[0]
    assert "broke mid-response" in str(results[0]) or "malformed" in str(results[0])
    assert results[1].content == TEXT  # the next call works, on a new connection
    assert connections == 2


def test_a_body_that_stops_mid_chunk_stalls_within_the_stall_timeout() -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        body = chunked(sse_body(), random.Random(n))
        writer.write(HEAD + body[:len(body) // 3])
        await writer.drain()
        await asyncio.sleep(30)

    async def main() -> list[Any]:
        async with RawServer(respond) as url:
            return await chat(url, stall=0.5)

    loop_start = asyncio.run(_timed(main))
    result, took = loop_start
    assert isinstance(result[0], errors.StalledError), result[0]
    assert "mid-stream" in str(result[0])
    assert took < 5


def test_a_body_that_trickles_within_the_stall_timeout_is_read_to_its_end() -> None:
    """Every gap shorter than the stall timeout, the whole body much longer: the
    deadline moves with each read (a timer set by the first read must not end it)."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        body = chunked(sse_body(), random.Random(n))
        writer.write(HEAD)
        step = len(body) // 8 + 1
        for i in range(0, len(body), step):
            writer.write(body[i:i + step])
            await writer.drain()
            await asyncio.sleep(0.15)

    async def main() -> list[Any]:
        async with RawServer(respond) as url:
            return await chat(url, calls=2, stall=0.4)

    results, took = asyncio.run(_timed(main))
    assert [getattr(r, "content", r) for r in results] == [TEXT, TEXT]
    assert took > 4 * 0.4  # it did trickle, past several stall timeouts


async def _timed(fn: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = await fn()
    return out, loop.time() - start


def test_a_cookie_the_server_sets_goes_back_with_the_next_calls() -> None:
    """httpx's cookie jar, kept on the direct path: a load balancer's sticky session."""
    seen: list[bytes] = []

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        head = HEAD.replace(b"\r\n\r\n", b"\r\nset-cookie: lb=node7; Path=/\r\n\r\n", 1) \
            if n == 1 else HEAD
        writer.write(head + chunked(sse_body(), random.Random(n)))
        await writer.drain()

    class Recording(RawServer):
        async def _serve(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
            original = reader.readuntil

            async def readuntil(separator: bytes = b"\n") -> bytes:
                data = await original(separator)
                seen.append(data)
                return data

            reader.readuntil = readuntil  # type: ignore[method-assign]
            await super()._serve(reader, writer)

    async def main() -> list[Any]:
        async with Recording(respond) as url:
            return await chat(url, calls=3)

    results = asyncio.run(main())
    assert [r.content for r in results] == [TEXT] * 3
    cookies = [b"cookie: lb=node7" in head.lower() for head in seen]
    assert cookies == [False, True, True]


def test_the_direct_path_is_taken_only_on_synthqs_own_transport() -> None:
    """A transport given from outside (a test's, a mock) keeps httpx's own path."""
    import httpx2

    async def main() -> tuple[list[bool], list[bool]]:
        plain = InferenceClient("http://127.0.0.1:9/v1", max_connections=40)
        given = InferenceClient("http://127.0.0.1:9/v1", transport=httpx2.AsyncHTTPTransport())
        try:
            return [d is not None for d in plain._direct], [d is not None for d in given._direct]
        finally:
            await plain.close()
            await given.close()

    plain, given = asyncio.run(main())
    assert plain == [True, True, True]  # 40 connections: three shards
    assert given == [False]


def test_an_error_status_on_the_direct_path_reads_as_the_openai_client_reads_it() -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      n: int) -> None:
        body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 7\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()

    async def main() -> list[Any]:
        async with RawServer(respond) as url:
            return await chat(url)

    [result] = asyncio.run(main())
    assert isinstance(result, errors.RateLimited), result
    assert result.retry_after == 7 and "slow down" in str(result)

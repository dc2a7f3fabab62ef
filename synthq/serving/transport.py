"""The HTTP under the chat client: one SSL context, a call sent straight to a connection
pool, and a response body read through as few layers as possible.

Each piece skips a layer of httpx that costs CPU per call or per streamed chunk, and
only where that layer would do nothing; anything else takes httpx's own path. Errors
leave as httpx's exceptions (httpcore's mapped by httpx's own mapping), which the client
(:mod:`synthq.serving.inference`) converts.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpcore2
import httpx2

from synthq.core import netio

try:  # httpx's own mapping of httpcore's errors, and its response stream (see Direct)
    from httpx2._transports.default import AsyncResponseStream as _AsyncResponseStream
    from httpx2._transports.default import map_httpcore_exceptions as _map_httpcore_exceptions
except ImportError:  # another httpx2: every call takes httpx's own path
    _map_httpcore_exceptions = None  # type: ignore[assignment]

__all__ = ["Direct", "body_bytes", "error_response", "ssl_context"]

_SSL: ssl.SSLContext | None = None


def ssl_context() -> ssl.SSLContext:
    """One SSL context for every connection pool of the process: making one loads the CA
    certificates (~0.1 s of CPU on a busy machine), and a client with a cap of 256 has 16
    pools, built on the event loop by its first call, which held every other call back."""
    global _SSL
    if _SSL is None:
        _SSL = httpx2.create_ssl_context()
    return _SSL


def error_response(response: httpx2.Response, data: bytes) -> httpx2.Response:
    """A copy of an error ``response`` holding the (bounded, decoded) ``data`` as its body,
    for the openai client's message extraction."""
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return httpx2.Response(response.status_code, headers=headers, content=data,
                           request=response.request)


@dataclass(frozen=True, slots=True)
class Direct:
    """A call sent to a shard's connection pool (httpcore2) without httpx's per-request
    layers: building and merging the request, auth, redirects, cookies, event hooks,
    the response's timing wrapper. About a tenth of a streaming worker's CPU.

    Only where none of them does anything: a plain transport on synthq's asyncio
    backend for the URL (no proxy mounted for it), and (checked per call) no cookie
    the server has set. The request's headers are the ones httpx would send, merged
    once; errors are httpcore's mapped to httpx's by httpx's own mapping."""

    pool: httpcore2.AsyncConnectionPool
    url: httpcore2.URL
    #: The request headers as httpx merges them, without Content-Length.
    headers: list[tuple[bytes, bytes]]

    @classmethod
    def of(cls, http: httpx2.AsyncClient, url: str, headers: Mapping[str, str]
           ) -> Direct | None:
        if _map_httpcore_exceptions is None:
            return None
        sample = http.build_request("POST", url, content=b"", headers=headers)
        transport = http._transport_for_url(sample.url)
        pool = getattr(transport, "_pool", None)
        if type(transport) is not httpx2.AsyncHTTPTransport or \
                type(pool) is not httpcore2.AsyncConnectionPool or \
                type(getattr(pool, "_network_backend", None)) is not netio.AsyncioBackend:
            return None
        target = httpcore2.URL(scheme=sample.url.raw_scheme, host=sample.url.raw_host,
                               port=sample.url.port, target=sample.url.raw_path)
        raw = [(k, v) for k, v in sample.headers.raw if k.lower() != b"content-length"]
        return cls(pool, target, raw)

    async def send(self, body: bytes, timeout: httpx2.Timeout) -> httpx2.Response:
        request = httpcore2.Request(
            b"POST", self.url, headers=[*self.headers, (b"Content-Length", b"%d" % len(body))],
            content=body, extensions={"timeout": timeout.as_dict()})
        assert _map_httpcore_exceptions is not None
        with _map_httpcore_exceptions():
            response = await self.pool.handle_async_request(request)
        stream = response.stream
        assert isinstance(stream, AsyncIterable)  # the async pool's, as httpx asserts
        return httpx2.Response(response.status, headers=response.headers,
                               stream=_AsyncResponseStream(stream),
                               extensions=response.extensions)


def body_bytes(response: httpx2.Response) -> AsyncIterator[bytes]:
    """The body as it arrives, through as few async-generator layers as possible.

    Each streamed chunk passes through every layer: httpx's ``aiter_bytes``,
    ``aiter_raw``, its bound and transport streams, httpcore's pool stream and
    connection stream. An uncompressed body on httpcore's HTTP/1.1 connection is
    read from the connection stream itself (four layers less per chunk; closing
    the response still goes through all of them), with httpcore's exceptions
    mapped to httpx's as the skipped layer would. Anything else: ``aiter_raw``
    or ``aiter_bytes``.
    """
    if response.is_stream_consumed or \
            response.headers.get("content-encoding", "identity") != "identity":
        return response.aiter_bytes()
    # httpx's response stream wraps httpcore's (two layers, or one on the Direct path).
    inner: Any = response.stream
    for _ in range(3):
        if type(inner).__name__ == "HTTP11ConnectionByteStream":
            break
        inner = getattr(inner, "_stream", None) or getattr(inner, "_httpcore_stream", None)
    if type(inner).__name__ != "HTTP11ConnectionByteStream" or \
            not hasattr(inner, "__aiter__") or response.is_closed:
        return response.aiter_raw()
    response.is_stream_consumed = True
    # A chunked body (every streamed answer) is unframed a read at a time, not a chunk.
    return _connection_bytes(netio.chunked_body(inner) or inner)


async def _connection_bytes(stream: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    try:
        async for data in stream:
            yield data
    except httpcore2.TimeoutException as exc:
        raise httpx2.ReadTimeout(str(exc)) from exc
    except httpcore2.RemoteProtocolError as exc:
        raise httpx2.RemoteProtocolError(str(exc)) from exc
    except (httpcore2.NetworkError, httpcore2.ProtocolError) as exc:
        raise httpx2.ReadError(str(exc)) from exc

"""The call to an OpenAI-compatible server (vLLM, SGLang, TGI), and its failures.

One async :class:`InferenceClient` per server per process, on the process's
event loop; its connection pool is sized to the server's in-flight limit. The call streams and
reads the raw server-sent-event lines (``json.loads`` per line costs about a
fifth of the CPU of the client's chunk objects, which matters at thousands of
chunks a second). Two clocks bound it:

* the **stall timeout** is the transport's read timeout: no byte for that long
  and the call is ``stalled``;
* the **total timeout** bounds the whole call (``asyncio.timeout``): a long,
  healthy generation is fine until then.

The client's own retries are off (``max_retries=0``); retrying happens in one
layer only, synthq's (:mod:`synthq.retry`). Every ``openai``/``httpx``
exception leaves this module converted into a :mod:`synthq.errors` class.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpcore2

# openai reads sys.modules["httpx"] on every response (its legacy-httpx shims): a
# first `import httpx` in another thread (a health probe, huggingface_hub) while
# calls run would show them a half-imported module (AttributeError, calls lost,
# issue 18). Imported here, before any call can run, it is never half-imported.
import httpx  # noqa: F401
import httpx2
import openai

from synthq import errors, netio
from synthq.jobspec import RESERVED_BODY

__all__ = ["ChatRequest", "ChatResult", "InferenceClient", "parse_retry_after"]

#: Seconds to open a TCP connection before the call counts as a connection failure.
CONNECT_TIMEOUT = 10.0
#: Most connections in one connection pool (a server's connections are split into pools).
POOL_SHARD = 16

_SSL: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    """One SSL context for every connection pool of the process: making one loads the CA
    certificates (~0.1 s of CPU on a busy machine), and a client with a cap of 256 has 16
    pools, built on the event loop by its first call, which held every other call back."""
    global _SSL
    if _SSL is None:
        _SSL = httpx2.create_ssl_context()
    return _SSL


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    #: Bytes of streamed body after which the call fails as ``response_too_large``.
    max_response_bytes: int = 4 << 20
    #: The row's ``{"tools": [...], "tool_choice": ...}``, sent as request fields.
    tools: dict[str, Any] | None = None


@dataclass(slots=True)
class ChatResult:
    content: str
    reasoning_content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    #: Token ids when the server returns them (vLLM ``return_token_ids``).
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    latency_s: float
    ttft_s: float | None
    #: Characters repaired so the text can be stored: ``{"invalid_utf8": n, "nul": n,
    #: "surrogate": n}`` (each replaced by U+FFFD), or None when nothing was.
    repairs: dict[str, int] | None = None
    #: The answer's tool calls, OpenAI form (``[{"id", "type", "function": {"name",
    #: "arguments"}}]``), or None.
    tool_calls: list[dict[str, Any]] | None = None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds form), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from inference servers; fall back to backoff


def _is_context_length(message: str) -> bool:
    text = message.lower()
    return any(s in text for s in ("maximum context length", "context_length_exceeded",
                                    "context length", "too many tokens", "prompt is too long"))


def _convert_status(exc: openai.APIStatusError) -> errors.SampleError:
    status = exc.status_code
    # Retry-After is honoured wherever it comes (429, and 503 from a server or a
    # gateway with a bounded queue): it is named in the message, where the
    # dispatcher reads it back to space its probes of that server.
    retry_after = parse_retry_after(exc.response.headers.get("retry-after"))
    said = f" (Retry-After {retry_after:g} s)" if retry_after is not None else ""
    message = f"HTTP {status}{said}: {exc.message}"[:2000]
    if status == 429:
        return errors.RateLimited(message, retry_after)
    if status >= 500 or status in (408, 409):
        return errors.ServerError(message, retry_after)
    if _is_context_length(str(exc.message)) or _is_context_length(str(exc.body)):
        return errors.ContextLength(message)
    return errors.BadRequest(message)


def _describe(exc: BaseException) -> str:
    """``Class: message``, with what caused it: openai's "Connection error." alone does
    not say whether the server closed the connection before its headers, refused it,
    or reset it."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    for _ in range(3):
        if cause is None:
            break
        said = str(cause)
        if said and said not in text:
            text += f" ({type(cause).__name__}: {said})"
        cause = cause.__cause__ or cause.__context__
    return text


async def _sse_lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """Lines of a server-sent-event body, as bytes (no text decoding layer per chunk:
    ``json.loads`` takes UTF-8 bytes). More than ``limit`` bytes in all fails the call."""
    pending = b""
    seen = 0
    async for data in chunks:
        seen += len(data)
        if seen > limit:
            raise errors.ResponseTooLarge(
                f"the streamed response passed max_response_bytes={limit:,}")
        if pending:
            data = pending + data
        *lines, pending = data.split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


def _parse(data: bytes, repairs: dict[str, int]) -> Any:
    """One SSE payload; invalid UTF-8 is decoded with U+FFFD and counted."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        repairs["invalid_utf8"] = repairs.get("invalid_utf8", 0) + text.count("\ufffd")
        return json.loads(text)


#: Characters no database text column takes: NUL (PostgreSQL) and lone surrogates (UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str | None, repairs: dict[str, int]) -> str | None:
    """``text`` with NUL and lone surrogates replaced by U+FFFD, each counted in ``repairs``."""
    if text is None or not _UNSTORABLE.search(text):
        return text

    def fix(match: re.Match[str]) -> str:
        kind = "nul" if match.group() == "\x00" else "surrogate"
        repairs[kind] = repairs.get(kind, 0) + 1
        return "\ufffd"

    return _UNSTORABLE.sub(fix, text)


class _Accumulator:
    """Builds the answer from SSE chunk payloads."""

    __slots__ = ("content", "reasoning", "finish_reason", "usage", "token_ids", "prompt_token_ids",
                 "calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        #: Streamed tool calls by index: id, name and the argument pieces.
        self.calls: dict[int, dict[str, Any]] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if piece := delta.get("content"):
                self.content.append(piece)
            # vLLM: reasoning_content; some versions and SGLang: reasoning.
            if piece := delta.get("reasoning_content") or delta.get("reasoning"):
                self.reasoning.append(piece)
            if calls := delta.get("tool_calls"):
                self._add_calls(calls)
            if ids := choice.get("token_ids"):
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _add_calls(self, calls: list[dict[str, Any]]) -> None:
        if self.calls is None:
            self.calls = {}
        for piece in calls:
            at = self.calls.setdefault(int(piece.get("index") or 0),
                                       {"id": "", "name": "", "arguments": []})
            if piece.get("id"):
                at["id"] = piece["id"]
            function = piece.get("function") or {}
            if function.get("name"):
                at["name"] += function["name"]
            if function.get("arguments"):
                at["arguments"].append(function["arguments"])

    def tool_calls(self, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
        if not self.calls:
            return None
        return [{"id": storable(c["id"], repairs) or f"call_{i}", "type": "function",
                 "function": {"name": storable(c["name"], repairs) or "",
                              "arguments": storable("".join(c["arguments"]), repairs) or ""}}
                for i, c in sorted(self.calls.items())]


def _tool_calls(calls: Any, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
    """A non-streamed message's ``tool_calls``, in the form the streamed path builds."""
    if not calls or not isinstance(calls, list):
        return None
    out = []
    for i, call in enumerate(c for c in calls if isinstance(c, dict)):
        function = call.get("function") or {}
        out.append({"id": storable(str(call.get("id") or ""), repairs) or f"call_{i}",
                    "type": "function",
                    "function": {"name": storable(str(function.get("name") or ""), repairs) or "",
                                 "arguments": storable(str(function.get("arguments") or ""),
                                                       repairs) or ""}})
    return out or None


def _completion_result(document: Any, repairs: dict[str, int], start: float) -> ChatResult:
    """A non-streamed ``chat.completion`` document as a :class:`ChatResult`."""
    choices = document.get("choices") if isinstance(document, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        if isinstance(document, dict) and "error" in document:
            raise errors.ServerError(f"error in response: {document['error']}"[:2000])
        raise errors.ServerError(f"malformed response (no choices): {str(document)[:200]}")
    choice = choices[0]
    message = choice.get("message") or {}
    if not isinstance(message, dict):
        raise errors.ServerError(f"malformed response message: {str(message)[:200]}")
    usage = document.get("usage") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    ids = choice.get("token_ids")
    prompt_ids = document.get("prompt_token_ids") or choice.get("prompt_token_ids")
    return ChatResult(
        content=storable(str(message.get("content") or ""), repairs) or "",
        reasoning_content=storable(str(reasoning), repairs) if reasoning else None,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens") if isinstance(usage, dict) else None,
        completion_tokens=usage.get("completion_tokens") if isinstance(usage, dict) else None,
        prompt_token_ids=list(prompt_ids) if prompt_ids else None,
        completion_token_ids=list(ids) if ids else None,
        latency_s=time.monotonic() - start,
        ttft_s=None,  # the whole answer arrives at once: no first-token time to measure
        tool_calls=_tool_calls(message.get("tool_calls"), repairs),
        repairs=repairs or None,
    )


def _body_bytes(response: httpx2.Response) -> AsyncIterator[bytes]:
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
    inner: Any = response.stream
    for attribute in ("_stream", "_httpcore_stream", "_stream"):
        inner = getattr(inner, attribute, None)
    if type(inner).__name__ != "HTTP11ConnectionByteStream" or \
            not hasattr(inner, "__aiter__") or response.is_closed:
        return response.aiter_raw()
    response.is_stream_consumed = True
    return _connection_bytes(inner)


async def _connection_bytes(stream: Any) -> AsyncIterator[bytes]:
    try:
        async for data in stream:
            yield data
    except httpcore2.TimeoutException as exc:
        raise httpx2.ReadTimeout(str(exc)) from exc
    except httpcore2.RemoteProtocolError as exc:
        raise httpx2.RemoteProtocolError(str(exc)) from exc
    except (httpcore2.NetworkError, httpcore2.ProtocolError) as exc:
        raise httpx2.ReadError(str(exc)) from exc


class InferenceClient:
    """A streaming chat client for one server base URL (``http://host:8000/v1``).

    Async: every call of a worker process runs on that process's one event
    loop (:mod:`synthq.executor`). ``max_connections`` sizes the pool; the
    executor makes a new client when a server's limit grows.
    """

    def __init__(self, base_url: str, *, api_key: str = "EMPTY", max_connections: int = 64,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url
        self.max_connections = max_connections
        # The connection pool scans all its connections when a request starts and when
        # one ends: at 128 connections that was a seventh of a worker's CPU. So the
        # connections are split into pools of at most POOL_SHARD, and each call takes
        # the least busy one (room is guaranteed while calls <= max_connections).
        shards = 1 if transport is not None else -(-max_connections // POOL_SHARD)
        size = -(-max_connections // shards)
        limits = httpx2.Limits(max_connections=size, max_keepalive_connections=size)
        self._pools: list[httpx2.AsyncClient] = []
        for _ in range(shards):
            shard_transport = transport
            if shard_transport is None:
                shard_transport = httpx2.AsyncHTTPTransport(limits=limits, verify=_ssl_context())
                # asyncio-protocol sockets: a third of the CPU per chunk
                netio.install(shard_transport)
            self._pools.append(httpx2.AsyncClient(limits=limits, transport=shard_transport))
        self._busy = [0] * shards
        http = self._pools[0]
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                          http_client=http)
        self._url = base_url.rstrip("/") + "/chat/completions"
        # identity: a compressed event stream would arrive in bursts, and cost a decoder.
        self._headers = {"Authorization": f"Bearer {api_key}",
                         "Content-Type": "application/json", "Accept-Encoding": "identity"}

    async def close(self) -> None:
        await self._client.close()
        for pool in self._pools[1:]:
            await pool.aclose()

    def _body(self, request: ChatRequest, **more: Any) -> bytes:
        """The request's JSON body, as the openai client would send it."""
        # The fields synthq sets win over extra_body, and what no job may send is left
        # out (a job stored before it was refused): see synthq.jobspec.RESERVED_BODY.
        body: dict[str, Any] = {k: v for k, v in {**request.sampling, **request.extra_body}
                                .items() if k not in RESERVED_BODY}
        body.update(model=request.model, messages=request.messages,
                    max_tokens=request.max_tokens, **more)
        if request.tools:
            # The row's tool_choice, else "auto" with tools (what vLLM defaults to, and
            # what speculators sends): a server whose default differs calls the same.
            body.update(request.tools)
            if body.get("tools") and "tool_choice" not in request.tools:
                body["tool_choice"] = "auto"
        return json.dumps(body).encode()

    @asynccontextmanager
    async def _send(self, body: bytes, timeout: httpx2.Timeout
                    ) -> AsyncIterator[httpx2.Response]:
        """POST ``body`` to the chat endpoint on the client's pool; the response is open
        (its body unread) inside the block and closed after. An HTTP error status is
        raised as the openai client raises it, so both paths convert errors alike.

        The request is built here, not by the openai client: its request building
        (options, headers, transforms) cost more CPU than the rest of a short call.
        """
        busy = self._busy
        shard = busy.index(min(busy)) if len(busy) > 1 else 0
        http = self._pools[shard]
        http_request = http.build_request("POST", self._url, content=body,
                                          headers=self._headers, timeout=timeout)
        busy[shard] += 1
        try:
            response = await http.send(http_request, stream=True)
        except BaseException:
            busy[shard] -= 1
            raise
        try:
            if response.status_code >= 400:
                await response.aread()
                raise self._client._make_status_error_from_response(response)
            yield response
        finally:
            busy[shard] -= 1
            await response.aclose()

    async def _complete(self, request: ChatRequest, start: float,
                        total_timeout: float) -> ChatResult:
        """A non-streamed call: one request, one JSON body, no chunk layers.

        The request is built here (the openai client's request building costs
        more CPU than the call itself at zero latency); errors are converted as
        the streaming path converts them. Only the total timeout applies.
        """
        timeout = httpx2.Timeout(total_timeout, connect=min(CONNECT_TIMEOUT, total_timeout))
        limit = request.max_response_bytes
        answering = False
        try:
            async with self._send(self._body(request), timeout) as response:
                answering = True
                parts: list[bytes] = []
                seen = 0
                async for data in _body_bytes(response):
                    seen += len(data)
                    if seen > limit:
                        raise errors.ResponseTooLarge(
                            f"the response passed max_response_bytes={limit:,}")
                    parts.append(data)
        except (openai.APITimeoutError, httpx2.TimeoutException) as exc:
            raise errors.TimeoutError_(
                f"call exceeded the total timeout of {total_timeout:g} s") from exc
        except openai.APIStatusError as exc:
            raise _convert_status(exc) from exc
        except (openai.APIConnectionError, httpx2.TransportError) as exc:
            if answering:
                raise errors.ServerError(
                    f"the connection broke mid-response: {_describe(exc)}"[:2000]) from exc
            raise errors.ConnectionFailed(_describe(exc)[:2000]) from exc
        raw = b"".join(parts)
        repairs: dict[str, int] = {}
        try:
            document = _parse(raw, repairs)
        except ValueError as exc:  # JSONDecodeError: an HTML error page, a cut body
            raise errors.ServerError(
                f"malformed response (not a chat.completion JSON document): {raw[:200]!r}"
            ) from exc
        return _completion_result(document, repairs, start)

    async def chat(self, request: ChatRequest, *, total_timeout: float,
                   stall_timeout: float, stream: bool = True) -> ChatResult:
        """One chat completion, streamed unless ``stream`` is False (then no stall clock:
        the answer comes in one body); raise a :class:`synthq.errors.SampleError` on failure."""
        start = time.monotonic()
        try:
            async with asyncio.timeout(total_timeout):
                if not stream:
                    return await self._complete(request, start, total_timeout)
                return await self._stream(request, start, stall_timeout, total_timeout)
        except TimeoutError as exc:
            raise errors.TimeoutError_(
                f"call exceeded the total timeout of {total_timeout:g} s") from exc

    async def _stream(self, request: ChatRequest, start: float, stall_timeout: float,
                      total_timeout: float) -> ChatResult:
        read_timeout = min(stall_timeout, total_timeout)
        timeout = httpx2.Timeout(read_timeout, connect=min(CONNECT_TIMEOUT, total_timeout),
                                 read=read_timeout, pool=read_timeout)
        acc = _Accumulator()
        repairs: dict[str, int] = {}
        ttft: float | None = None
        done = False
        #: The response has begun: a broken connection now is the server's fault.
        answering = False
        try:
            async with self._send(self._body(request, stream=True,
                                             stream_options={"include_usage": True}),
                                  timeout) as response:
                answering = True
                async for line in _sse_lines(_body_bytes(response),
                                             request.max_response_bytes):
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        # Read on to the end of the body (nothing, normally): a
                        # response left unread closes its keep-alive connection.
                        done = True
                        continue
                    chunk = _parse(data, repairs)
                    if not isinstance(chunk, dict):
                        raise errors.ServerError(f"malformed stream chunk: {data[:200]!r}")
                    if "error" in chunk and not chunk.get("choices"):
                        raise errors.ServerError(f"error in stream: {chunk['error']}"[:2000])
                    if ttft is None:
                        ttft = time.monotonic() - start
                    acc.add(chunk)
        except (openai.APITimeoutError, httpx2.TimeoutException) as exc:
            raise errors.StalledError(
                f"no data from the server for {read_timeout:g} s "
                f"({'before the first token' if ttft is None else 'mid-stream'})") from exc
        except openai.APIStatusError as exc:
            raise _convert_status(exc) from exc
        except (openai.APIConnectionError, httpx2.TransportError) as exc:
            if answering:  # it answered, then broke off: not an unreachable server
                raise errors.ServerError(
                    f"the connection broke mid-response: {_describe(exc)}"[:2000]) from exc
            raise errors.ConnectionFailed(_describe(exc)[:2000]) from exc
        except ValueError as exc:  # JSONDecodeError, or a body that is not SSE at all
            raise errors.ServerError(f"malformed stream chunk: {exc}"[:2000]) from exc
        if not done and acc.finish_reason is None:
            # The body ended cleanly but without [DONE] or a finish reason: the
            # server misbehaved (a proxy's error page, a crashed handler), it is
            # not unreachable. Retried, and it does not mark the server down.
            raise errors.ServerError("the stream ended without [DONE] or a finish reason "
                                     "(not a complete OpenAI stream)")
        usage = acc.usage or {}
        content = storable("".join(acc.content), repairs) or ""
        return ChatResult(
            content=content,
            reasoning_content=storable("".join(acc.reasoning), repairs) or None,
            finish_reason=acc.finish_reason,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            prompt_token_ids=acc.prompt_token_ids,
            completion_token_ids=acc.token_ids,
            latency_s=time.monotonic() - start,
            ttft_s=ttft,
            tool_calls=acc.tool_calls(repairs),
            repairs=repairs or None,
        )

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
layer only, synthq's (:mod:`synthq.core.retry`). Every ``openai``/``httpx``
exception leaves this module converted into a :mod:`synthq.core.errors` class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
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

from synthq.core import errors, netio
from synthq.spec.jobspec import RESERVED_BODY

try:  # httpx's own mapping of httpcore's errors, and its response stream (see _Direct)
    from httpx2._transports.default import AsyncResponseStream as _AsyncResponseStream
    from httpx2._transports.default import map_httpcore_exceptions as _map_httpcore_exceptions
except ImportError:  # another httpx2: every call takes httpx's own path
    _map_httpcore_exceptions = None  # type: ignore[assignment]

__all__ = ["ChatRequest", "ChatResult", "InferenceClient", "parse_retry_after", "status_error"]

log = logging.getLogger(__name__)

#: Seconds to open a TCP connection before the call counts as a connection failure.
CONNECT_TIMEOUT = 10.0
#: Most connections in one connection pool (a server's connections are split into pools).
POOL_SHARD = 16
#: Bytes of an error answer's body read for its message, and seconds in all to read them.
ERROR_BODY_BYTES = 256 << 10
ERROR_BODY_SECONDS = 10.0
#: Most tokens a usage field may report: far above any context window, far below the
#: database's INTEGER (a server's 10**15 failed a good answer on storing it).
MAX_USAGE_TOKENS = 10_000_000

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
    #: Bytes of request body over which the call fails as ``request_too_large``, unsent.
    max_request_bytes: int = 16 << 20
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


def status_error(status: int, said: str, headers: Mapping[str, str], *,
                 body: str = "") -> errors.SampleError:
    """The failure an HTTP error answer is (every caller of an inference server: a
    generation's call, a capture's): 429 ``rate_limited``; 5xx, 408 and 409
    ``server_error``; a prompt over the window ``context_length``; any other
    ``bad_request``. ``said``: the answer's message; ``body``: its whole text."""
    # Retry-After is honoured wherever it comes (429, and 503 from a server or a
    # gateway with a bounded queue): it is named in the message, where the
    # dispatcher reads it back to space its probes of that server.
    retry_after = parse_retry_after(headers.get("retry-after"))
    after = f" (Retry-After {retry_after:g} s)" if retry_after is not None else ""
    message = f"HTTP {status}{after}: {said}"[:2000]
    if status == 429:
        return errors.RateLimited(message, retry_after)
    if status >= 500 or status in (408, 409):
        return errors.ServerError(message, retry_after)
    if _is_context_length(said) or _is_context_length(body):
        return errors.ContextLength(message)
    return errors.BadRequest(message)


def _convert_status(exc: openai.APIStatusError) -> errors.SampleError:
    return status_error(exc.status_code, str(exc.message), exc.response.headers,
                        body=str(exc.body))


def _error_response(response: httpx2.Response, data: bytes) -> httpx2.Response:
    """A copy of an error ``response`` holding the (bounded, decoded) ``data`` as its body,
    for the openai client's message extraction."""
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return httpx2.Response(response.status_code, headers=headers, content=data,
                           request=response.request)


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


async def _sse_lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[list[bytes]]:
    """The complete lines of a server-sent-event body, as bytes, a list per read (no
    text decoding layer, no generator step per line: this runs for every token).
    More than ``limit`` bytes in all fails the call."""
    pending = b""
    seen = 0
    async for data in chunks:
        seen += len(data)
        if seen > limit:
            raise errors.ResponseTooLarge(
                f"the streamed response passed max_response_bytes={limit:,}")
        if pending:
            data = pending + data
        lines = data.split(b"\n")
        pending = lines.pop()
        if lines:
            yield lines
    if pending:
        yield [pending]


#: The C scanner behind ``json.loads``, called without its per-call wrappers (encoding
#: detection, the whitespace regexes): one SSE payload per streamed token.
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _parse(data: bytes, repairs: dict[str, int]) -> Any:
    """One SSE payload (stripped of surrounding whitespace): exactly one JSON value, as
    ``json.loads`` takes it; invalid UTF-8 is decoded with U+FFFD and counted."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        repairs["invalid_utf8"] = repairs.get("invalid_utf8", 0) + text.count("\ufffd")
    try:
        value, end = _scan(text, 0)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


#: Characters no database text column takes: NUL (PostgreSQL) and lone surrogates (UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def replace_unstorable(text: str | None, repairs: dict[str, int]) -> str | None:
    """``text`` with NUL and lone surrogates replaced by U+FFFD, each counted in ``repairs``."""
    if text is None or not _UNSTORABLE.search(text):
        return text

    def fix(match: re.Match[str]) -> str:
        kind = "nul" if match.group() == "\x00" else "surrogate"
        repairs[kind] = repairs.get(kind, 0) + 1
        return "\ufffd"

    return _UNSTORABLE.sub(fix, text)


class _Malformed(ValueError):
    """A chunk or document field of the wrong type: the server's fault (``server_error``)."""


def _text(value: Any, what: str) -> str:
    if type(value) is not str:
        raise _Malformed(f"{what} is a {type(value).__name__}, not a string")
    return value


def _ids(value: Any, what: str) -> list[int]:
    """Token ids as int32 can store them (the packed columns are int32)."""
    if type(value) is list:
        for i in value:  # a loop, not all(...): a generator per chunk costs a microsecond
            if type(i) is not int or not 0 <= i < _INT32:
                break
        else:
            return value
    raise _Malformed(f"{what} is not a list of token ids")


_INT32 = 1 << 31


def _finish(value: Any) -> str:
    if type(value) is not str or len(value) > 32:  # samples.finish_reason is VARCHAR(32)
        raise _Malformed(f"finish_reason {str(value)[:40]!r} is not a short string")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if type(value) is not dict:
        raise _Malformed(f"{what} is a {type(value).__name__}, not an object")
    return value


class _Accumulator:
    """Builds the answer from SSE chunk payloads, checking each field's type as it goes
    (a wrong one raises :class:`_Malformed`): ``"delta": "str"`` or a tool call's
    ``"index": [1]`` is a broken server, never a crash of the worker."""

    __slots__ = ("content", "reasoning", "finish_reason", "usage", "token_ids", "prompt_token_ids",
                 "calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        #: As the server sent it: checked once, at the end (:func:`_checked_usage`).
        self.usage: Any = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        #: Streamed tool calls by index: id, name and the argument pieces.
        self.calls: dict[int, dict[str, Any]] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(_ids(chunk["prompt_token_ids"], "prompt_token_ids"))
        choices = chunk.get("choices") or []
        if type(choices) is not list:
            raise _Malformed(f"choices is a {type(choices).__name__}, not a list")
        for choice in choices:
            if type(choice) is not dict:
                raise _Malformed(f"a choice is a {type(choice).__name__}, not an object")
            # Type checks inline, the helpers only on the way to the error: this runs
            # once per streamed token.
            delta = choice.get("delta")
            if type(delta) is not dict:
                delta = _object(delta, "delta")
            if piece := delta.get("content"):
                self.content.append(piece if type(piece) is str else
                                    _text(piece, "delta.content"))
            # vLLM: reasoning_content; some versions and SGLang: reasoning.
            if piece := delta.get("reasoning_content") or delta.get("reasoning"):
                self.reasoning.append(piece if type(piece) is str else
                                      _text(piece, "delta.reasoning_content"))
            if calls := delta.get("tool_calls"):
                self._add_calls(calls)
            if ids := choice.get("token_ids"):
                if type(ids) is not list:
                    raise _Malformed(f"token_ids is a {type(ids).__name__}, not a list")
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)  # each id checked once, at the end (ids())
            if choice.get("finish_reason"):
                self.finish_reason = _finish(choice["finish_reason"])

    def pieces(self) -> int:
        """Chunks that carried generated text: the token count when usage cannot be trusted
        (a server's chunk carries at least one token)."""
        calls = sum(len(c["arguments"]) or 1 for c in (self.calls or {}).values())
        return len(self.content) + len(self.reasoning) + calls

    def ids(self) -> list[int] | None:
        """The streamed token ids, checked (one pass over them all is cheaper than a
        check per chunk)."""
        return None if self.token_ids is None else _ids(self.token_ids, "token_ids")

    def _add_calls(self, calls: Any) -> None:
        if type(calls) is not list:
            raise _Malformed(f"tool_calls is a {type(calls).__name__}, not a list")
        if self.calls is None:
            self.calls = {}
        for piece in calls:
            piece = _object(piece, "a tool call")
            index = piece.get("index")
            if index is None:
                index = 0
            elif type(index) is not int or index < 0:
                raise _Malformed(f"a tool call's index is {str(index)[:40]!r}, not an integer")
            at = self.calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            if piece.get("id"):
                at["id"] = _text(piece["id"], "a tool call's id")
            function = _object(piece.get("function"), "a tool call's function")
            if function.get("name"):
                at["name"] += _text(function["name"], "a tool call's name")
            if function.get("arguments"):
                at["arguments"].append(_text(function["arguments"], "a tool call's arguments"))

    def tool_calls(self, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
        if not self.calls:
            return None
        fix = replace_unstorable
        return [{"id": fix(c["id"], repairs) or f"call_{i}", "type": "function",
                 "function": {"name": fix(c["name"], repairs) or "",
                              "arguments": fix("".join(c["arguments"]), repairs) or ""}}
                for i, c in sorted(self.calls.items())]


def _count(value: Any) -> int | None:
    """A token count as a server must send it: a JSON integer in [0, MAX_USAGE_TOKENS]
    (not a bool, a float or a string such as "1e9")."""
    if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    return None


@dataclass(frozen=True, slots=True)
class _Usage:
    prompt: int | None
    completion: int | None
    #: What was wrong with the server's figures (None: nothing); they were replaced.
    problem: str | None = None


def _checked_usage(usage: Any, *, ceiling: int, ids: list[int] | None,
                   prompt_ids: list[int] | None, streamed: int | None, text: bool) -> _Usage:
    """The token counts to record, from the server's ``usage`` checked against the call.

    A count must be an integer in range; the completion count can be no lower than
    the token ids streamed (or 1 when text was), and no higher than the request's
    ``max_tokens`` (``ceiling``). A bad one is replaced by what was streamed (the
    token ids, else the chunks that carried text: a server's chunk carries at
    least one token), never by a figure that could make a counter go negative or
    fail the answer. Absent figures stay None (the server gave none).
    """
    if usage is not None and type(usage) is not dict:
        return _Usage(len(prompt_ids) if prompt_ids else None, len(ids) if ids else streamed,
                      f"usage is a {type(usage).__name__}, not an object")
    problems: list[str] = []
    usage = usage or {}
    said = usage.get("prompt_tokens")
    prompt = _count(said)
    if said is not None and prompt is None:
        problems.append(f"prompt_tokens={str(said)[:40]!r}")
    if prompt_ids and prompt != len(prompt_ids):
        if prompt is not None:
            problems.append(f"prompt_tokens={prompt} for {len(prompt_ids)} prompt token ids")
        prompt = len(prompt_ids)
    said = usage.get("completion_tokens")
    completion = _count(said)
    low = len(ids) if ids else int(text)
    if said is not None and (completion is None or not low <= completion <= max(ceiling, low)):
        problems.append(f"completion_tokens={str(said)[:40]!r} (streamed {low}, "
                        f"max_tokens {ceiling})")
        completion = len(ids) if ids else streamed
    return _Usage(prompt, completion, "; ".join(problems) or None)


def _ceiling(request: ChatRequest) -> int:
    """The most tokens the request lets the server generate, as sent."""
    asked = [request.max_tokens, *(v for k in ("max_tokens", "max_completion_tokens")
                                   if type(v := request.extra_body.get(k)) is int)]
    return max(asked)


def _tool_calls(calls: Any, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
    """A non-streamed message's ``tool_calls``, in the form the streamed path builds."""
    if not calls or not isinstance(calls, list):
        return None
    out = []
    for i, call in enumerate(c for c in calls if isinstance(c, dict)):
        function = call.get("function") or {}
        fix = replace_unstorable
        out.append({"id": fix(str(call.get("id") or ""), repairs) or f"call_{i}",
                    "type": "function",
                    "function": {"name": fix(str(function.get("name") or ""), repairs) or "",
                                 "arguments": fix(str(function.get("arguments") or ""),
                                                  repairs) or ""}})
    return out or None


def _completion_result(document: Any, repairs: dict[str, int], start: float,
                       ceiling: int) -> tuple[ChatResult, str | None]:
    """A non-streamed ``chat.completion`` document as a :class:`ChatResult`, and what was
    wrong with its usage (None: nothing). A field of the wrong type raises :class:`_Malformed`."""
    choices = document.get("choices") if isinstance(document, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        if isinstance(document, dict) and "error" in document:
            raise errors.ServerError(f"error in response: {document['error']}"[:2000])
        raise errors.ServerError(f"malformed response (no choices): {str(document)[:200]}")
    choice = choices[0]
    message = choice.get("message") or {}
    if not isinstance(message, dict):
        raise errors.ServerError(f"malformed response message: {str(message)[:200]}")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = message.get("content") or ""
    ids = _ids(choice["token_ids"], "token_ids") if choice.get("token_ids") else None
    prompt_ids = document.get("prompt_token_ids") or choice.get("prompt_token_ids")
    prompt_ids = _ids(prompt_ids, "prompt_token_ids") if prompt_ids else None
    usage = _checked_usage(document.get("usage"), ceiling=ceiling, ids=ids,
                           prompt_ids=prompt_ids, streamed=None,
                           text=bool(content or reasoning))
    finish = choice.get("finish_reason")
    return ChatResult(
        content=replace_unstorable(_text(content, "message.content"), repairs) or "",
        reasoning_content=replace_unstorable(_text(reasoning, "message.reasoning_content"), repairs)
        if reasoning else None,
        finish_reason=_finish(finish) if finish is not None else None,
        prompt_tokens=usage.prompt,
        completion_tokens=usage.completion,
        prompt_token_ids=list(prompt_ids) if prompt_ids else None,
        completion_token_ids=list(ids) if ids else None,
        latency_s=time.monotonic() - start,
        ttft_s=None,  # the whole answer arrives at once: no first-token time to measure
        tool_calls=_tool_calls(message.get("tool_calls"), repairs),
        repairs=repairs or None,
    ), usage.problem


@dataclass(frozen=True, slots=True)
class _Direct:
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
           ) -> _Direct | None:
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
    # httpx's response stream wraps httpcore's (two layers, or one on the _Direct path).
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


class InferenceClient:
    """A streaming chat client for one server base URL (``http://host:8000/v1``).

    Async: every call of a worker process runs on that process's one event
    loop (:mod:`synthq.serving.executor`). ``max_connections`` sizes the pool; the
    executor makes a new client when a server's limit grows.
    """

    def __init__(self, base_url: str, *, api_key: str = "EMPTY", max_connections: int = 64,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url
        self.max_connections = max_connections
        self._usage_warned = False
        #: The URL as a log line may show it (no user or password).
        self._shown = base_url.split("://", 1)[-1].rsplit("@", 1)[-1]
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
        #: Each shard's way around httpx's per-request layers, or None (see _direct).
        self._direct = [_Direct.of(http, self._url, self._headers) for http in self._pools]

    async def close(self) -> None:
        await self._client.close()
        for pool in self._pools[1:]:
            await pool.aclose()

    def _body(self, request: ChatRequest, **more: Any) -> bytes:
        """The request's JSON body, as the openai client would send it."""
        # The fields synthq sets win over extra_body, and what no job may send is left
        # out (a job stored before it was refused): see synthq.spec.jobspec.RESERVED_BODY.
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
        data = json.dumps(body).encode()
        if len(data) > request.max_request_bytes:
            # A conversation regenerated turn by turn grows with every answer (and its
            # reasoning, with --history-reasoning keep): it stops here, before it is sent.
            raise errors.RequestTooLarge(
                f"the request body is {len(data):,} bytes, over "
                f"SYNTHQ_MAX_REQUEST_BYTES={request.max_request_bytes:,}")
        return data

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
        direct = self._direct[shard]
        busy[shard] += 1
        try:
            if direct is not None and not http.cookies:
                response = await direct.send(body, timeout)
            else:
                http_request = http.build_request("POST", self._url, content=body,
                                                  headers=self._headers, timeout=timeout)
                response = await http.send(http_request, stream=True)
        except BaseException:
            busy[shard] -= 1
            raise
        try:
            if direct is not None and "set-cookie" in response.headers:
                # As httpx would: a cookie the server sets goes back with later calls
                # (a load balancer's sticky session), and those take httpx's own path.
                response.request = http.build_request("POST", self._url, content=body,
                                                      headers=self._headers, timeout=timeout)
                http.cookies.extract_cookies(response)
            if response.status_code >= 400:
                if direct is not None:  # the openai client's error reads the request
                    response.request = http.build_request(
                        "POST", self._url, content=body, headers=self._headers,
                        timeout=timeout)
                # A message is all an error body is read for: a 3 GB one costs its
                # first ERROR_BODY_BYTES, and closing the response drops the rest.
                data, _ = await netio.read_bounded(_body_bytes(response),
                                                   max_bytes=ERROR_BODY_BYTES,
                                                   seconds=ERROR_BODY_SECONDS)
                raise self._client._make_status_error_from_response(
                    _error_response(response, data))
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
            document = _parse(raw.strip(b" \t\r\n"), repairs)
        except ValueError as exc:  # JSONDecodeError: an HTML error page, a cut body
            raise errors.ServerError(
                f"malformed response (not a chat.completion JSON document): {raw[:200]!r}"
            ) from exc
        try:
            result, problem = _completion_result(document, repairs, start, _ceiling(request))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # a field's type
            raise errors.ServerError(f"malformed response: {exc}"[:2000]) from exc
        self._bad_usage(problem, result)
        return result

    async def chat(self, request: ChatRequest, *, total_timeout: float,
                   stall_timeout: float, stream: bool = True) -> ChatResult:
        """One chat completion, streamed unless ``stream`` is False (then no stall clock:
        the answer comes in one body); raise a :class:`~synthq.core.errors.SampleError`
        on failure."""
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
                async for lines in _sse_lines(_body_bytes(response),
                                              request.max_response_bytes):
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event names
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            # Read on to the end of the body (nothing, normally): a
                            # response left unread closes its keep-alive connection.
                            done = True
                            continue
                        chunk = _parse(data, repairs)
                        if type(chunk) is not dict:
                            raise errors.ServerError(
                                f"malformed stream chunk: {data[:200]!r}")
                        if "error" in chunk and not chunk.get("choices"):
                            raise errors.ServerError(
                                f"error in stream: {chunk['error']}"[:2000])
                        if ttft is None:
                            ttft = time.monotonic() - start
                        try:
                            acc.add(chunk)
                        except (TypeError, AttributeError, KeyError) as exc:
                            # A shape the checks in add() did not foresee: the server's.
                            raise _Malformed(f"{type(exc).__name__}: {exc}") from exc
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
        except ValueError as exc:  # JSONDecodeError, a field's type, a body that is not SSE
            raise errors.ServerError(f"malformed stream chunk: {exc}"[:2000]) from exc
        if not done and acc.finish_reason is None:
            # The body ended cleanly but without [DONE] or a finish reason: the
            # server misbehaved (a proxy's error page, a crashed handler), it is
            # not unreachable. Retried, and it does not mark the server down.
            raise errors.ServerError("the stream ended without [DONE] or a finish reason "
                                     "(not a complete OpenAI stream)")
        try:
            ids = acc.ids()
        except _Malformed as exc:
            raise errors.ServerError(f"malformed stream chunk: {exc}") from exc
        usage = _checked_usage(acc.usage, ceiling=_ceiling(request), ids=ids,
                               prompt_ids=acc.prompt_token_ids, streamed=acc.pieces(),
                               text=bool(acc.content or acc.reasoning))
        content = replace_unstorable("".join(acc.content), repairs) or ""
        result = ChatResult(
            content=content,
            reasoning_content=replace_unstorable("".join(acc.reasoning), repairs) or None,
            finish_reason=acc.finish_reason,
            prompt_tokens=usage.prompt,
            completion_tokens=usage.completion,
            prompt_token_ids=acc.prompt_token_ids,
            completion_token_ids=ids,
            latency_s=time.monotonic() - start,
            ttft_s=ttft,
            tool_calls=acc.tool_calls(repairs),
            repairs=repairs or None,
        )
        self._bad_usage(usage.problem, result)
        return result

    def _bad_usage(self, problem: str | None, result: ChatResult) -> None:
        """Say once per client (then at debug level) that a server's usage was replaced:
        a server that always lies would otherwise write a line per call."""
        if problem is None:
            return
        level = logging.DEBUG if self._usage_warned else logging.WARNING
        self._usage_warned = True
        log.log(level, "server %s sent an invalid usage (%s); recorded prompt_tokens=%s, "
                "completion_tokens=%s from the stream instead", self._shown, problem,
                result.prompt_tokens, result.completion_tokens)

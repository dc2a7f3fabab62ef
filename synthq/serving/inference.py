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

Here: the request and the result (:class:`ChatRequest`, :class:`ChatResult`), the
request's body, the failure an HTTP error answer is (:func:`status_error`), and the
client. Below it: the answer's bytes read and checked (:mod:`synthq.serving.answer`),
and the HTTP under the client (:mod:`synthq.serving.transport`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

# openai reads sys.modules["httpx"] on every response (its legacy-httpx shims): a
# first `import httpx` in another thread (a health probe, huggingface_hub) while
# calls run would show them a half-imported module (AttributeError, calls lost,
# issue 18). Imported here, before any call can run, it is never half-imported.
import httpx  # noqa: F401
import httpx2
import openai

from synthq.core import errors, kvparams, netio
from synthq.serving.answer import (
    Accumulator,
    Malformed,
    checked_finish,
    checked_ids,
    checked_text,
    checked_usage,
    message_tool_calls,
    parse_json,
    replace_unstorable,
    sse_lines,
)
from synthq.serving.transport import Direct, body_bytes, error_response, ssl_context
from synthq.spec.jobspec import RESERVED_BODY

__all__ = ["ChatRequest", "ChatResult", "InferenceClient", "parse_retry_after", "status_error"]

log = logging.getLogger(__name__)

#: Seconds to open a TCP connection before the call counts as a connection failure.
CONNECT_TIMEOUT = 10.0
#: Most connections in one connection pool (a server's connections are split into pools).
POOL_SHARD = 16
#: Bytes of an error answer's body read for its message, and seconds in all to read them.
ERROR_BODY_BYTES = 256 << 10
ERROR_BODY_SECONDS = 10.0

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
    #: ``--capture inline``: the name under which the engine's connector writes this call's
    #: hidden states, prompt and output (``kv_transfer_params``); the engine's token ids
    #: are asked for too (``return_token_ids``). None: a plain call.
    capture_name: str | None = None


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


def _ceiling(request: ChatRequest) -> int:
    """The most tokens the request lets the server generate, as sent."""
    asked = [request.max_tokens, *(v for k in ("max_tokens", "max_completion_tokens")
                                   if type(v := request.extra_body.get(k)) is int)]
    return max(asked)


def _completion_result(document: Any, repairs: dict[str, int], start: float,
                       ceiling: int) -> tuple[ChatResult, str | None]:
    """A non-streamed ``chat.completion`` document as a :class:`ChatResult`, and what was
    wrong with its usage (None: nothing). A field of the wrong type raises :class:`Malformed`."""
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
    ids = checked_ids(choice["token_ids"], "token_ids") if choice.get("token_ids") else None
    prompt_ids = document.get("prompt_token_ids") or choice.get("prompt_token_ids")
    prompt_ids = checked_ids(prompt_ids, "prompt_token_ids") if prompt_ids else None
    usage = checked_usage(document.get("usage"), ceiling=ceiling, ids=ids,
                          prompt_ids=prompt_ids, streamed=None,
                          text=bool(content or reasoning))
    finish = choice.get("finish_reason")
    return ChatResult(
        content=replace_unstorable(checked_text(content, "message.content"), repairs) or "",
        reasoning_content=replace_unstorable(
            checked_text(reasoning, "message.reasoning_content"), repairs) if reasoning else None,
        finish_reason=checked_finish(finish) if finish is not None else None,
        prompt_tokens=usage.prompt,
        completion_tokens=usage.completion,
        prompt_token_ids=list(prompt_ids) if prompt_ids else None,
        completion_token_ids=list(ids) if ids else None,
        latency_s=time.monotonic() - start,
        ttft_s=None,  # the whole answer arrives at once: no first-token time to measure
        tool_calls=message_tool_calls(message.get("tool_calls"), repairs),
        repairs=repairs or None,
    ), usage.problem


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
                shard_transport = httpx2.AsyncHTTPTransport(limits=limits, verify=ssl_context())
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
        self._direct = [Direct.of(http, self._url, self._headers) for http in self._pools]

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
        if request.capture_name is not None:  # synthq.core.kvparams: the connector's keys
            body.update(return_token_ids=True, kv_transfer_params={
                kvparams.NAME_KEY: request.capture_name, kvparams.OUTPUT_KEY: True})
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
                data, _ = await netio.read_bounded(body_bytes(response),
                                                   max_bytes=ERROR_BODY_BYTES,
                                                   seconds=ERROR_BODY_SECONDS)
                raise self._client._make_status_error_from_response(
                    error_response(response, data))
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
                async for data in body_bytes(response):
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
            document = parse_json(raw.strip(b" \t\r\n"), repairs)
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
        acc = Accumulator()
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
                async for lines in sse_lines(body_bytes(response),
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
                        chunk = parse_json(data, repairs)
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
                            raise Malformed(f"{type(exc).__name__}: {exc}") from exc
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
        except Malformed as exc:
            raise errors.ServerError(f"malformed stream chunk: {exc}") from exc
        usage = checked_usage(acc.usage, ceiling=_ceiling(request), ids=ids,
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

"""OpenAI-compatible inference server simulator -- a test, benchmark and demo tool.

No GPU model can run in the places synthq is tested, so this module serves a fake
``/v1/chat/completions`` endpoint over a real ASGI stack (Starlette + uvicorn). It
behaves like a vLLM server from the client's point of view: a bounded number of
requests run at once (the rest wait in FIFO order), there is a time-to-first-token
latency and an optional token rate, answers stream as server-sent events, and
faults (hangs, stalls, 429/500/400 errors, dropped connections, empty or truncated
answers) can be injected at random rates or per request.

Answers are deterministic: the same prompt always gives the same words. A "token"
is one whitespace-separated word.

Per-request faults: put ``[[sim:NAME]]`` in the last user message to force fault
NAME on every request carrying it, or ``[[sim:NAME*K]]`` to force it only on the
first K requests carrying that exact last user message (so retries can succeed).
Directives override the random fault rates. NAME is one of :data:`FAULTS`, or
one of the payload faults of :data:`PAYLOAD_FAULTS` (directives only): ``nul``
and ``surrogate`` put a NUL or a lone surrogate in the answer, ``badutf8``
sends bytes that are not UTF-8, ``html`` answers 200 with an HTML page instead
of an event stream, ``nodone`` ends the stream cleanly without a finish reason
or ``[DONE]``.

Conversations: with ``history_answers`` on, every answer starts with
:func:`conversation_tag` of the request's messages (a hash of every message,
tool calls included), so a test can tell exactly which history a turn was asked
on. With ``record_requests`` on, ``GET /sim/requests`` returns every request's
messages, max_tokens, tools and tool_choice. Tools: a request carrying
``tools`` whose last message is a user message holding ``[[sim-call:NAME]]``
(or ``[[sim-call:A,B]]``, one call each) is answered with those tool calls
(``finish_reason`` ``tool_calls``); with ``tool_calls`` on (``synthq simulate
--tool-calls``) every such request calls one offered function, no directive
needed. A request ending with tool results gets a text answer.

The tiny target's language: a last user message ``count from A to B`` is answered
``A A+1 ... B``, as the target of ``synthq testing tiny-target`` answers it, so that a
job run on the simulator makes training data that target reads (``synthq testing
tiny-prompts`` writes such prompts): the whole loop, generation to drafter, on a CPU.

Run it from another process (it blocks)::

    python -c "from synthq.testing.simulator import SimConfig, serve; serve(SimConfig(), port=8000)"
    python -m synthq.testing.simulator --port 8000 --capacity 16 --latency 0.2 --error-rate 0.05

Modes for adaptive concurrency (``--inflight auto``): **slots** is ``capacity``
(at most N requests run, the rest wait in a FIFO queue, as in vLLM); **knee**
(``--knee N --tokens-per-second R``) makes the total token rate grow with the
streams running up to N, then fall; ``--vllm-metrics`` serves vLLM's gauges
on ``/metrics``.

Besides the OpenAI routes it serves ``GET /sim/stats`` (counters, see
:class:`_Stats`), ``POST /sim/reset`` (zero the counters), ``GET /sim/config``
and ``POST /sim/overload`` (``{"seconds": 30, "status": 503, "retry_after": 5}``:
every chat call is answered with that status and Retry-After for that long,
while ``/health`` stays 200, as a vLLM with a bounded queue or a gateway does)
and ``POST /sim/slow`` (``{"seconds": 30, "factor": 5}``: the time to first
token and every stream ``factor``× slower for that long, as a GPU throttled or
shared with another tenant).
Never expose it beyond loopback; it is not a real server.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

__all__ = ["FAULTS", "SimConfig", "build_app", "conversation_tag", "main", "serve"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Fault names, in the order the random rates are checked.
FAULTS: tuple[str, ...] = (
    "hang",
    "stall",
    "rate_limit",
    "error",
    "context_length",
    "reset",
    "empty",
    "length",
)
_ERROR_FAULTS = frozenset({"rate_limit", "error", "context_length"})
#: Faults in the answer's bytes, forced by directive only (no random rate).
PAYLOAD_FAULTS: tuple[str, ...] = ("nul", "surrogate", "badutf8", "html", "nodone")
_DIRECTIVE_RE = re.compile(r"\[\[sim:([A-Za-z0-9_]*)(?:\*(\d+))?\]\]")
_CALL_RE = re.compile(r"\[\[sim-call:([A-Za-z0-9_,]+)\]\]")

#: Chunks (after the role chunk) a stalled or reset stream sends before it stops.
_PARTIAL_TOKEN_CHUNKS = 3
_ECHO_WORDS = 3
_MAX_CONTEXT = 4096
_CONTEXT_LENGTH_MESSAGE = (
    "This model's maximum context length is 4096 tokens. However, you requested "
    "5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the "
    "length of the messages or completion."
)

_VOCAB_TEXT = """
the a of and to in is that for it as with on by this are from at or an model data
token queue worker result answer value system simple clear small first next then
often usually because therefore however also only each every many few large fast
slow stable durable correct useful careful good better code test text word number
list step part state time example question idea shows means makes gives keeps
builds checks returns reads writes finds uses
"""
_REASONING_TEXT = """
let me think about the question first consider what is asked then check each part
carefully so the answer should be clear maybe compare options because this follows
hmm okay right now verify step
"""
_VOCAB: tuple[str, ...] = tuple(_VOCAB_TEXT.split())
_REASONING_VOCAB: tuple[str, ...] = tuple(_REASONING_TEXT.split())

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class SimConfig:
    """Behaviour of a simulated inference server.

    Fault rates are per-request probabilities in [0, 1]; one random draw per
    request is compared against them cumulatively in the order of :data:`FAULTS`,
    so their sum must not exceed 1.
    """

    capacity: int = 64
    """Requests served concurrently; the rest wait in FIFO order."""
    latency: float = 0.5
    """Seconds before the first token, counted after a capacity slot is taken."""
    tokens_per_second: float = 0.0
    """Per-request token rate; 0 sends all tokens at once."""
    response_tokens: int = 32
    """Words in a normal answer (capped by max_tokens / max_completion_tokens)."""
    reasoning: bool = False
    """Emit ``reasoning_content`` before the answer, like a reasoning model."""
    reasoning_tokens: int = 16
    """Reasoning words per answer when ``reasoning`` is on (count toward max_tokens)."""
    seed: int | None = None
    """Seed of the fault random draws (answers are deterministic regardless)."""
    hang_rate: float = 0.0
    """Accept the request and never answer until the client disconnects."""
    stall_rate: float = 0.0
    """Send a few chunks, then nothing, until the client disconnects."""
    rate_limit_rate: float = 0.0
    """HTTP 429 with a Retry-After header."""
    error_rate: float = 0.0
    """HTTP 500."""
    context_length_rate: float = 0.0
    """HTTP 400 with vLLM's "maximum context length" message."""
    reset_rate: float = 0.0
    """Send a few chunks, then drop the connection without ending the body."""
    empty_rate: float = 0.0
    """A well-formed answer with empty content and finish_reason "stop"."""
    length_rate: float = 0.0
    """A truncated answer with finish_reason "length"."""
    retry_after: float = 1.0
    """Seconds sent in the Retry-After header of 429 responses."""
    knee: int = 0
    """Knee mode (0: off): the server's total token rate grows with the streams running
    up to this many (each at ``tokens_per_second``), then falls as
    ``knee × tokens_per_second × (knee / running) ** knee_falloff`` (preemption)."""
    knee_falloff: float = 1.0
    """How steeply the total rate falls past the knee (1: total ∝ 1 / running)."""
    vllm_metrics: bool = False
    """Serve vLLM's gauges on ``GET /metrics`` (requests running and waiting, KV-cache
    usage = running / capacity); otherwise ``/metrics`` is a 404, as on servers without."""
    model: str = "sim-model"
    """Model id reported by /v1/models and in every response; a request naming another
    model gets vLLM's 404 ("The model `X` does not exist.")."""
    models_route: bool = True
    """Serve ``GET /v1/models``; off, a 404 there, like servers without the route."""
    history_answers: bool = False
    """Start every answer with :func:`conversation_tag` of the whole request history."""
    record_requests: bool = False
    """Keep each request's messages, max_tokens, tools, tool_choice for ``GET /sim/requests``."""
    tool_calls: bool = False
    """Answer a request that offers tools and ends with a user message by calling one
    (the function ``tool_choice`` names, else the first; none with ``"none"``), with no
    ``[[sim-call:...]]`` directive needed; a request ending with tool results gets text."""

    def __post_init__(self) -> None:
        """Reject settings the simulator cannot honour."""
        if self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        if self.latency < 0 or self.tokens_per_second < 0 or self.retry_after < 0:
            raise ValueError("latency, tokens_per_second and retry_after must be >= 0")
        if self.knee < 0 or self.knee_falloff < 0:
            raise ValueError("knee and knee_falloff must be >= 0")
        if self.knee and self.tokens_per_second <= 0:
            raise ValueError("knee mode needs tokens_per_second > 0")
        if self.response_tokens < 0 or self.reasoning_tokens < 0:
            raise ValueError("response_tokens and reasoning_tokens must be >= 0")
        rates = self.fault_rates()
        if any(not 0.0 <= rate <= 1.0 for rate in rates.values()):
            raise ValueError("fault rates must be within [0, 1]")
        if sum(rates.values()) > 1.0 + 1e-9:
            raise ValueError("fault rates must sum to at most 1")

    def fault_rates(self) -> dict[str, float]:
        """Return ``{fault name: rate}`` in the order the rates are checked."""
        return {name: float(getattr(self, f"{name}_rate")) for name in FAULTS}


class _SimulatedReset(Exception):
    """Raised inside a response to make uvicorn drop the connection mid-body."""


class _ResetLogFilter(logging.Filter):
    """Hide uvicorn's traceback for the connection resets we cause on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop records whose exception is a :class:`_SimulatedReset`."""
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _SimulatedReset)


_RESET_LOG_FILTER = _ResetLogFilter()


def _install_log_filter() -> None:
    """Attach the reset filter to uvicorn's error logger (idempotent)."""
    logging.getLogger("uvicorn.error").addFilter(_RESET_LOG_FILTER)


class _Stats:
    """Counters served by ``GET /sim/stats``.

    ``requests`` counts chat completion requests received; ``completed`` those
    answered with a full 200 response (including empty/length faults); ``rejected``
    invalid requests (400 from validation); ``active`` requests being handled now,
    including those waiting for capacity, and ``max_active`` its peak; ``running`` /
    ``max_running`` the same inside the capacity limit; ``faults`` counts per fault
    name; ``disconnects`` clients that went away before their response finished;
    ``prompts`` maps each last user message to the number of requests carrying it.
    """

    def __init__(self) -> None:
        """Start with every counter at zero."""
        self.active = 0
        self.running = 0
        self.reset()

    def reset(self) -> None:
        """Zero the counters; the ``active``/``running`` gauges keep their values."""
        self.requests = 0
        self.completed = 0
        self.rejected = 0
        self.disconnects = 0
        self.max_active = self.active
        self.max_running = self.running
        self.faults = dict.fromkeys(FAULTS, 0)
        self.prompts: dict[str, int] = {}
        #: Requests as received (``record_requests``): messages, max_tokens, tools, tool_choice.
        self.log: list[dict[str, Any]] = []
        #: Requests that asked for a streamed answer (``"stream": true``).
        self.streamed = 0

    def enter(self) -> None:
        """Count a request arriving."""
        self.requests += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    def leave(self) -> None:
        """Count a request finishing, however it finished."""
        self.active -= 1

    def snapshot(self) -> dict[str, Any]:
        """Return the counters as a JSON-ready dict."""
        return {
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "active": self.active,
            "max_active": self.max_active,
            "running": self.running,
            "max_running": self.max_running,
            "faults": dict(self.faults),
            "disconnects": self.disconnects,
            "prompts": dict(self.prompts),
            "streamed": self.streamed,
        }


class _BadRequest(Exception):
    """A request the simulator answers with HTTP 400."""


@dataclass
class _ChatRequest:
    """The parts of a chat completion request the simulator uses."""

    last_user: str
    prompt_text: str
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    #: vLLM's ``return_token_ids``: stream fake token ids with each chunk.
    return_token_ids: bool = False
    #: The ``model`` the request names (None when absent).
    model: str | None = None
    #: The request's messages, as sent.
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Function names a ``[[sim-call:...]]`` directive asks to call (tools given).
    calls: list[str] = field(default_factory=list)
    #: The function a ``tool_calls`` simulator calls without a directive: the one
    #: ``tool_choice`` names, else the first offered (tools given, last message a user's,
    #: ``tool_choice`` not ``"none"``); None otherwise.
    offered: str | None = None


@dataclass
class _Plan:
    """What one response will contain."""

    fault: str | None
    reasoning: list[str]
    content: list[str]
    finish_reason: str
    prompt_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI usage block; every word counts as one token."""
        completion = len(self.reasoning) + len(self.content)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


def _message_text(content: Any) -> str:
    """Text of a message ``content``: a string or a list of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return " ".join(p for p in parts if isinstance(p, str))
    return ""


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    """Return ``body[key]`` when it is a positive int, None when absent/null."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _BadRequest(f"{key} must be a positive integer")
    return value


def _parse_chat_request(raw: bytes) -> _ChatRequest:
    """Validate a chat completion body; unknown fields are accepted and ignored."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("messages must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise _BadRequest("each message must be an object")
    texts = [_message_text(m.get("content")) for m in messages]
    user_texts = [t for m, t in zip(messages, texts, strict=True) if m.get("role") == "user"]
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
    calls: list[str] = []
    offered = None
    if body.get("tools") and messages[-1].get("role") == "user":
        match = _CALL_RE.search(texts[-1])
        if match:
            calls = [n for n in match.group(1).split(",") if n]
        offered = _offered(body)
    return _ChatRequest(
        last_user=user_texts[-1] if user_texts else texts[-1],
        prompt_text="\n".join(f"{m.get('role')}:{t}" for m, t in zip(messages, texts, strict=True)),
        prompt_tokens=max(1, sum(len(t.split()) for t in texts)),
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        return_token_ids=bool(body.get("return_token_ids", False)),
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        messages=messages,
        calls=calls,
        offered=offered,
    )


def _offered(body: dict[str, Any]) -> str | None:
    """The function a request's ``tool_choice`` lets the simulator call (see _ChatRequest)."""
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if isinstance(named, str):
            return named
    tools = body.get("tools")
    first = tools[0] if isinstance(tools, list) and tools and isinstance(tools[0], dict) else {}
    name = (first.get("function") or {}).get("name")
    return name if isinstance(name, str) and name else None


def conversation_tag(messages: Sequence[dict[str, Any]]) -> str:
    """``c`` + 12 hex digits of a hash over every message: role, content, tool calls
    (names and arguments) and tool_call_id. The first word of every answer with
    ``history_answers`` on."""
    canonical = [{"role": m.get("role"), "content": _message_text(m.get("content")),
                  "calls": [[(c.get("function") or {}).get("name"),
                             (c.get("function") or {}).get("arguments")]
                            for c in m.get("tool_calls") or []],
                  "call_id": m.get("tool_call_id")} for m in messages]
    digest = hashlib.blake2b(json.dumps(canonical, sort_keys=True).encode(), digest_size=6)
    return "c" + digest.hexdigest()


def _parse_directive(text: str) -> tuple[str, int | None] | None:
    """Return ``(fault, K or None)`` for the first ``[[sim:...]]`` in ``text``."""
    match = _DIRECTIVE_RE.search(text)
    if match is None:
        return None
    name, count = match.group(1), match.group(2)
    if name not in FAULTS and name not in PAYLOAD_FAULTS:
        raise _BadRequest(f"unknown simulator directive {name!r}; expected one of "
                          f"{FAULTS + PAYLOAD_FAULTS}")
    return name, int(count) if count is not None else None


def _prompt_seed(prompt_text: str) -> int:
    """A stable 64-bit number derived from the whole prompt."""
    return int.from_bytes(hashlib.blake2b(prompt_text.encode(), digest_size=8).digest(), "big")


_COUNT_RE = re.compile(r"^count from (\d{1,4}) to (\d{1,4})$")


def count_words(last_user: str) -> list[str] | None:
    """The tiny target's answer to ``count from A to B`` (``A ... B``, at most 1,000
    numbers), or None for any other prompt."""
    match = _COUNT_RE.match(last_user.strip())
    if match is None:
        return None
    start, end = int(match.group(1)), int(match.group(2))
    if end < start or end - start >= 1000:
        return None
    return [str(i) for i in range(start, end + 1)]


def _answer_words(request: _ChatRequest, count: int) -> list[str]:
    """``count`` deterministic answer words: an echo of the prompt, then vocabulary."""
    echo = _DIRECTIVE_RE.sub("", request.last_user).split()[: min(_ECHO_WORDS, count)]
    rng = random.Random(_prompt_seed(request.prompt_text))
    return echo + rng.choices(_VOCAB, k=count - len(echo))


def _reasoning_words(request: _ChatRequest, count: int) -> list[str]:
    """``count`` deterministic reasoning words for the prompt."""
    rng = random.Random(_prompt_seed(request.prompt_text) ^ 0x5EED)
    return rng.choices(_REASONING_VOCAB, k=count)


def _error_body(status: int, message: str, error_type: str) -> bytes:
    """vLLM's flavour of an OpenAI error document."""
    return json.dumps(
        {"object": "error", "message": message, "type": error_type, "param": None, "code": status}
    ).encode()


async def _send_bytes(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """Send a complete response with a known length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(
    send: Send,
    status: int,
    message: str,
    error_type: str,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Send an OpenAI-style JSON error response."""
    headers = [_JSON_CONTENT_TYPE, *extra]
    await _send_bytes(send, status, _error_body(status, message, error_type), headers)


async def _read_body(receive: Receive) -> bytes | None:
    """Read the whole request body; None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_forever() -> None:
    """Block until cancelled (the disconnect guard cancels on client disconnect)."""
    await asyncio.Event().wait()


class _DisconnectGuard:
    """Cancel the current task when the client disconnects.

    Must be created after the request body has been read: from then on the ASGI
    ``receive`` only ever yields ``http.disconnect``.
    """

    def __init__(self, receive: Receive) -> None:
        """Start watching ``receive`` on behalf of the current task."""
        self.disconnected = False
        self._closed = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        """Wait for ``http.disconnect`` and cancel the guarded task."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._closed and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def absorb(self) -> bool:
        """Call on CancelledError: True (and un-cancel) if it came from a disconnect."""
        if not self.disconnected or self._task is None:
            return False
        self._task.uncancel()
        return True

    def close(self) -> None:
        """Stop watching; the response is over."""
        self._closed = True
        self._watcher.cancel()


class _Simulator:
    """State shared by all requests of one app: config, counters, capacity."""

    def __init__(self, config: SimConfig) -> None:
        """Create the state for ``config``."""
        self.config = config
        self.stats = _Stats()
        self.capacity = asyncio.Semaphore(config.capacity)
        self.directive_counts: dict[str, int] = {}
        self.rng = random.Random(config.seed)
        self._ids = itertools.count(1)
        self._id_prefix = f"chatcmpl-sim{random.getrandbits(32):08x}"
        self.started = int(time.time())
        #: ``POST /sim/overload``: until this monotonic time, answer ``(status, retry_after)``.
        self.overload_until = 0.0
        self.overload: tuple[int, float | None] = (503, None)
        #: ``POST /sim/slow``: until this monotonic time, everything ``slow_factor``× slower.
        self.slow_until = 0.0
        self.slow_factor = 1.0

    def reset(self) -> None:
        """Zero counters and directive K-counters; re-seed the fault draws."""
        self.stats.reset()
        self.directive_counts.clear()
        self.rng = random.Random(self.config.seed)

    def next_id(self) -> str:
        """A unique completion id."""
        return f"{self._id_prefix}{next(self._ids):08d}"

    def choose_fault(self, request: _ChatRequest) -> str | None:
        """Pick the fault for a request: its directive if any, else the random rates."""
        draw = self.rng.random()  # always drawn, so seeded runs stay aligned
        directive = _parse_directive(request.last_user)
        if directive is not None:
            name, limit = directive
            if limit is None:
                return name
            seen = self.directive_counts.get(request.last_user, 0) + 1
            self.directive_counts[request.last_user] = seen
            return name if seen <= limit else None
        threshold = 0.0
        for name, rate in self.config.fault_rates().items():
            threshold += rate
            if draw < threshold:
                return name
        return None

    def plan(self, request: _ChatRequest, fault: str | None) -> _Plan:
        """Decide the words and finish reason of a response."""
        want_reasoning = self.config.reasoning_tokens if self.config.reasoning else 0
        counted = count_words(request.last_user)
        want_content = self.config.response_tokens if counted is None else len(counted)
        if fault == "empty":
            return _Plan(fault, [], [], "stop", request.prompt_tokens)
        budget = (
            request.max_tokens if request.max_tokens is not None else want_reasoning + want_content
        )
        n_reasoning = min(want_reasoning, budget)
        n_content = min(want_content, budget - n_reasoning)
        finish = "stop" if n_reasoning + n_content == want_reasoning + want_content else "length"
        if fault == "length":
            n_content, finish = min(n_content, max(1, want_content // 2)), "length"
        content = (_answer_words(request, n_content) if counted is None
                   else counted[:n_content])
        if self.config.history_answers and content:
            content[0] = conversation_tag(request.messages)
        calls: list[dict[str, Any]] = []
        names = request.calls or ([request.offered] if self.config.tool_calls
                                  and request.offered else [])
        if names and finish == "stop":
            tag = conversation_tag(request.messages)
            calls = [{"id": f"call_{tag}_{i}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps({"q": tag, "n": i})}}
                     for i, name in enumerate(names)]
            content, finish = [], "tool_calls"
        return _Plan(
            fault,
            _reasoning_words(request, n_reasoning),
            content,
            finish,
            request.prompt_tokens,
            calls,
        )

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one unit of capacity (FIFO wait), tracking ``running``."""
        async with self.capacity:
            stats = self.stats
            stats.running += 1
            stats.max_running = max(stats.max_running, stats.running)
            try:
                yield
            finally:
                stats.running -= 1

    def slowdown(self) -> float:
        """How many times slower than configured the server is now (``POST /sim/slow``)."""
        return self.slow_factor if time.monotonic() < self.slow_until else 1.0

    def stream_rate(self) -> float:
        """Tokens per second of one stream now (knee mode: shared by those running)."""
        rate = self.config.tokens_per_second / self.slowdown()
        knee = self.config.knee
        running = self.stats.running
        if knee and running > knee:
            # Past the knee the total falls: each stream gets its share of less.
            total = knee * rate * (knee / running) ** self.config.knee_falloff
            return total / running
        return rate

    async def generation_delay(self, tokens: int) -> None:
        """Sleep as long as generating ``tokens`` takes at the configured rate."""
        if self.config.tokens_per_second > 0 and tokens > 0:
            if not self.config.knee:
                await asyncio.sleep(tokens / self.config.tokens_per_second * self.slowdown())
                return
            for _ in range(tokens):
                await asyncio.sleep(1.0 / self.stream_rate())

    def completion_body(self, plan: _Plan) -> bytes:
        """The non-streamed ``chat.completion`` document."""
        message: dict[str, Any] = {"role": "assistant", "content": " ".join(plan.content)}
        if plan.tool_calls:
            message["tool_calls"] = plan.tool_calls
        if self.config.reasoning:
            message["reasoning_content"] = " ".join(plan.reasoning)
        document = {
            "id": self.next_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": plan.usage,
        }
        return json.dumps(document).encode()

    def stream_events(self, plan: _Plan, include_usage: bool,
                      token_ids: bool = False) -> tuple[list[bytes], int]:
        """SSE events of a streamed answer, and how many of them are token chunks.

        Order: a role chunk, one chunk per reasoning word, one per answer word, a
        finish chunk, the usage chunk when requested, then ``[DONE]``.
        """
        head = (
            f'data: {{"id":"{self.next_id()}","object":"chat.completion.chunk",'
            f'"created":{int(time.time())},"model":{json.dumps(self.config.model)},"choices":'
        )
        choice_head = head + '[{"index":0,"delta":'

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            tail = ',"logprobs":null,"finish_reason":' + json.dumps(finish) + "}]}\n\n"
            piece = delta.get("content") or delta.get("reasoning_content")
            if token_ids and piece:
                # Not a real tokenizer's ids: stable per word, one per chunk, as vLLM sends.
                fake = int.from_bytes(piece.strip().encode()[:3].ljust(3, b"\0"), "big") % 50_000
                tail = f',"token_ids":[{fake}]' + tail
            return (choice_head + json.dumps(delta) + tail).encode()

        events = [chunk({"role": "assistant", "content": ""})]
        events += [
            chunk({"reasoning_content": w if i == 0 else " " + w})
            for i, w in enumerate(plan.reasoning)
        ]
        events += [chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(plan.content)]
        for i, call in enumerate(plan.tool_calls):  # name first, then the arguments
            events.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": {"name": call["function"]["name"],
                                                              "arguments": ""}}]}))
            events.append(chunk({"tool_calls": [{"index": i, "function": {
                "arguments": call["function"]["arguments"]}}]}))
        n_tokens = len(events) - 1
        events.append(chunk({}, plan.finish_reason))
        if include_usage:
            events.append((head + '[],"usage":' + json.dumps(plan.usage) + "}\n\n").encode())
        events.append(_SSE_DONE)
        return events, n_tokens


class _ChatCompletions:
    """Raw ASGI endpoint for ``POST /v1/chat/completions``."""

    def __init__(self, sim: _Simulator) -> None:
        """Serve completions from ``sim``."""
        self.sim = sim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one request, keeping the ``active`` gauge exact."""
        self.sim.stats.enter()
        try:
            await self._handle(receive, send)
        finally:
            self.sim.stats.leave()

    async def _handle(self, receive: Receive, send: Send) -> None:
        """Parse, pick a fault, then answer (or misbehave)."""
        sim, stats = self.sim, self.sim.stats
        raw = await _read_body(receive)
        if raw is None:
            stats.disconnects += 1
            return
        try:
            request = _parse_chat_request(raw)
            stats.prompts[request.last_user] = stats.prompts.get(request.last_user, 0) + 1
            if sim.config.record_requests:
                body = json.loads(raw)
                stats.log.append({k: body.get(k) for k in ("messages", "max_tokens", "tools",
                                                           "tool_choice")})
            stats.streamed += request.stream
            fault = sim.choose_fault(request)
        except _BadRequest as exc:
            stats.rejected += 1
            await _send_error(send, 400, str(exc), "BadRequestError")
            return
        if request.model is not None and request.model != sim.config.model:
            # vLLM's answer to a model it does not serve.
            stats.rejected += 1
            await _send_error(send, 404, f"The model `{request.model}` does not exist.",
                              "NotFoundError")
            return
        if time.monotonic() < sim.overload_until:
            status, retry = sim.overload
            stats.faults["overload"] = stats.faults.get("overload", 0) + 1
            extra = [(b"retry-after", f"{retry:g}".encode())] if retry is not None else []
            await _send_error(send, status, "Server overloaded (simulated); retry later.",
                              "ServiceUnavailableError", extra)
            return
        if fault is not None:
            stats.faults[fault] = stats.faults.get(fault, 0) + 1
        if fault in _ERROR_FAULTS:
            await self._send_fault_error(fault, send)
            return
        guard = _DisconnectGuard(receive)
        try:
            await self._generate(request, fault, send)
            stats.completed += 1
        except asyncio.CancelledError:
            if not guard.absorb():
                raise
            stats.disconnects += 1
        finally:
            guard.close()

    async def _send_fault_error(self, fault: str, send: Send) -> None:
        """Answer with the HTTP error a fault stands for."""
        if fault == "rate_limit":
            retry = self.sim.config.retry_after
            header = (b"retry-after", f"{retry:g}".encode())
            message = "Rate limit exceeded (simulated); retry later."
            await _send_error(send, 429, message, "RateLimitError", [header])
        elif fault == "error":
            await _send_error(
                send, 500, "Internal server error (simulated).", "InternalServerError"
            )
        else:
            await _send_error(send, 400, _CONTEXT_LENGTH_MESSAGE, "BadRequestError")

    async def _generate(self, request: _ChatRequest, fault: str | None, send: Send) -> None:
        """Wait for capacity and latency, then send the (possibly faulty) answer."""
        sim = self.sim
        if fault == "hang":
            await _wait_forever()
        plan = sim.plan(request, fault)
        async with sim.slot():
            if sim.config.latency > 0:
                await asyncio.sleep(sim.config.latency * sim.slowdown())
            if request.stream:
                await self._stream(plan, request.include_usage, send, request.return_token_ids)
            else:
                await self._respond(plan, send)

    async def _respond(self, plan: _Plan, send: Send) -> None:
        """Send a non-streamed answer; stall/reset send half the body first."""
        await self.sim.generation_delay(len(plan.reasoning) + len(plan.content))
        if plan.fault == "html":  # a proxy's error page where the JSON document should be
            await _send_bytes(send, 200, b"<html><body>502 Bad Gateway</body></html>",
                              [(b"content-type", b"text/html")])
            return
        body = self.sim.completion_body(plan)
        if plan.fault not in ("stall", "reset"):
            await _send_bytes(send, 200, body, [_JSON_CONTENT_TYPE])
            return
        await send({"type": "http.response.start", "status": 200, "headers": [_JSON_CONTENT_TYPE]})
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        await self._misbehave(plan.fault)

    async def _stream(self, plan: _Plan, include_usage: bool, send: Send,
                      token_ids: bool = False) -> None:
        """Send a streamed answer; stall/reset stop after a few token chunks."""
        events, n_tokens = self.sim.stream_events(plan, include_usage, token_ids)
        if plan.fault == "html":
            await _send_bytes(send, 200, b"<html><body>502 Bad Gateway</body></html>",
                              [(b"content-type", b"text/html")])
            return
        events = _corrupt(events, plan.fault)
        partial = plan.fault in ("stall", "reset")
        if partial:
            n_tokens = min(n_tokens, _PARTIAL_TOKEN_CHUNKS)
            events = events[: 1 + n_tokens]
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        rate = self.sim.config.tokens_per_second
        if rate <= 0:
            await send(
                {"type": "http.response.body", "body": b"".join(events), "more_body": partial}
            )
        else:
            await send({"type": "http.response.body", "body": events[0], "more_body": True})
            for event in events[1 : 1 + n_tokens]:
                await asyncio.sleep(1.0 / self.sim.stream_rate())
                await send({"type": "http.response.body", "body": event, "more_body": True})
            tail = b"".join(events[1 + n_tokens :])
            await send({"type": "http.response.body", "body": tail, "more_body": partial})
        if partial:
            await self._misbehave(plan.fault)

    @staticmethod
    async def _misbehave(fault: str | None) -> None:
        """After a partial body: stall until the client leaves, or drop the connection."""
        if fault == "reset":
            raise _SimulatedReset("simulated connection reset")
        await _wait_forever()


def _corrupt(events: list[bytes], fault: str | None) -> list[bytes]:
    """Apply a payload fault to a streamed answer's events (role chunk first)."""
    if fault == "nodone":  # no finish chunk, no usage, no [DONE]: the body just ends
        return [e for e in events[:-1] if b'"finish_reason":null' in e]
    if fault in ("nul", "surrogate", "badutf8") and len(events) > 2:
        bad = {"nul": b"\\u0000", "surrogate": b"\\ud800", "badutf8": b"\xff\xfe"}[fault]
        first = events[1]
        i = first.index(b'"content": "') + len(b'"content": "') if b'"content": "' in first \
            else first.index(b'"content":"') + len(b'"content":"')
        events = [events[0], first[:i] + bad + first[i:], *events[2:]]
    return events


def build_app(config: SimConfig) -> Starlette:
    """Build the simulator's Starlette app for ``config`` (serve it with any ASGI server)."""
    _install_log_filter()
    sim = _Simulator(config)

    async def health(request: Request) -> Response:
        """Liveness probe, like vLLM's (200, empty body)."""
        return Response(status_code=200)

    async def models(request: Request) -> JSONResponse:
        """OpenAI model list with the one simulated model."""
        model = {
            "id": config.model,
            "object": "model",
            "created": sim.started,
            "owned_by": "synthq-simulator",
            "max_model_len": _MAX_CONTEXT,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def stats(request: Request) -> JSONResponse:
        """Current counters."""
        return JSONResponse(sim.stats.snapshot())

    async def reset(request: Request) -> JSONResponse:
        """Zero the counters and directive K-counters."""
        sim.reset()
        return JSONResponse(sim.stats.snapshot())

    async def overload(request: Request) -> JSONResponse:
        """Answer every chat call with ``status`` (+ Retry-After) for ``seconds``."""
        try:
            body = await request.json()
            seconds = float(body.get("seconds", 30.0))
            status = int(body.get("status", 503))
            retry = body.get("retry_after", 5.0)
            retry = None if retry is None else float(retry)
        except (ValueError, TypeError, AttributeError):
            return JSONResponse({"error": "expected {seconds, status, retry_after}"}, 400)
        if not (seconds >= 0 and 400 <= status <= 599 and (retry is None or retry >= 0)):
            return JSONResponse({"error": "seconds >= 0, 400 <= status <= 599, "
                                          "retry_after >= 0 or null"}, 400)
        sim.overload = (status, retry)
        sim.overload_until = time.monotonic() + seconds
        return JSONResponse({"seconds": seconds, "status": status, "retry_after": retry})

    async def slow(request: Request) -> JSONResponse:
        """Make the first token and every stream ``factor``× slower for ``seconds``."""
        try:
            body = await request.json()
            seconds = float(body.get("seconds", 30.0))
            factor = float(body.get("factor", 5.0))
        except (ValueError, TypeError, AttributeError):
            return JSONResponse({"error": "expected {seconds, factor}"}, 400)
        if not (seconds >= 0 and factor >= 1):
            return JSONResponse({"error": "seconds >= 0, factor >= 1"}, 400)
        sim.slow_factor = factor
        sim.slow_until = time.monotonic() + seconds
        return JSONResponse({"seconds": seconds, "factor": factor})

    async def requests_log(request: Request) -> JSONResponse:
        """Every request received since the last reset (``record_requests``)."""
        return JSONResponse(sim.stats.log)

    async def show_config(request: Request) -> JSONResponse:
        """The running configuration."""
        return JSONResponse(asdict(config))

    async def metrics(request: Request) -> Response:
        """vLLM's scheduler gauges in Prometheus text (with ``vllm_metrics`` on)."""
        if not config.vllm_metrics:
            return Response("Not Found", status_code=404)
        st = sim.stats
        waiting = max(0, st.active - st.running)
        labels = f'{{model_name="{config.model}"}}'
        body = "".join(
            f"# TYPE vllm:{name} gauge\nvllm:{name}{labels} {value}\n" for name, value in (
                ("num_requests_running", float(st.running)),
                ("num_requests_waiting", float(waiting)),
                ("kv_cache_usage_perc", min(1.0, st.running / config.capacity))))
        return Response(body, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", _ChatCompletions(sim), methods=["POST"]),
        Route("/metrics", metrics),
        *([Route("/v1/models", models)] if config.models_route else []),
        Route("/health", health),
        Route("/sim/stats", stats),
        Route("/sim/reset", reset, methods=["POST"]),
        Route("/sim/config", show_config),
        Route("/sim/overload", overload, methods=["POST"]),
        Route("/sim/slow", slow, methods=["POST"]),
        Route("/sim/requests", requests_log),
    ]
    return Starlette(routes=routes)


def serve(
    config: SimConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
) -> None:
    """Run the simulator with uvicorn until interrupted (blocking).

    Keep-alive outlasts httpx's 5 s pool expiry so clients never reuse a
    connection the server is closing, and the backlog absorbs connection bursts.
    """
    uv_config = uvicorn.Config(
        build_app(config),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=75,
        timeout_graceful_shutdown=2,
        backlog=4096,
    )
    _install_log_filter()  # uvicorn.Config (re)configures logging; keep ours attached
    uvicorn.Server(uv_config).run()


def _arg_parser() -> argparse.ArgumentParser:
    """Command-line flags: one per :class:`SimConfig` field plus host/port/log level."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="warning")
    for f in fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = int if f.name == "seed" else type(f.default)
            parser.add_argument(flag, type=kind, default=f.default)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m synthq.testing.simulator``."""
    args = vars(_arg_parser().parse_args(argv))
    host, port, log_level = args.pop("host"), args.pop("port"), args.pop("log_level")
    serve(SimConfig(**args), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    main()

"""Pure logic: backoff bounds, error conversion at the inference boundary, settings."""

from __future__ import annotations

import asyncio
import random

import httpx2
import pytest

from synthq.core import errors
from synthq.core.retry import backoff_delay
from synthq.serving.inference import ChatRequest, ChatResult, InferenceClient, parse_retry_after
from synthq.spec.config import Settings


def test_backoff_full_jitter_bounds() -> None:
    rng = random.Random(0)
    for attempt in range(1, 12):
        ceiling = min(60.0, 2.0 * 2 ** (attempt - 1))
        draws = [backoff_delay(attempt, base=2.0, cap=60.0, rng=rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in draws)
        assert max(draws) > ceiling * 0.8  # jitter spans the range, not a constant


def test_retry_after_is_a_floor() -> None:
    assert backoff_delay(1, base=0.1, cap=0.2, retry_after=7.0) == 7.0
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after(None) is None


def _client(handler) -> InferenceClient:  # type: ignore[no-untyped-def]
    return InferenceClient("http://sim.test/v1", transport=httpx2.MockTransport(handler))


def _call(client: InferenceClient) -> ChatResult:
    async def go() -> ChatResult:
        try:
            return await client.chat(ChatRequest(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8),
                total_timeout=5, stall_timeout=5)
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize(("status", "body", "headers", "cls"), [
    (429, {"error": {"message": "slow down"}}, {"retry-after": "2"}, errors.RateLimited),
    (500, {"error": {"message": "boom"}}, {}, errors.ServerError),
    (503, {"error": {"message": "overloaded"}}, {}, errors.ServerError),
    (408, {"error": {"message": "timeout"}}, {}, errors.ServerError),
    (400, {"object": "error", "message": "This model's maximum context length is 4096 tokens. "
           "However, you requested 5000 tokens", "code": 400}, {}, errors.ContextLength),
    (400, {"error": {"message": "bad temperature"}}, {}, errors.BadRequest),
    (404, {"error": {"message": "model not found"}}, {}, errors.BadRequest),
])
def test_status_codes_map_to_classes(status, body, headers, cls) -> None:  # type: ignore[no-untyped-def]
    client = _client(lambda req: httpx2.Response(status, json=body, headers=headers))
    with pytest.raises(cls) as info:
        _call(client)
    assert info.value.retryable == issubclass(cls, errors.RetryableError)
    if cls is errors.RateLimited:
        assert info.value.retry_after == 2.0


def test_connection_refused_is_connection_class() -> None:
    def refuse(request):  # type: ignore[no-untyped-def]
        raise httpx2.ConnectError("refused", request=request)

    with pytest.raises(errors.ConnectionFailed):
        _call(_client(refuse))


def test_stream_without_end_is_a_server_error() -> None:
    """A body that ends cleanly without [DONE] or a finish reason: the server misbehaved
    (retried as server_error); it is not unreachable (which would mark it down)."""
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"half"}}]}\n\n'
    client = _client(lambda req: httpx2.Response(
        200, content=chunk, headers={"content-type": "text/event-stream"}))
    with pytest.raises(errors.ServerError, match="without \\[DONE\\]"):
        _call(client)


def test_stream_is_assembled() -> None:
    lines = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"hmm "}}]}',
        b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}',
        b'data: {"choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"stop"}]}',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
        b"data: [DONE]",
    ]
    client = _client(lambda req: httpx2.Response(
        200, content=b"\n\n".join(lines) + b"\n\n", headers={"content-type": "text/event-stream"}))
    result = _call(client)
    assert (result.content, result.reasoning_content, result.finish_reason) == \
        ("Hello world", "hmm ", "stop")
    assert (result.prompt_tokens, result.completion_tokens) == (3, 2)


def test_error_tree_classes_are_complete() -> None:
    assert errors.RETRYABLE_CLASSES == {"timeout", "stalled", "connection", "rate_limited",
                                        "server_error"}
    assert {"bad_request", "context_length", "invalid_input", "empty_response",
            "boundary_unstable"} <= errors.PERMANENT_CLASSES


def test_settings_normalise_and_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(database_url="postgres://u@h/db")
    assert s.database_url == "postgresql+psycopg://u@h/db"
    assert Settings(database_url="").database_url.startswith("sqlite:///")
    with pytest.raises(ValueError, match="redis://"):
        Settings(broker_url="amqp://guest@localhost//")

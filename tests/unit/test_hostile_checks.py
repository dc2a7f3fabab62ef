"""The checks a server's answer passes before synthq trusts it (pure functions; issue 24)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from synthq.core import netio
from synthq.serving.answer import MAX_USAGE_TOKENS, Accumulator, checked_usage
from synthq.serving.inference import ChatRequest, _ceiling


def usage(value: Any, *, ids: list[int] | None = None, prompt_ids: list[int] | None = None,
          streamed: int | None = 3, text: bool = True, ceiling: int = 64) -> tuple[Any, ...]:
    u = checked_usage(value, ceiling=ceiling, ids=ids, prompt_ids=prompt_ids,
                      streamed=streamed, text=text)
    return u.prompt, u.completion, u.problem is not None


@pytest.mark.parametrize(("given", "expected"), [
    ({"prompt_tokens": 7, "completion_tokens": 12}, (7, 12, False)),
    (None, (None, None, False)),  # no usage at all: unknown, not a problem
    ({}, (None, None, False)),
    ({"prompt_tokens": -1, "completion_tokens": -1}, (None, 3, True)),
    ({"prompt_tokens": "7", "completion_tokens": "1e9"}, (None, 3, True)),
    ({"prompt_tokens": 7.0, "completion_tokens": 12.0}, (None, 3, True)),
    ({"prompt_tokens": False, "completion_tokens": True}, (None, 3, True)),
    ({"prompt_tokens": MAX_USAGE_TOKENS + 1, "completion_tokens": 5}, (None, 5, True)),
    ({"prompt_tokens": 7, "completion_tokens": 65}, (7, 3, True)),  # over max_tokens
    ({"prompt_tokens": 7, "completion_tokens": 0}, (7, 3, True)),  # text streamed: >= 1
    ([1, 2], (None, 3, True)),
    ("12", (None, 3, True)),
])
def test_usage_is_checked(given: Any, expected: tuple[Any, ...]) -> None:
    assert usage(given) == expected


def test_usage_is_checked_against_the_token_ids() -> None:
    # Fewer than the ids streamed: the ids count; as many or more (within max_tokens): kept.
    assert usage({"completion_tokens": 2}, ids=[1, 2, 3, 4]) == (None, 4, True)
    assert usage({"completion_tokens": 4}, ids=[1, 2, 3, 4]) == (None, 4, False)
    assert usage({"completion_tokens": 9}, ids=[1, 2, 3, 4]) == (None, 9, False)
    # The prompt's token ids are the prompt count.
    assert usage({"prompt_tokens": 3}, prompt_ids=[5] * 8) == (8, None, True)
    # An answer of tool calls only may count 0 tokens (no text was streamed).
    assert usage({"completion_tokens": 0}, text=False) == (None, 0, False)


def test_the_ceiling_is_the_request_as_sent() -> None:
    request = ChatRequest(model="m", messages=[], max_tokens=64)
    assert _ceiling(request) == 64
    request.extra_body = {"max_completion_tokens": 100, "max_tokens": "9"}
    assert _ceiling(request) == 100


def test_streamed_pieces_count_text_chunks_and_tool_call_pieces() -> None:
    acc = Accumulator()
    for chunk in ({"choices": [{"delta": {"content": "a"}}]},
                  {"choices": [{"delta": {"reasoning_content": "r"}}]},
                  {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
                      "name": "f", "arguments": "{"}}]}}]},
                  {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
                      "arguments": "}"}}]}}]}):
        acc.add(chunk)
    assert acc.pieces() == 4


async def _chunks(size: int, count: int | None, pause: float = 0.0) -> AsyncIterator[bytes]:
    sent = 0
    while count is None or sent < count:
        yield b"x" * size
        sent += 1
        if pause:
            await asyncio.sleep(pause)


def test_read_bounded_caps_bytes_and_time() -> None:
    data, complete = asyncio.run(netio.read_bounded(_chunks(1000, 3), max_bytes=10_000,
                                                    seconds=5))
    assert (len(data), complete) == (3000, True)
    data, complete = asyncio.run(netio.read_bounded(_chunks(1000, None), max_bytes=2500,
                                                    seconds=5))
    assert (len(data), complete) == (2500, False)
    data, complete = asyncio.run(netio.read_bounded(_chunks(10, None, pause=0.01),
                                                    max_bytes=1 << 20, seconds=0.2))
    assert not complete and 0 < len(data) < 1000

"""Integration tests of the OpenAI-compatible simulator (synthq.testing.simulator).

Each simulator runs as a real uvicorn subprocess on a free loopback port and is
driven through the ``openai`` client and raw ``httpx``, the way synthq's workers
and benchmarks use it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from support import Simulator

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def start_sim() -> Iterator[Callable[[str], Simulator]]:
    """Factory starting simulators; all are killed at the end of the module."""
    started: list[Simulator] = []

    def start(config: str = "") -> Simulator:
        sim = Simulator(config=config)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.close()


@pytest.fixture(scope="module")
def sim(start_sim: Callable[[str], Simulator]) -> Simulator:
    """A fast simulator: 8-word answers, 20 ms latency, retry_after=2."""
    return start_sim("latency=0.02, response_tokens=8, retry_after=2")


@pytest.fixture(scope="module")
def reasoning_sim(start_sim: Callable[[str], Simulator]) -> Simulator:
    """A reasoning simulator streaming at 50 tokens/s."""
    return start_sim(
        "latency=0.02, reasoning=True, response_tokens=8, reasoning_tokens=4, tokens_per_second=50"
    )


def _prompt(text: str = "") -> str:
    """A prompt unique to the calling test, so directive counters never collide."""
    return f"Explain durable queues {uuid.uuid4().hex[:8]} {text}".strip()


def _ask(sim: Simulator, content: str, **kwargs: Any) -> Any:
    """One non-streamed chat completion."""
    return sim.client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": content}], **kwargs
    )


def _stream(sim: Simulator, content: str, **kwargs: Any) -> list[Any]:
    """One streamed chat completion, as the list of chunks."""
    stream = sim.client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": content}], stream=True, **kwargs
    )
    return list(stream)


# --------------------------------------------------------------------------- basics


def test_health_and_models(sim: Simulator) -> None:
    assert sim.http.get("/health").status_code == 200
    models = sim.client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]


def test_non_streamed_answer_is_deterministic(sim: Simulator) -> None:
    prompt = _prompt()
    first = _ask(sim, prompt)
    second = _ask(sim, prompt)
    other = _ask(sim, _prompt())
    choice = first.choices[0]
    words = choice.message.content.split()
    assert first.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert len(words) == 8
    assert words[:3] == prompt.split()[:3]  # short echo of the prompt
    assert second.choices[0].message.content == choice.message.content
    assert other.choices[0].message.content != choice.message.content
    assert first.usage.prompt_tokens == len(prompt.split())
    assert first.usage.completion_tokens == 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8


def test_prompt_tokens_count_all_messages(sim: Simulator) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "one two three"}]},
    ]
    answer = sim.client.chat.completions.create(model="sim-model", messages=messages)
    assert answer.usage.prompt_tokens == 6
    assert answer.choices[0].message.content.split()[:3] == ["one", "two", "three"]


def test_streamed_answer_with_usage(sim: Simulator) -> None:
    prompt = _prompt()
    chunks = _stream(sim, prompt, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == _ask(sim, prompt).choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8
    # one chunk per word: role + 8 words + finish + usage
    assert len(chunks) == 11


def test_raw_sse_framing(sim: Simulator) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": _prompt()}],
            "stream": True}
    response = sim.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event.removeprefix("data: "))
    assert "usage" not in events[-3]  # no usage chunk unless include_usage


def test_max_tokens_caps_answer(sim: Simulator) -> None:
    capped = _ask(sim, _prompt(), max_tokens=3)
    assert len(capped.choices[0].message.content.split()) == 3
    assert capped.choices[0].finish_reason == "length"
    newer = _ask(sim, _prompt(), max_completion_tokens=5)
    assert newer.usage.completion_tokens == 5
    roomy = _ask(sim, _prompt(), max_tokens=100, temperature=0.7)
    assert roomy.choices[0].finish_reason == "stop"


def test_unknown_fields_are_ignored(sim: Simulator) -> None:
    answer = _ask(
        sim,
        _prompt(),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "top_k": 5},
    )
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim-model"},
        {"model": "sim-model", "messages": []},
        {"model": "sim-model", "messages": "hello"},
        {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"model": "sim-model", "messages": [{"role": "user", "content": "x [[sim:typo]]"}]},
    ],
)
def test_invalid_requests_get_openai_400(sim: Simulator, body: dict[str, Any]) -> None:
    response = sim.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400 and error["message"]


def test_invalid_json_gets_400(sim: Simulator) -> None:
    response = sim.http.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400


# --------------------------------------------------------------------------- reasoning


def test_reasoning_non_streamed(reasoning_sim: Simulator) -> None:
    answer = _ask(reasoning_sim, _prompt())
    message = answer.choices[0].message
    assert len(message.content.split()) == 8
    assert len(message.reasoning_content.split()) == 4
    assert answer.usage.completion_tokens == 12


def test_reasoning_streamed_before_content(reasoning_sim: Simulator) -> None:
    started = time.monotonic()
    chunks = _stream(reasoning_sim, _prompt())
    elapsed = time.monotonic() - started
    kinds = []
    for chunk in chunks[1:]:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            kinds.append("r")
        elif delta.content:
            kinds.append("c")
    assert kinds == ["r"] * 4 + ["c"] * 8
    assert elapsed >= 12 / 50  # tokens_per_second=50 paces the 12 tokens


def test_reasoning_counts_toward_max_tokens(reasoning_sim: Simulator) -> None:
    answer = _ask(reasoning_sim, _prompt(), max_tokens=6)
    message = answer.choices[0].message
    assert len(message.reasoning_content.split()) == 4
    assert len(message.content.split()) == 2
    assert answer.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- faults


def test_rate_limit_directive(sim: Simulator) -> None:
    with pytest.raises(openai.RateLimitError) as info:
        _ask(sim, _prompt("[[sim:rate_limit]]"))
    assert info.value.response.headers["retry-after"] == "2"
    assert info.value.body["type"] == "RateLimitError"


def test_error_directive(sim: Simulator) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        _ask(sim, _prompt("[[sim:error]]"))
    assert info.value.status_code == 500


def test_context_length_directive(sim: Simulator) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(sim, _prompt("[[sim:context_length]]"))
    assert "maximum context length" in str(info.value)
    assert info.value.body["code"] == 400
    assert info.value.body["message"].startswith("This model's maximum context length is 4096")


def test_reset_directive_breaks_the_stream(sim: Simulator) -> None:
    received: list[Any] = []
    with pytest.raises(openai.APIConnectionError):  # the SDK wraps the broken chunked read
        for chunk in sim.client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": _prompt("[[sim:reset]]")}],
            stream=True,
        ):
            received.append(chunk)
    assert received  # some chunks arrived before the connection dropped
    body = {"model": "sim-model",
            "messages": [{"role": "user", "content": _prompt("[[sim:reset]]")}]}
    with pytest.raises(httpx.RemoteProtocolError):
        sim.http.post("/v1/chat/completions", json=body)
    with pytest.raises(openai.APIConnectionError):
        _ask(sim, _prompt("[[sim:reset]]"))


def test_stall_and_hang_time_out_and_release(sim: Simulator) -> None:
    sim.reset()
    timeout = httpx.Timeout(5.0, read=0.5)
    with httpx.Client(base_url=sim.base_url, timeout=timeout) as client:
        body = {"model": "sim-model",
                "messages": [{"role": "user", "content": _prompt("[[sim:hang]]")}]}
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=body)
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": _prompt("[[sim:stall]]")}],
            "stream": True,
        }
        lines: list[str] = []
        with (
            pytest.raises(httpx.ReadTimeout),
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines.extend(line for line in response.iter_lines() if line)
        assert lines and all(line != "data: [DONE]" for line in lines)
    stats = sim.wait_idle()
    assert stats["active"] == 0
    assert stats["disconnects"] == 2
    assert stats["faults"]["hang"] == 1 and stats["faults"]["stall"] == 1


def test_empty_directive(sim: Simulator) -> None:
    answer = _ask(sim, _prompt("[[sim:empty]]"))
    assert answer.choices[0].message.content == ""
    assert answer.choices[0].finish_reason == "stop"
    chunks = _stream(sim, _prompt("[[sim:empty]]"))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_length_directive(sim: Simulator) -> None:
    answer = _ask(sim, _prompt("[[sim:length]]"))
    assert answer.choices[0].finish_reason == "length"
    assert 0 < len(answer.choices[0].message.content.split()) < 8
    chunks = _stream(sim, _prompt("[[sim:length]]"))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_counted_directive_lets_retries_succeed(sim: Simulator) -> None:
    prompt = _prompt("[[sim:error*2]]")
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            _ask(sim, prompt)
    assert _ask(sim, prompt).choices[0].finish_reason == "stop"
    assert _ask(sim, prompt).choices[0].finish_reason == "stop"
    sim.reset()  # reset restarts the K-counters
    with pytest.raises(openai.InternalServerError):
        _ask(sim, prompt)


def test_random_fault_rates(start_sim: Callable[[str], Simulator]) -> None:
    faulty = start_sim("latency=0, response_tokens=4, error_rate=0.3, length_rate=0.3, seed=7")
    errors = lengths = 0
    for _ in range(40):
        try:
            answer = _ask(faulty, _prompt())
        except openai.InternalServerError:
            errors += 1
        else:
            lengths += answer.choices[0].finish_reason == "length"
    stats = faulty.stats()
    assert stats["faults"]["error"] == errors and 0 < errors < 40
    assert stats["faults"]["length"] == lengths and 0 < lengths < 40
    assert stats["requests"] == 40 and stats["completed"] == 40 - errors


# --------------------------------------------------------------------------- capacity and stats


def test_capacity_limits_concurrency(start_sim: Callable[[str], Simulator]) -> None:
    limited = start_sim("capacity=2, latency=0.5, response_tokens=4")
    results: list[str] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results.append(_ask(limited, f"request number {i}").choices[0].finish_reason)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    assert not errors and results == ["stop"] * 6
    # At least three rounds of 0.5 s. No upper bound: that two ran at once is what
    # max_running says, and a loaded machine's seconds say nothing (it failed at 2.5 s
    # under a suite on three processes).
    assert elapsed >= 1.45
    stats = limited.stats()
    assert stats["max_running"] == 2
    assert stats["max_active"] == 6
    assert stats["active"] == 0 and stats["running"] == 0
    assert stats["completed"] == 6


def test_slow_makes_every_answer_factor_times_slower_for_a_while(
        start_sim: Callable[[str], Simulator]) -> None:
    """``POST /sim/slow``: the first token and the stream ``factor``× slower, then back."""
    slowed = start_sim("latency=0.1, response_tokens=4, tokens_per_second=40")

    def timed() -> float:
        started = time.monotonic()
        assert len(_stream(slowed, _prompt())) > 4
        return time.monotonic() - started

    timed()  # the client's first call sets up its connection
    normal = timed()  # 0.1 s + 4 tokens at 40/s: ~0.2 s
    answer = slowed.http.post("/sim/slow", json={"seconds": 2.0, "factor": 5})
    assert answer.json() == {"seconds": 2.0, "factor": 5.0}
    slow = timed()  # ~1 s
    assert slow >= 0.9 and slow >= normal + 0.5, (normal, slow)
    time.sleep(2.0)
    assert timed() < slow - 0.4
    assert slowed.http.post("/sim/slow", json={"factor": 0.5}).status_code == 400


def test_stats_count_prompts_and_reset(sim: Simulator) -> None:
    sim.reset()
    first, second = _prompt("alpha"), _prompt("beta")
    for prompt in (first, first, second):
        _ask(sim, prompt)
    _stream(sim, first)
    stats = sim.stats()
    assert stats["prompts"] == {first: 3, second: 1}
    assert stats["requests"] == 4 and stats["completed"] == 4
    assert stats["active"] == 0 and stats["max_active"] >= 1
    assert set(stats["faults"]) == {
        "hang",
        "stall",
        "rate_limit",
        "error",
        "context_length",
        "reset",
        "empty",
        "length",
    }
    sim.reset()
    stats = sim.stats()
    assert stats["requests"] == 0 and stats["prompts"] == {} and stats["max_active"] == 0

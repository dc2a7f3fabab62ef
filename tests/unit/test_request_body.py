"""What synthq sends: extra_body cannot override the fields synthq sets, nor send those
that change the answers' count, length, shape or accounting (issue 24, item 4). A real
HTTP server of the test's own records each request's whole body."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from synthq.core.errors import UserError
from synthq.serving.inference import ChatRequest, InferenceClient
from synthq.spec import jobspec

ANSWER = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
]


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in ANSWER)
            out += b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", bodies
    httpd.shutdown()
    httpd.server_close()


#: What a job stored before extra_body was checked could hold.
HOSTILE = {"model": "other", "messages": [], "stream": False, "max_tokens": 10**6,
           "n": 100, "best_of": 100, "max_completion_tokens": 10**6, "ignore_eos": True,
           "logprobs": True, "top_logprobs": 20, "stream_options": {"include_usage": False},
           "echo": True, "seed": 7, "return_token_ids": True,
           # names a capture file in synthq's connector: two calls naming one wedged vLLM
           "kv_transfer_params": {"synthq_name": "dup"}}


def test_extra_body_cannot_override_what_synthq_sets(
        server: tuple[str, list[dict[str, Any]]]) -> None:
    url, bodies = server

    async def call() -> None:
        client = InferenceClient(url)
        try:
            result = await client.chat(ChatRequest(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                sampling={"temperature": 0.5}, extra_body=HOSTILE),
                total_timeout=10, stall_timeout=10)
            assert (result.content, result.completion_tokens) == ("ok", 1)
        finally:
            await client.close()

    asyncio.run(call())
    [body] = bodies
    assert (body["model"], body["messages"], body["max_tokens"], body["stream"]) == (
        "m", [{"role": "user", "content": "hi"}], 8, True)
    assert body["stream_options"] == {"include_usage": True}
    assert not {"n", "best_of", "max_completion_tokens", "ignore_eos", "logprobs",
                "top_logprobs", "echo", "kv_transfer_params"} & set(body), body
    # What extra_body is for still goes through.
    assert (body["seed"], body["return_token_ids"], body["temperature"]) == (7, True, 0.5)


@pytest.mark.parametrize("key", sorted(jobspec.RESERVED_BODY))
def test_create_and_requeue_refuse_each_reserved_key_in_one_line(key: str) -> None:
    for check in (lambda: jobspec.check(jobspec.BY_NAME["extra_body"], {key: 1}),
                  lambda: jobspec.check_overrides({"extra_body": {key: 1}})):
        with pytest.raises(UserError) as info:
            check()
        message = str(info.value)
        assert f"--extra-body may not set ['{key}']" in message and "\n" not in message


@pytest.mark.parametrize("key", sorted(jobspec.RESERVED_BODY))
def test_sampling_options_refuse_the_same_reserved_keys(key: str) -> None:
    """Sampling options are sent in the body as extra_body is: the one list
    (jobspec.RESERVED_BODY) refuses a key in either, each with its own words."""
    from synthq.jobs.enqueue import JobSpec

    spec = JobSpec(name="j", model="m", servers=["http://127.0.0.1:9/v1"],
                   sampling={key: 1})
    with pytest.raises(UserError) as info:
        spec.check()
    assert f"sampling options may not set ['{key}']" in str(info.value)

"""A hostile server cannot exhaust synthq's memory or make it pay without limit (issue 24).

Each test runs a real HTTP server of its own (:mod:`synthq.testing.hostile`, in a
thread) against the real client, the embedded runner or the executor, and real
PostgreSQL for the ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import select, text

from synthq.store.db import session_scope
from synthq.store.models import Attempt, Sample
from synthq.testing.hostile import GOOD_CHUNKS, MALFORMED, Hostile, Script

pytestmark = pytest.mark.integration


@pytest.fixture
def hostile() -> Iterator[Callable[..., Hostile]]:
    """``hostile(Script(...))`` starts one; all stop at teardown."""
    started: list[Hostile] = []

    def start(script: Script | None = None) -> Hostile:
        server = Hostile(script)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def samples(job_id: int) -> list[Sample]:
    with session_scope() as s:
        return list(s.scalars(select(Sample).where(Sample.job_id == job_id)
                              .order_by(Sample.id)))


def attempts(sample_id: int) -> list[tuple[str | None, str | None]]:
    with session_scope() as s:
        return list(s.execute(select(Attempt.outcome, Attempt.error_message)
                              .where(Attempt.sample_id == sample_id)
                              .order_by(Attempt.id)).tuples())


# -- 1. an error answer with a 3 GB body ------------------------------------------------------


def test_a_huge_error_body_costs_its_first_bytes(hostile: Callable[..., Hostile],
                                                 job_factory: Callable[..., Any]) -> None:
    """A 500 with a 3 GB body: before, ``aread()`` took it all (4.3 GB RSS). Now a message's
    worth is read and the connection dropped; the sample fails as server_error within its
    attempts."""
    from synthq.app.embedded import run_job

    server = hostile(Script(error_status=500, error_bytes=3_000_000_000))
    report = job_factory(["pay me"], servers=[server.url], max_attempts=2)
    started = time.monotonic()
    run_job(report.job_id)
    took = time.monotonic() - started
    [smp] = samples(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == ("failed", "server_error", 2)
    assert (smp.error_message or "").startswith("HTTP 500"), smp.error_message
    assert server.calls == 2
    # What the server managed to write before the client hung up: socket buffers and
    # the capped read, not gigabytes.
    assert server.sent < 64 << 20, server.sent
    assert took < 30, took


# -- 2. probe bodies that never end -----------------------------------------------------------


@pytest.mark.parametrize("trickle", [False, True], ids=["flood", "trickle"])
def test_probe_bodies_that_never_end_are_cut(hostile: Callable[..., Hostile], trickle: bool
                                             ) -> None:
    """``/health``, ``/v1/models`` and ``/metrics`` answering 200 with a body that never
    ends, as a flood (the byte cap stops it) or a trickle (the deadline does): each read
    ends within its deadline, having read at most its cap."""
    import httpx

    from synthq.serving import gauges, health

    server = hostile(Script(endless=("/health", "/v1/models", "/metrics"), trickle=trickle))
    client = httpx.Client()
    try:
        started = time.monotonic()
        assert health.probe(server.url, client) is None  # it answered 200: up
        assert time.monotonic() - started < health.PROBE_TIMEOUT + 2

        started = time.monotonic()
        warnings = health.check_model([server.url], "hostile", client=client)
        assert time.monotonic() - started < health.PROBE_TIMEOUT + 2
        assert len(warnings) == 1 and "did not end within" in warnings[0], warnings
        assert "is not checked" in warnings[0]

        gauges._no_gauges.pop(server.url, None)
        started = time.monotonic()
        assert gauges.scrape(server.url) == {}
        assert time.monotonic() - started < gauges.METRICS_SECONDS + 2
    finally:
        client.close()
        gauges._no_gauges.pop(server.url, None)
    # Three reads, each cut at its cap (4 MiB at most) plus what sockets buffer.
    assert server.sent < 64 << 20, server.sent


def test_the_bounded_read_keeps_a_whole_small_body(hostile: Callable[..., Hostile]) -> None:
    """The caps cut only what passes them: a normal server's answers are read whole."""
    import httpx

    from synthq.serving import gauges, health

    server = hostile()
    with httpx.Client() as client:
        assert health.served_models(server.url, client) == ["hostile"]
        assert health.check_model([server.url], "hostile", client=client) == []
    gauges._no_gauges.pop(server.url, None)
    assert gauges.scrape(server.url) == {"running": 1.0, "waiting": 0.0}


# -- 3. stream chunks of the wrong shape ------------------------------------------------------

@pytest.mark.parametrize("shape", list(MALFORMED))
def test_a_chunk_of_the_wrong_shape_is_a_server_error_within_its_attempts(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        caplog: pytest.LogCaptureFixture, shape: str) -> None:
    """Before, ``"delta": "str"`` raised AttributeError in the worker: worker_error, retried
    at once for ever (262 calls for 10 samples at max_attempts 1), a traceback per call.
    Now the chunk is the server's fault: server_error, max_attempts calls, backoff, the
    run ends, and no traceback is logged."""
    from synthq.app.embedded import run_job

    server = hostile(Script(chunks=[*MALFORMED[shape], *GOOD_CHUNKS]))
    report = job_factory(["first", "second"], servers=[server.url], max_attempts=2)
    caplog.set_level(logging.WARNING)
    run_job(report.job_id)
    done = samples(report.job_id)
    assert [(s.state, s.error_class, s.attempts) for s in done] == \
        [("failed", "server_error", 2)] * 2, [s.error_message for s in done]
    assert all("malformed stream chunk" in (s.error_message or "") for s in done)
    assert server.calls == 4  # max_attempts per sample, not one more
    assert [o for o, _ in attempts(done[0].id)] == ["server_error", "server_error"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize("document", [
    {"choices": [{"message": {"content": 5}, "finish_reason": "stop"}]},
    {"choices": [{"message": {"content": "a", "tool_calls": [{"function": "f"}]},
                  "finish_reason": "stop"}]},
    {"choices": [{"message": {"content": "a"}, "finish_reason": ["stop"]}]},
    {"choices": [{"message": {"content": "a"}, "finish_reason": "stop", "token_ids": "x"}]},
], ids=["content-number", "tool-function-str", "finish-list", "token-ids-str"])
def test_a_document_of_the_wrong_shape_is_a_server_error(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        document: dict[str, Any]) -> None:
    """The same for a non-streamed answer (``stream=False``)."""
    from synthq.app.embedded import run_job

    server = hostile(Script(document=document))
    report = job_factory(["plain"], servers=[server.url], max_attempts=2, stream=False)
    run_job(report.job_id)
    [smp] = samples(report.job_id)
    assert (smp.state, smp.error_class, smp.attempts) == ("failed", "server_error", 2), \
        smp.error_message
    assert "malformed response" in (smp.error_message or "")
    assert server.calls == 2


def test_any_unexpected_error_in_a_call_ends_within_its_attempts(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug that every call meets (here the client raises after the server answered):
    each call counts an attempt and backs off; after max_attempts the sample fails as
    worker_error, and the run ends. The traceback is logged once, then one line a call."""
    from synthq.app.embedded import run_job
    from synthq.serving.inference import InferenceClient

    server = hostile()
    real_chat = InferenceClient.chat

    async def chat_then_break(self: InferenceClient, *args: Any, **kwargs: Any) -> Any:
        await real_chat(self, *args, **kwargs)
        raise AttributeError("a bug after the answer")

    monkeypatch.setattr(InferenceClient, "chat", chat_then_break)
    report = job_factory(["one", "two"], servers=[server.url], max_attempts=3,
                         backoff_base=0.2, backoff_cap=0.2)
    caplog.set_level(logging.WARNING)
    run_job(report.job_id)
    done = samples(report.job_id)
    assert [(s.state, s.error_class, s.attempts) for s in done] == \
        [("failed", "worker_error", 3)] * 2
    assert all("gave up after 3 attempts" in (s.error_message or "") for s in done)
    assert server.calls == 6
    assert [o for o, _ in attempts(done[0].id)] == ["worker_error"] * 3
    assert len([r for r in caplog.records if r.exc_info]) == 1
    # The retries waited (the backoff), and the sample never went back at once.
    with session_scope() as s:
        starts = list(s.scalars(select(Attempt.started_at)
                                .where(Attempt.sample_id == done[0].id).order_by(Attempt.id)))
    assert len(starts) == 3


# -- 6. --regenerate all: turns and request size ---------------------------------------------


def _conversation(turns: int) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i}"},
                     {"role": "assistant", "content": f"answer {i}"}]
    return messages


def test_a_row_with_too_many_turns_is_skipped_at_enqueue(job_factory: Callable[..., Any]
                                                         ) -> None:
    """A 2,500-turn row made 2,500 calls with growing bodies. Over
    SYNTHQ_MAX_REGENERATED_TURNS (default 64) it is skipped with its reason; the other
    rows are enqueued."""
    from synthq.data.dataset import Row
    from synthq.spec.config import get_settings

    assert get_settings().max_regenerated_turns == 64
    rows = [Row(0, _conversation(3)), Row(1, _conversation(65)), Row(2, _conversation(64))]
    report = job_factory(rows=rows, regenerate="all")
    assert (report.inserted, report.skipped) == (3, 1)
    by_index = {s.dataset_index: s for s in samples(report.job_id)}
    assert (by_index[0].state, by_index[0].turn_count) == ("pending", 3)
    assert (by_index[2].state, by_index[2].turn_count) == ("pending", 64)
    over = by_index[1]
    assert over.state == "skipped" and over.turn_count is None
    assert "65 assistant turns to regenerate, over SYNTHQ_MAX_REGENERATED_TURNS=64" in \
        (over.error_message or ""), over.error_message
    assert report.skip_examples == [("row 2", "65 assistant turns to regenerate, over "
                                     "SYNTHQ_MAX_REGENERATED_TURNS=64")]


def test_a_request_over_the_size_cap_fails_before_it_is_sent(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--history-reasoning keep`` with a server whose reasoning is huge: every turn's
    request carries all the reasoning so far (82.8 MB by turn 24). Past
    SYNTHQ_MAX_REQUEST_BYTES the call fails as request_too_large, unsent."""
    from synthq.app.embedded import run_job
    from synthq.data.dataset import Row
    from synthq.spec.config import get_settings

    assert get_settings().max_request_bytes == 16 << 20
    cap = 3 << 20
    monkeypatch.setenv("SYNTHQ_MAX_REQUEST_BYTES", str(cap))
    get_settings.cache_clear()
    server = hostile(Script(reasoning_bytes=1 << 20))
    report = job_factory(rows=[Row(0, _conversation(10))], servers=[server.url],
                         regenerate="all", history_reasoning="keep")
    run_job(report.job_id)
    [smp] = samples(report.job_id)
    assert (smp.state, smp.error_class) == ("failed", "request_too_large"), smp.error_message
    assert (smp.error_message or "").startswith("turn 4 of 10: the request body is ")
    assert f"over SYNTHQ_MAX_REQUEST_BYTES={cap:,}" in (smp.error_message or "")
    # Turns 1-3 were sent (each under the cap); turn 4's body was never sent.
    assert server.calls == 3 and max(server.request_sizes) <= cap, server.request_sizes
    assert [o for o, _ in attempts(smp.id)] == ["ok", "ok", "ok", "request_too_large"]


# -- 10. usage is checked, and no SQL reaches a sample's message -------------------------------

BAD_USAGE = {
    "negative": {"prompt_tokens": -5, "completion_tokens": -100},
    "huge": {"prompt_tokens": 10**15, "completion_tokens": 10**15},
    "string": {"prompt_tokens": "1e9", "completion_tokens": "1e9"},
    "float": {"prompt_tokens": 5.0, "completion_tokens": 1e9},
    "bool": {"prompt_tokens": True, "completion_tokens": True},
    "list": [1, 2],
    "over-max-tokens": {"prompt_tokens": 5, "completion_tokens": 65},
    "under-streamed": {"prompt_tokens": 5, "completion_tokens": 0},
}


@pytest.mark.parametrize("usage", list(BAD_USAGE))
def test_a_bad_usage_is_replaced_by_the_streamed_count(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        caplog: pytest.LogCaptureFixture, usage: str) -> None:
    """Negative tokens made the cost report and a Prometheus counter negative; 10**15
    failed a good answer (with the SQL in its message); "1e9" counted as 10**9. Now a
    bad figure is replaced by what was streamed (two chunks of text: 2), with a warning,
    and the answer is done."""
    from synthq.app.embedded import run_job

    chunks = [*GOOD_CHUNKS[:-1], {"choices": [], "usage": BAD_USAGE[usage]}]
    server = hostile(Script(chunks=chunks))
    report = job_factory(["count me"], servers=[server.url], max_tokens=64)
    caplog.set_level(logging.WARNING, logger="synthq.serving.inference")
    run_job(report.job_id)
    [smp] = samples(report.job_id)
    assert (smp.state, smp.response_content) == ("done", "hello hostile"), smp.error_message
    assert smp.completion_tokens == 2
    assert smp.prompt_tokens in (None, 5)
    with session_scope() as s:
        rows = list(s.scalars(select(Attempt.completion_tokens)
                              .where(Attempt.sample_id == smp.id)))
    assert rows == [2]
    assert any("invalid usage" in r.getMessage() for r in caplog.records)


def test_a_good_usage_is_kept(hostile: Callable[..., Hostile],
                              job_factory: Callable[..., Any]) -> None:
    """The checks keep a plausible figure as the server gave it (a chunk may carry
    several tokens)."""
    from synthq.app.embedded import run_job

    chunks = [*GOOD_CHUNKS[:-1], {"choices": [], "usage": {"prompt_tokens": 9,
                                                           "completion_tokens": 40}}]
    server = hostile(Script(chunks=chunks))
    report = job_factory(["count me"], servers=[server.url], max_tokens=64)
    run_job(report.job_id)
    [smp] = samples(report.job_id)
    assert (smp.state, smp.prompt_tokens, smp.completion_tokens) == ("done", 9, 40)


def test_a_database_refusal_never_puts_sql_in_the_message(
        hostile: Callable[..., Hostile], job_factory: Callable[..., Any],
        pg: str, caplog: pytest.LogCaptureFixture) -> None:
    """A result the database refuses fails the sample with a short message (the driver's
    first line); the whole error, statement included, goes to the log only. Before, the
    sample's message held the UPDATE with its claim token, shown by the API and page."""
    from sqlalchemy import create_engine

    from synthq.app.embedded import run_job

    engine = create_engine(pg)
    with engine.begin() as conn:  # the database itself refuses this answer
        conn.execute(text("ALTER TABLE samples ADD CONSTRAINT hostile_refuses "
                          "CHECK (response_content IS NULL OR response_content <> "
                          "'hello hostile')"))
    try:
        server = hostile()
        report = job_factory(["refused"], servers=[server.url])
        caplog.set_level(logging.WARNING, logger="synthq.serving.call")
        run_job(report.job_id)
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE samples DROP CONSTRAINT hostile_refuses"))
        engine.dispose()
    [smp] = samples(report.job_id)
    message = smp.error_message or ""
    assert (smp.state, smp.error_class) == ("failed", "unstorable"), message
    assert message.startswith("the result could not be stored: CheckViolation: "), message
    assert "hostile_refuses" in message
    for leak in ("UPDATE", "[SQL", "claim", "%(", "parameters", "\n"):
        assert leak not in message, (leak, message)
    assert len(message) < 400
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "UPDATE samples" in logged, logged


def test_a_bug_on_a_stored_response_fails_at_once(job_factory: Callable[..., Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample whose response is stored is claimed without charging an attempt (no call
    is made): a bug on that path would loop for ever. It fails as worker_error at once,
    its answer kept for `requeue` or `retokenize`."""
    from datetime import timedelta

    from sqlalchemy import update

    import synthq.serving.call
    from synthq.queue import states
    from synthq.serving.call import Outcome
    from synthq.serving.executor import process_sample
    from synthq.store.db import utcnow

    report = job_factory(["stored"])
    with session_scope() as s:
        smp_id = s.scalar(select(Sample.id).where(Sample.job_id == report.job_id))
        s.execute(update(Sample).where(Sample.id == smp_id)
                  .values(response_content="kept", finish_reason="stop"))
        now = utcnow()
        states.queue(s, [smp_id], server="http://127.0.0.1:9/v1", token="t1", now=now,
                     deadline=now + timedelta(seconds=30))

    def broken(c: Any) -> Any:
        raise RuntimeError("a bug on the stored path")

    monkeypatch.setattr(synthq.serving.call, "_stored", broken)
    assert process_sample(smp_id, "t1", job_id=report.job_id) is Outcome.FAILED
    [smp] = samples(report.job_id)
    assert (smp.state, smp.error_class, smp.response_content) == \
        ("failed", "worker_error", "kept")
    assert "a bug on the stored path" in (smp.error_message or "")

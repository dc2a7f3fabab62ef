"""Tokenization inside the queue, on real PostgreSQL with real tokenizers and the
simulator over HTTP: examples written with the done transition, stored responses
never regenerated, retokenize without server calls."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pytest
from sqlalchemy import select, update
from support import counts

from synthq.app.embedded import run_job
from synthq.core.packing import unpack_ids, unpack_mask
from synthq.data.tokenize import ChatTokenizer, TokenizeSettings
from synthq.queue.dispatch import Dispatched, dispatch
from synthq.serving.executor import process_sample
from synthq.store.db import session_scope
from synthq.store.models import Attempt, Job, Sample

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ct.qwen3(tmp_path_factory.mktemp("tok"))


def supervised(tok: ChatTokenizer, smp: Sample) -> str:
    ids = unpack_ids(smp.input_ids)
    assert ids is not None and smp.loss_mask is not None and smp.num_tokens == len(ids)
    mask = unpack_mask(smp.loss_mask, len(ids))
    return tok.tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)


def test_run_writes_examples_that_decode_to_the_answers(
        simulator: Callable[..., Any], job_factory: Callable[..., Any], qwen3_dir: str) -> None:
    sim = simulator("--latency", "0", "--reasoning")
    report = job_factory([f"question {i}: 你好 🎉" for i in range(20)], servers=[sim.url],
                         tokenizer=qwen3_dir, max_seq_len=4096)
    status = run_job(report.job_id)
    assert status.counts["done"] == 20 and status.num_supervised > 0
    tok = ChatTokenizer(TokenizeSettings(qwen3_dir))
    with session_scope() as s:
        for smp in s.scalars(select(Sample)):
            assert smp.reasoning_content and smp.tokenize_version == 1
            assert supervised(tok, smp) == (f"<think>\n{smp.reasoning_content}\n</think>\n\n"
                                            f"{smp.response_content}<|im_end|>")


def test_tokenization_failure_keeps_the_response_and_requeue_does_not_regenerate(
        simulator: Callable[..., Any], job_factory: Callable[..., Any], qwen3_dir: str) -> None:
    from synthq.queue import states
    from synthq.store.db import utcnow

    sim = simulator("--latency", "0")
    # max_seq_len 4: the prompt alone is longer, so nothing is left to supervise.
    report = job_factory(["a prompt that is long enough"], servers=[sim.url],
                         tokenizer=qwen3_dir, max_seq_len=4)
    run_job(report.job_id)
    with session_scope() as s:
        smp = s.scalars(select(Sample)).one()
        assert (smp.state, smp.error_class) == ("skipped", "no_supervised_tokens")
        assert smp.response_content  # the answer is kept
        s.execute(update(Job).values(max_seq_len=4096))
        s.execute(update(Sample).values(state="failed"))
    with session_scope() as s:
        assert states.requeue(s, report.job_id, now=utcnow()) == 1
    from synthq.queue import jobview

    jobview._jobs.clear()
    run_job(report.job_id)
    with session_scope() as s:
        smp = s.scalars(select(Sample)).one()
        assert smp.state == "done" and smp.num_supervised
        calls = s.scalars(select(Attempt.outcome)).all()
    assert calls == ["ok"]  # one generation, ever
    assert sim.stats()["prompts"]["a prompt that is long enough"] == 1


def test_stored_response_is_tokenized_without_a_call(
        sample_factory: Callable[..., int], job_factory: Callable[..., Any],
        qwen3_dir: str) -> None:
    """A worker died after storing the answer: the next claim tokenizes, never calls."""
    job_id = job_factory([], servers=["http://127.0.0.1:9/v1"], tokenizer=qwen3_dir).job_id
    sid = sample_factory("pending", job_id=job_id, response_content="stored answer",
                         finish_reason="stop")
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert process_sample(batch[0].sample_id, batch[0].token, job_id=job_id).value == "done"
    with session_scope() as s:
        smp = s.get_one(Sample, sid)
        assert smp.state == "done" and smp.attempts == 0  # attempts counts calls
        assert s.scalars(select(Attempt)).all() == []  # and no call was made
    tok = ChatTokenizer(TokenizeSettings(qwen3_dir))
    assert supervised(tok, smp) == "stored answer<|im_end|>"


def test_retokenize_in_process_changes_examples_without_calls(
        simulator: Callable[..., Any], job_factory: Callable[..., Any], qwen3_dir: str) -> None:
    from synthq.jobs import retokenize as rt

    sim = simulator("--latency", "0", "--response-tokens", "60")
    report = job_factory([f"q{i}" for i in range(12)], servers=[sim.url], tokenizer=qwen3_dir)
    run_job(report.job_id)
    requests = sim.stats()["requests"]
    with session_scope() as s:
        before = {smp.id: smp.num_tokens for smp in s.scalars(select(Sample))}
        version = rt.configure(s, s.get_one(Job, report.job_id), {"max_seq_len": 40})
    assert version == 2
    result = rt.run_in_process(report.job_id, batch_size=5)
    assert result.done == 12
    with session_scope() as s:
        for smp in s.scalars(select(Sample)):
            assert smp.tokenize_version == 2 and smp.num_tokens == min(40, before[smp.id])
    assert sim.stats()["requests"] == requests  # zero calls to the server


def test_retokenize_rejects_a_broken_tokenizer(job_factory: Callable[..., Any],
                                               qwen3_dir: str, tmp_path: Path) -> None:
    from synthq.core.errors import UserError
    from synthq.jobs import retokenize as rt

    report = job_factory(["x"], tokenizer=qwen3_dir)
    with session_scope() as s, pytest.raises(UserError, match="cannot load tokenizer"):
        rt.configure(s, s.get_one(Job, report.job_id), {"tokenizer": str(tmp_path / "none")})
    with session_scope() as s:
        assert s.get_one(Job, report.job_id).tokenize_version == 1


def test_server_token_ids_are_compared(simulator: Callable[..., Any],
                                       job_factory: Callable[..., Any], qwen3_dir: str) -> None:
    """With return_token_ids the server's completion ids are compared with ours."""
    sim = simulator("--latency", "0")
    report = job_factory(["compare ids"], servers=[sim.url], tokenizer=qwen3_dir,
                         extra_body={"return_token_ids": True})
    run_job(report.job_id)
    with session_scope() as s:
        smp = s.scalars(select(Sample)).one()
    assert smp.state == "done"
    server_ids = unpack_ids(smp.completion_token_ids)
    assert server_ids is not None and len(server_ids) == smp.completion_tokens
    # The simulator's ids are not a real model's: a mismatch, counted, not fatal.
    assert smp.token_mismatch is True
    with session_scope() as s:
        from synthq.views.report import job_status

        assert job_status(s, s.get_one(Job, report.job_id)).token_mismatches == 1
    assert counts(report.job_id)["done"] == 1


def test_a_tokenizer_crash_fails_the_sample_once_and_keeps_the_response(
        simulator: Callable[..., Any], job_factory: Callable[..., Any], qwen3_dir: str) -> None:
    """An unexpected exception while tokenizing must not strand or loop the sample."""
    sim = simulator("--latency", "0")
    report = job_factory(["crash me"], servers=[sim.url], tokenizer=qwen3_dir)

    def boom(self, messages):  # type: ignore[no-untyped-def]
        raise RuntimeError("tokenizer exploded")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChatTokenizer, "tokenize", boom)
        run_job(report.job_id)
    with session_scope() as s:
        smp = s.scalars(select(Sample)).one()
    assert (smp.state, smp.error_class) == ("failed", "invalid_input")
    assert "tokenizer exploded" in (smp.error_message or "")
    assert smp.response_content and sim.stats()["requests"] == 1
    # Fixed (here: the patch undone), retokenize repairs it without a call.
    from synthq.jobs import retokenize as rt

    with session_scope() as s:
        rt.configure(s, s.get_one(Job, report.job_id), {})
    assert rt.run_in_process(report.job_id).done == 1
    assert sim.stats()["requests"] == 1


def test_every_turn_job_tokenizes_the_regenerated_conversation_with_its_tools(
        simulator: Callable[..., Any], job_factory: Callable[..., Any],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    from synthq.data.dataset import Row
    from synthq.queue import states
    from synthq.store.db import utcnow

    tools_dir = ct.chatml_tools(tmp_path_factory.mktemp("tools"))
    sim = simulator("--latency", "0", "--record-requests")
    tools = {"tools": [{"type": "function", "function": {"name": "get_weather",
                                                         "parameters": {"type": "object"}}}]}
    call = {"id": "d1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    weather = [{"role": "user", "content": "Weather in Oslo? [[sim-call:get_weather]]"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "d1", "content": "sunny"},
               {"role": "assistant", "content": "Sunny."}]
    plain = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
             {"role": "user", "content": "second"}, {"role": "assistant", "content": "b"}]
    report = job_factory(rows=[Row(0, weather, tools=tools), Row(1, plain)],
                         servers=[sim.url], tokenizer=tools_dir, regenerate="all")
    status = run_job(report.job_id)
    assert status.counts["done"] == 2 and status.turns_done == status.turns_total == 4
    tok = ChatTokenizer(TokenizeSettings(tools_dir, mask="all_assistant_turns"))

    def rendered(answer: dict[str, Any]) -> str:
        calls = "".join('<tool_call>\n{"name": "' + c["function"]["name"] + '", "arguments": '
                        + c["function"]["arguments"] + "}\n</tool_call>"
                        for c in answer.get("tool_calls") or [])
        return (answer["content"] or "") + calls + "<|im_end|>"

    examples = {}
    with session_scope() as s:
        for smp in s.scalars(select(Sample).order_by(Sample.id)):
            assert len(smp.turns) == 2 and smp.cut_at_turn is None
            assert supervised(tok, smp) == "".join(rendered(a) for a in smp.turns)
            examples[smp.id] = smp.input_ids
        tool_sample = s.scalars(select(Sample).where(Sample.dataset_index == 0)).one()
        assert tool_sample.turns[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert json.loads(tool_sample.turns[0]["tool_calls"][0]["function"]["arguments"])["n"] == 0
        # A tokenization failure requeued: tokenized again from the stored turns, no call.
        s.execute(update(Sample).values(state="failed", error_class="mask_mismatch",
                                        input_ids=None, loss_mask=None))
    requests = len(sim.http.get("/sim/requests").json())
    assert requests == 4
    with session_scope() as s:
        assert states.requeue(s, report.job_id, now=utcnow()) == 2
    assert run_job(report.job_id).counts["done"] == 2
    assert len(sim.http.get("/sim/requests").json()) == requests
    with session_scope() as s:
        assert {smp.id: smp.input_ids for smp in s.scalars(select(Sample))} == examples

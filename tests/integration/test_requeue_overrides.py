"""`requeue` with settings of the requeued samples' own, and the truncated class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from synthq.app import service
from synthq.core.errors import UserError
from synthq.queue import states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration


def row(sample_id: int) -> Sample:
    with session_scope() as s:
        smp = s.get_one(Sample, sample_id)
        s.expunge(smp)
        return smp


def test_truncated_takes_kept_truncated_answers_and_overrides_merge(
        job_factory: Callable[..., Any], sample_factory: Callable[..., int]) -> None:
    job_id = job_factory([], keep_truncated=True).job_id
    kept = sample_factory("done", job_id=job_id, response_content="cut", finish_reason="length",
                          input_ids=b"\x01\x00\x00\x00", num_tokens=1, tool_calls=None)
    fine = sample_factory("done", job_id=job_id, response_content="whole",
                          finish_reason="stop")
    failed = sample_factory("failed", job_id=job_id, error_class="truncated",
                            overrides={"temperature": 0.2})
    other = sample_factory("failed", job_id=job_id, error_class="timeout")
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        n = service.requeue(s, job, classes=["truncated"], overrides={"max_tokens": 99,
                                                                      "top_p": None})
    assert n == 2
    assert (row(kept).state, row(kept).response_content, row(kept).input_ids,
            row(kept).finish_reason, row(kept).overrides) == ("pending", None, None, None,
                                                               {"max_tokens": 99})
    assert row(failed).state == "pending"
    assert row(failed).overrides == {"temperature": 0.2, "max_tokens": 99}
    assert (row(fine).state, row(fine).response_content, row(fine).overrides) == (
        "done", "whole", None)
    assert (row(other).state, row(other).overrides) == ("failed", None)


def test_a_kept_truncated_last_turn_is_generated_again(
        job_factory: Callable[..., Any], sample_factory: Callable[..., int]) -> None:
    job_id = job_factory([], keep_truncated=True, regenerate="all").job_id
    answers = [{"content": "one", "finish_reason": "stop"},
               {"content": "two", "finish_reason": "length"}]
    sid = sample_factory("done", job_id=job_id, response_content="two", finish_reason="length",
                         turns=answers, turn=2, turn_count=2)
    with session_scope() as s:
        states.requeue(s, job_id, classes=["truncated"], now=utcnow())
    smp = row(sid)
    assert (smp.state, smp.turn, smp.turns) == ("pending", 1, answers[:1])


@pytest.mark.parametrize(("overrides", "message"), [
    ({"max_tokens": 0}, "--max-tokens must be a positive integer"),
    ({"max_attempts": True}, "--max-attempts must be a positive integer"),
    ({"temperature": -1.0}, "--temperature is out of range"),
    ({"top_p": 1.5}, "--top-p is out of range"),
    ({"total_timeout": "x"}, "--timeout must be a number"),
    ({"stall_timeout": float("nan")}, "--stall-timeout must be a number"),
    ({"extra_body": ["x"]}, "--extra-body must be a JSON object"),
    ({"extra_body": {"max_tokens": 5}}, "--extra-body may not set ['max_tokens']"),
    ({"chat_template_kwargs": 3}, "--chat-template-kwargs must be a JSON object"),
    ({"seed": 3}, "unknown settings ['seed']"),
])
def test_bad_overrides_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as info:
        service.check_overrides(overrides)
    assert message in str(info.value)


#: A chat template that writes a template variable into the rendered text, so an
#: example shows which chat_template_kwargs rendered it.
PERSONA_TEMPLATE = (
    "{% if persona is defined %}{{ '<|im_start|>system\\n' + persona + '<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_retokenize_keeps_a_samples_own_chat_template_kwargs(
        job_factory: Callable[..., Any], sample_factory: Callable[..., int],
        tmp_path: Path) -> None:
    """A sample requeued with --chat-template-kwargs was generated with them; a later
    retokenize renders its example with them too (as the worker did), not the job's."""
    import chat_tokenizers as ct
    from transformers import AutoTokenizer

    from synthq.core.packing import unpack_ids
    from synthq.jobs.retokenize import retokenize_batch

    path = ct._chatml(tmp_path, "persona", PERSONA_TEMPLATE)
    job_id = job_factory([], tokenizer=path, chat_template_kwargs={"persona": "JOBWIDE"}).job_id
    own = sample_factory("done", job_id=job_id, response_content="4",
                         overrides={"chat_template_kwargs": {"persona": "OWNPERSONA"}})
    plain = sample_factory("done", job_id=job_id, response_content="5")
    assert retokenize_batch(job_id, [own, plain]).done == 2
    tok = AutoTokenizer.from_pretrained(path)
    texts = {sid: tok.decode(unpack_ids(row(sid).input_ids).tolist()) for sid in (own, plain)}
    assert "OWNPERSONA" in texts[own] and "JOBWIDE" not in texts[own], texts
    assert "JOBWIDE" in texts[plain], texts

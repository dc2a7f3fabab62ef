"""The example's columns of one response: ``input_ids``, ``loss_mask`` and their counts.

The worker tokenizes an answer as it stores it (:mod:`synthq.process`), and
``synthq retokenize`` recomputes stored answers with a job's new tokenizer
settings (:mod:`synthq.retokenize`): both through :func:`tokenize_sample`.
"""

from __future__ import annotations

from typing import Any

from synthq import turns
from synthq.models import Job
from synthq.packing import pack_ids, pack_mask
from synthq.tokenize import TokenizeSettings, get_chat_tokenizer

__all__ = ["tokenize_sample"]


def tokenize_sample(job: Job, prompt: list[dict[str, Any]], content: str,
                      reasoning: str | None, server_ids: list[int] | None, *,
                      tool_calls: list[dict[str, Any]] | None = None,
                      tools: dict[str, Any] | None = None,
                      answers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The example's columns for one response; raises a tokenization error class.

    ``answers``: the sample was regenerated turn by turn; ``prompt`` is the dataset's
    whole conversation and the example is the regenerated one (synthq.turns).
    """
    settings = TokenizeSettings.from_job(job)
    assert settings is not None
    tok = get_chat_tokenizer(settings)
    if answers is not None:
        messages = [tok.place_reasoning(m) for m in turns.regenerated(prompt, answers)]
    else:
        messages = tok.conversation(prompt, content, reasoning, tool_calls)
    definitions = (tools or {}).get("tools")
    result = tok.tokenize(messages, tools=definitions) if definitions else tok.tokenize(messages)
    mismatch = None
    if server_ids is not None:
        mismatch = list(server_ids) != result.completion_ids
    return dict(input_ids=pack_ids(result.input_ids), loss_mask=pack_mask(result.loss_mask),
                num_tokens=len(result.input_ids), num_supervised=result.num_supervised,
                tokenize_version=job.tokenize_version, token_mismatch=mismatch)

"""Loss masks of conversations regenerated turn by turn, and of answers that call tools,
on real tokenizers (tests/chat_tokenizers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import chat_tokenizers as ct
import pytest

from synthq.core.packing import unpack_ids, unpack_mask
from synthq.data.examples import tokenize_sample
from synthq.data.tokenize import TokenizeSettings, get_chat_tokenizer


def job(tokenizer: str, **settings: Any) -> Any:
    """The job columns tokenization reads."""
    values = dict(tokenizer=tokenizer, chat_template=None, chat_template_kwargs={},
                  max_seq_len=4096, reasoning="keep", think_open="<think>\n",
                  think_close="\n</think>\n\n", mask="all_assistant_turns", tokenize_version=1)
    return SimpleNamespace(**{**values, **settings})


def supervised(tokenizer: str, example: dict[str, Any]) -> tuple[str, str]:
    """(supervised text, unsupervised text) of an example's columns."""
    tok = get_chat_tokenizer(TokenizeSettings(tokenizer))
    ids = unpack_ids(example["input_ids"])
    assert ids is not None
    mask = unpack_mask(example["loss_mask"], len(ids))

    def text(keep: int) -> str:
        return str(tok.tok.decode(ids[mask == keep].tolist(), skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False))

    return text(1), text(0)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def llama(root: Path) -> str:
    return ct.llama3(root)


@pytest.fixture(scope="module")
def tools_tok(root: Path) -> str:
    return ct.chatml_tools(root)


CONVERSATION = [{"role": "system", "content": "You are terse."}]
for _t in range(3):
    CONVERSATION += [{"role": "user", "content": f"Question number {_t}?"},
                     {"role": "assistant", "content": f"Dataset answer {_t}."}]
ANSWERS = [{"content": f"Regenerated answer {t}.", "finish_reason": "stop"} for t in range(3)]


def test_three_turns_supervise_exactly_the_three_regenerated_answers(llama: str) -> None:
    example = tokenize_sample(job(llama), CONVERSATION, "", None, None, answers=ANSWERS)
    on, off = supervised(llama, example)
    assert on == "".join(f"Regenerated answer {t}.<|eot_id|>" for t in range(3))
    assert "Dataset answer" not in on + off  # the dataset's answers are not in the example
    assert all(f"Question number {t}?" in off for t in range(3))
    # last_turn on the same job supervises only the third.
    last = tokenize_sample(job(llama, mask="last_turn"), CONVERSATION, "", None, None,
                             answers=ANSWERS)
    assert supervised(llama, last)[0] == "Regenerated answer 2.<|eot_id|>"


def test_a_cut_conversation_supervises_the_turns_it_kept(llama: str) -> None:
    example = tokenize_sample(job(llama), CONVERSATION, "", None, None, answers=ANSWERS[:2])
    on, off = supervised(llama, example)
    assert on == "Regenerated answer 0.<|eot_id|>Regenerated answer 1.<|eot_id|>"
    assert "Question number 2?" not in off


TOOLS = {"tools": [{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": {"type": "object"}}}]}
CALL = [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]


def test_generated_tool_call_tokens_are_supervised(tools_tok: str) -> None:
    prompt = [{"role": "user", "content": "Weather in Oslo?"}]
    example = tokenize_sample(job(tools_tok, mask="last_turn"), prompt, "", None, None,
                                tool_calls=CALL, tools=TOOLS)
    on, off = supervised(tools_tok, example)
    assert on == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                  '</tool_call><|im_end|>')
    # The definitions went to the template's tools= argument: rendered, not supervised.
    assert '"name": "get_weather"' in off and "# Tools" in off


def test_tool_results_and_the_answer_after_them(tools_tok: str) -> None:
    conversation = [{"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": "", "tool_calls": CALL},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                    {"role": "assistant", "content": "Sunny."}]
    answers = [{"content": "", "tool_calls": CALL}, {"content": "It is sunny and 21 C."}]
    example = tokenize_sample(job(tools_tok), conversation, "", None, None, tools=TOOLS,
                                answers=answers)
    on, off = supervised(tools_tok, example)
    assert on == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                  '</tool_call><|im_end|>It is sunny and 21 C.<|im_end|>')
    assert "sunny, 21 C" in off

"""Training examples (synthq.data.examples) on real tokenizers: one per regenerated turn where
the template rewrites history, cut turns without an end marker, the choice at enqueue."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import chat_tokenizers as ct
import numpy as np
import pytest

from synthq.core.errors import UserError
from synthq.core.packing import unpack_ids, unpack_mask
from synthq.data.examples import build, choose, split, tokenize_sample
from synthq.data.tokenize import TokenizeSettings, get_chat_tokenizer


def job(tokenizer: str, **settings: Any) -> Any:
    """The job columns building and tokenizing examples read."""
    values = dict(tokenizer=tokenizer, chat_template=None, chat_template_kwargs={},
                  max_seq_len=4096, reasoning="keep", think_open="<think>\n",
                  think_close="\n</think>\n\n", mask="all_assistant_turns", tokenize_version=1,
                  examples="per-turn", history_reasoning="drop", regenerate="all")
    return SimpleNamespace(**{**values, **settings})


def pieces(tokenizer: str, columns: dict[str, Any]) -> list[tuple[str, str]]:
    """(supervised text, whole text) of each example in a sample's columns."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = unpack_ids(columns["input_ids"])
    assert ids is not None
    mask = unpack_mask(columns["loss_mask"], len(ids))

    def text(x: np.ndarray) -> str:
        return str(tok.decode(x.tolist(), skip_special_tokens=False,
                              clean_up_tokenization_spaces=False))

    return [(text(i[m == 1]), text(i)) for i, m in split(ids, mask, columns["examples"])]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ct.qwen3(tmp_path_factory.mktemp("tok"))


CONVERSATION: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
for _t in range(3):
    CONVERSATION += [{"role": "user", "content": f"Question {_t}?"},
                     {"role": "assistant", "content": f"Dataset answer {_t}."}]
ANSWERS = [{"content": f"Answer {t}.", "reasoning_content": f"Thinking about {t} here.",
            "finish_reason": "stop"} for t in range(3)]


def test_a_history_rewriting_template_gets_per_turn_examples_each_turn_reasoning_supervised(
        qwen: str) -> None:
    tok = get_chat_tokenizer(TokenizeSettings(qwen, mask="all_assistant_turns"))
    assert tok.multi_turn_unstable() is not None  # Qwen3 drops earlier turns' reasoning
    mode, note = choose(None, regenerate="all", mask="all_assistant_turns", tokenizer=tok)
    assert mode == "per-turn" and note and "\n" not in note
    with pytest.raises(UserError, match="boundary_unstable"):
        choose("conversation", regenerate="all", mask="all_assistant_turns", tokenizer=tok)
    assert choose(None, regenerate="all", mask="last_turn", tokenizer=tok)[0] == "conversation"
    assert choose(None, regenerate="last", mask="last_turn", tokenizer=tok)[0] == "conversation"
    with pytest.raises(UserError, match="needs --regenerate all"):
        choose("per-turn", regenerate="last", mask="last_turn", tokenizer=tok)

    columns = tokenize_sample(job(qwen), CONVERSATION, "", None, None, answers=ANSWERS)
    assert [e["turn"] for e in columns["examples"]] == [0, 1, 2]
    assert columns["num_tokens"] == sum(e["tokens"] for e in columns["examples"])
    for k, (supervised, whole) in enumerate(pieces(qwen, columns)):
        # Exactly turn k's answer with its own reasoning, and its end marker.
        assert supervised == f"<think>\nThinking about {k} here.\n</think>\n\nAnswer {k}.<|im_end|>"
        # The history as sent: earlier regenerated answers, without their reasoning.
        assert all(f"Answer {j}." in whole for j in range(k))
        assert not any(f"Thinking about {j}" in whole for j in range(k))
        assert "Dataset answer" not in whole and f"Question {k + 1}?" not in whole


def test_the_stable_template_keeps_one_conversation_example(tmp_path: Path) -> None:
    llama = ct.llama3(tmp_path)
    tok = get_chat_tokenizer(TokenizeSettings(llama, reasoning="drop",
                                              mask="all_assistant_turns"))
    assert tok.multi_turn_unstable() is None
    assert choose(None, regenerate="all", mask="all_assistant_turns", tokenizer=tok) == (
        "conversation", None)
    columns = tokenize_sample(job(llama, reasoning="drop", examples="conversation"),
                              CONVERSATION, "", None, None, answers=ANSWERS)
    assert columns["examples"] is None
    [(supervised, _)] = pieces(llama, columns)
    assert supervised == "".join(f"Answer {t}.<|eot_id|>" for t in range(3))


def test_a_cut_turn_is_supervised_without_the_end_marker(qwen: str) -> None:
    cut = [ANSWERS[0], {**ANSWERS[1], "content": "Answer 1 cut", "finish_reason": "length"},
           ANSWERS[2]]
    columns = tokenize_sample(job(qwen), CONVERSATION, "", None, None, answers=cut)
    texts = [s for s, _ in pieces(qwen, columns)]
    assert texts[1] == "<think>\nThinking about 1 here.\n</think>\n\nAnswer 1 cut"
    assert texts[0].endswith("<|im_end|>") and texts[2].endswith("<|im_end|>")


def test_deepseek_truncated_answer_has_no_supervised_end_of_sentence() -> None:
    deepseek = ct.deepseek_v3()
    prompt = [{"role": "user", "content": "Count to ten."}]
    done = tokenize_sample(job(deepseek, reasoning="drop", regenerate="last"), prompt,
                           "one two three", None, None, finish_reason="stop")
    cut = tokenize_sample(job(deepseek, reasoning="drop", regenerate="last"), prompt,
                          "one two three", None, None, finish_reason="length")
    [(whole_answer, _)], [(cut_answer, _)] = pieces(deepseek, done), pieces(deepseek, cut)
    assert whole_answer == "one two three<｜end▁of▁sentence｜>"
    assert cut_answer == "one two three"


def test_built_examples_carry_finish_reasons_and_the_history_as_sent() -> None:
    keep = build(CONVERSATION, answers=ANSWERS, per_turn=True, history_reasoning="keep")
    drop = build(CONVERSATION, answers=ANSWERS[:2], per_turn=True)
    assert [e.turn for e in keep] == [0, 1, 2] and len(drop) == 2
    assert keep[2].messages[2].get("reasoning_content") == "Thinking about 0 here."
    assert "reasoning_content" not in drop[1].messages[2]
    assert keep[2].supervised == (len(keep[2].messages) - 1,)
    assert set(keep[2].generated) == {2, 4, 6}
    whole = build(CONVERSATION, answers=ANSWERS)
    assert len(whole) == 1 and whole[0].supervised is None and whole[0].turn is None
    single = build(CONVERSATION[:2], content="A", finish_reason="length")
    assert single[0].cut == (2,) and single[0].finish_reason == "length"

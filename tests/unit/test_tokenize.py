"""Loss masks on real tokenizers and real chat templates.

The invariant under test: the supervised tokens are exactly the tokens the
model generated for its assistant turn(s) — reasoning when kept, the answer,
its end-of-turn marker — and nothing of the headers or other roles.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import chat_tokenizers as ct
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from synthq.core import errors
from synthq.data.tokenize import ChatTokenizer, TokenizerSetupError, TokenizeSettings

# The module on one process (scripts/test.sh's xdist): its six tokenizers (DeepSeek-V3's
# and Llama-3's vocabularies among them: 15 s of CPU) load once instead of on each.
pytestmark = pytest.mark.xdist_group("unit-tokenize")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def tokenizers(root: Path) -> dict[str, ChatTokenizer]:
    qwen = ct.qwen3(root)
    return {
        "deepseek-v3": ChatTokenizer(TokenizeSettings(ct.deepseek_v3(), reasoning="drop")),
        "llama3": ChatTokenizer(TokenizeSettings(ct.llama3(root))),
        "qwen3": ChatTokenizer(TokenizeSettings(qwen)),
        "qwen3-drop": ChatTokenizer(TokenizeSettings(qwen, reasoning="drop")),
        "qwen3-nothink": ChatTokenizer(TokenizeSettings(
            qwen, reasoning="drop", chat_template_kwargs='{"enable_thinking": false}')),
        "generation": ChatTokenizer(TokenizeSettings(ct.generation_blocks(root))),
    }


def own_copy(base: ChatTokenizer) -> ChatTokenizer:
    """A ChatTokenizer whose attributes a test may replace without touching the module's,
    sharing its loaded tokenizer (loading it again took 5-10 s a test)."""
    return copy.copy(base)


END = {"deepseek-v3": "<｜end▁of▁sentence｜>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>",
       "qwen3-drop": "<|im_end|>", "qwen3-nothink": "<|im_end|>", "generation": "<|im_end|>"}


def supervised_text(tok: ChatTokenizer, result) -> str:  # type: ignore[no-untyped-def]
    return tok.tok.decode(result.input_ids[result.loss_mask == 1].tolist(),
                          skip_special_tokens=False, clean_up_tokenization_spaces=False)


PROMPTS = {
    "single turn": [{"role": "user", "content": "What is 2 + 2?"}],
    "system and multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
    ],
    "unicode": [{"role": "user", "content": "翻译成中文: good morning 🌅 — ça va? Ñandú"}],
    "template text in the prompt": [
        {"role": "user", "content": "Explain <|im_end|> and <|eot_id|> and <｜Assistant｜>."}],
}


@pytest.mark.parametrize("name", list(END))
@pytest.mark.parametrize("case", list(PROMPTS))
def test_mask_is_exactly_the_answer(tokenizers: dict[str, ChatTokenizer], name: str,
                                    case: str) -> None:
    tok = tokenizers[name]
    answer = "Four. 四 ✅ — done"
    result = tok.tokenize(tok.conversation(PROMPTS[case], answer, None))
    assert supervised_text(tok, result) == answer + END[name]
    # The mask is one contiguous run ending at the end-of-turn marker, and the
    # marker's token is supervised (a shifted mask would miss it).
    on = np.flatnonzero(result.loss_mask)
    assert np.array_equal(on, np.arange(on[0], on[-1] + 1))
    assert tok.tok.decode([int(result.input_ids[on[-1]])]) == END[name]
    assert result.input_ids.dtype == np.int32 and len(result.input_ids) == len(result.loss_mask)


def test_reasoning_kept_through_the_templates_own_field(
        tokenizers: dict[str, ChatTokenizer]) -> None:
    tok = tokenizers["qwen3"]
    assert tok.reasoning_field
    result = tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", "2 plus 2 is 4"))
    assert supervised_text(tok, result) == "<think>\n2 plus 2 is 4\n</think>\n\n4<|im_end|>"


def test_reasoning_kept_with_markers_where_the_template_has_no_field(
        tokenizers: dict[str, ChatTokenizer]) -> None:
    tok = tokenizers["llama3"]
    assert not tok.reasoning_field
    result = tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", "2 plus 2 is 4"))
    assert supervised_text(tok, result) == "<think>\n2 plus 2 is 4\n</think>\n\n4<|eot_id|>"


def test_reasoning_dropped_and_no_empty_think_supervised(
        tokenizers: dict[str, ChatTokenizer]) -> None:
    # Qwen3's template writes "<think>\n\n</think>\n\n" before a last answer without
    # reasoning; the model did not generate it, so it must not be supervised.
    tok = tokenizers["qwen3-drop"]
    result = tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", "secret reasoning"))
    text = supervised_text(tok, result)
    assert text == "4<|im_end|>"
    full = tok.tok.decode(result.input_ids.tolist())
    assert "secret reasoning" not in full
    # With enable_thinking=false the block is part of the generation prompt.
    tok = tokenizers["qwen3-nothink"]
    result = tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", None))
    assert supervised_text(tok, result) == "4<|im_end|>"


def test_deepseek_template_that_drops_reasoning_refuses_keep() -> None:
    with pytest.raises(TokenizerSetupError, match="drops reasoning"):
        ChatTokenizer(TokenizeSettings(ct.deepseek_v3(), reasoning="keep"))


def test_all_assistant_turns(tokenizers: dict[str, ChatTokenizer], root: Path) -> None:
    tok = ChatTokenizer(TokenizeSettings(ct.llama3(root), mask="all_assistant_turns"))
    result = tok.tokenize(tok.conversation(PROMPTS["system and multi-turn"], "Eleven.", None))
    assert supervised_text(tok, result) == "Seven.<|eot_id|>Eleven.<|eot_id|>"


def test_template_rewriting_history_is_boundary_unstable(root: Path) -> None:
    """Qwen3 drops the reasoning of earlier turns once a later user turn follows."""
    tok = ChatTokenizer(TokenizeSettings(ct.qwen3(root), mask="all_assistant_turns"))
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": "think b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(errors.BoundaryUnstable):
        tok.tokenize(messages)


def test_unstable_template_is_refused(root: Path) -> None:
    # A template whose generation prompt is not how it renders an assistant turn.
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}[assistant]\n{% endif %}")
    tok = ChatTokenizer(TokenizeSettings(ct.qwen3(root), chat_template=template,
                                         reasoning="drop"))
    with pytest.raises(errors.BoundaryUnstable, match="does not extend"):
        tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", None))


def test_generation_blocks_cross_check(tokenizers: dict[str, ChatTokenizer],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tokenizers["generation"]
    assert tok.has_generation_blocks
    messages = tok.conversation(PROMPTS["system and multi-turn"], "Eleven.", None)
    tok.tokenize(messages)  # agrees
    # A mask that disagrees with the template's blocks (an end marker dropped) is caught.
    original = tok._span

    def short_span(*args, **kwargs):  # type: ignore[no-untyped-def]
        a, b = original(*args, **kwargs)
        return a, b - len("<|im_end|>")

    monkeypatch.setattr(tok, "_span", short_span)
    with pytest.raises(errors.MaskMismatch, match="generation blocks"):
        tok.tokenize(messages)


def test_truncation_at_and_around_every_boundary(tokenizers: dict[str, ChatTokenizer]) -> None:
    base = tokenizers["qwen3"]
    messages = base.conversation(PROMPTS["system and multi-turn"], "Eleven, then 13.", "primes")
    full = base.tokenize(messages)
    n = len(full.input_ids)
    first = int(np.flatnonzero(full.loss_mask)[0])
    tok = own_copy(base)
    for limit in range(2, n + 3):
        tok.settings = replace(base.settings, max_seq_len=limit)
        if limit <= first:
            with pytest.raises(errors.NoSupervisedTokens):
                tok.tokenize(messages)
            continue
        result = tok.tokenize(messages)
        assert len(result.input_ids) == min(limit, n)
        assert result.truncated == (limit < n)
        assert np.array_equal(result.input_ids, full.input_ids[:limit])
        assert np.array_equal(result.loss_mask, full.loss_mask[:limit])
        # What is supervised is a prefix of the answer's text.
        full_text = supervised_text(base, full)
        assert full_text.startswith(supervised_text(tok, result))


def test_empty_answer_supervises_only_the_end_marker(tokenizers: dict[str, ChatTokenizer]) -> None:
    tok = tokenizers["llama3"]
    result = tok.tokenize(tok.conversation(PROMPTS["single turn"], "", None))
    assert supervised_text(tok, result) == "<|eot_id|>"


def test_bad_tokenizer_is_a_setup_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerSetupError, match="cannot load tokenizer"):
        ChatTokenizer(TokenizeSettings(str(tmp_path / "nope")))
    with pytest.raises(TokenizerSetupError, match="--mask"):
        ChatTokenizer(TokenizeSettings(ct.deepseek_v3(), mask="everything"))


#: Property-test outcomes: refusals are allowed, but most examples must be checked.
REFUSED: list[str] = []
ACCEPTED: list[int] = []

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               min_size=1, max_size=60).filter(lambda s: s.strip())


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(text, text), min_size=1, max_size=3), system=st.none() | text,
       answer=text, name=st.sampled_from(["llama3", "qwen3-drop", "deepseek-v3", "generation"]))
@example(turns=[("hi", "x")], system=None, answer="\r0\r", name="qwen3-drop")
def _masked_tokens_decode_to_the_answer(tokenizers: dict[str, ChatTokenizer],
                                        turns, system, answer, name) -> None:  # type: ignore[no-untyped-def]
    tok = tokenizers[name]
    prompt = [{"role": "system", "content": system}] if system else []
    for i, (user, assistant) in enumerate(turns):
        prompt.append({"role": "user", "content": user})
        if i < len(turns) - 1:
            prompt.append({"role": "assistant", "content": assistant})
    try:
        result = tok.tokenize(tok.conversation(prompt, answer, None))
    except (errors.MaskMismatch, errors.BoundaryUnstable) as exc:
        REFUSED.append(repr(exc))
        return
    ACCEPTED.append(1)
    rendered = tok.render(tok.conversation(prompt, answer, None), generation_prompt=False)
    got = supervised_text(tok, result)
    assert got.endswith(END[name])
    body = got[: -len(END[name])]
    # The template may trim the answer (Llama-3 does); the text is the rendered answer.
    # After an empty think block the template injects (Qwen3 with reasoning dropped),
    # the answer's leading whitespace goes with the block, unsupervised ('\r0\r').
    assert body in (answer, answer.strip(), answer.lstrip())
    assert rendered.count(got) >= 1


def test_property_masked_tokens_decode_to_the_answer(
        tokenizers: dict[str, ChatTokenizer]) -> None:
    """The property above over Hypothesis's examples, then: refusals stay rare (a refusal
    is safe, not a pass), so the property was not vacuous. One test, so the examples run
    once, in one process (it was two tests, and the second ran the property again
    wherever xdist put it without the first)."""
    REFUSED.clear()
    ACCEPTED.clear()
    _masked_tokens_decode_to_the_answer(tokenizers)
    assert ACCEPTED or REFUSED
    assert len(ACCEPTED) >= 4 * len(REFUSED), REFUSED[:5]


def test_a_token_across_the_turn_boundary_fails_the_self_check(root: Path) -> None:
    """A template that glues the answer to the word ``assistant``: BPE merges
    ``assistant`` + ``s`` into tokens that cross the boundary, so the supervised
    tokens decode to less than the answer. The decode self-check refuses the
    sample rather than store a mask that starts mid-answer ("ship" does not merge)."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{{ m['content'] }}<|im_end|>"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    tok = ChatTokenizer(TokenizeSettings(ct.qwen3(root), chat_template=template,
                                         reasoning="drop"))
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(errors.MaskMismatch, match=re.escape(
            "decode to ' are good<|im_end|>'… but the assistant text is 's are good<|im_end|>'")):
        tok.tokenize(tok.conversation(user, "s are good", None))
    assert tok.tokenize(tok.conversation(user, "ship", None)).num_supervised == 2


def test_template_that_refuses_a_conversation_is_invalid_input(root: Path) -> None:
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('no system prompts here') }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = ChatTokenizer(TokenizeSettings(ct.qwen3(root), chat_template=template,
                                         reasoning="drop"))
    with pytest.raises(errors.InvalidInput, match="no system prompts here"):
        tok.tokenize(tok.conversation(PROMPTS["system and multi-turn"], "4", None))
    # Without a system prompt the same template works.
    assert tok.tokenize(tok.conversation(PROMPTS["single turn"], "4", None)).num_supervised


@pytest.mark.parametrize("name", ["deepseek-v3", "llama3", "qwen3", "generation"])
def test_byte_level_path_gives_the_general_paths_results(tokenizers: dict[str, ChatTokenizer],
                                                         name: str) -> None:
    """The byte-level path (:meth:`ChatTokenizer._mask_byte_level`) is taken for these
    tokenizers and gives the general path's ids, mask, completion ids and refusals,
    at every max_seq_len (including refusals with the same message)."""
    base = tokenizers[name]
    assert base._fast is not None
    tok = own_copy(base)
    answers = ["Eleven, then 13.", " 🎉👩‍💻 日本語\n\n```py\nx = 1\n```  ", "", "\r0\r",
               "a<|im_end|>b"]
    for answer in answers:
        messages = tok.conversation(PROMPTS["system and multi-turn"], answer, None)
        full = tok.render(messages, generation_prompt=False)
        try:
            spans = [tok._span(messages, len(messages) - 1, full)]
        except errors.BoundaryUnstable:
            continue
        n = len(tok.tok(full, add_special_tokens=False)["input_ids"])
        for limit in range(2, n + 2):
            tok.settings = replace(base.settings, max_seq_len=limit)
            outs = []
            for path in (tok._mask_byte_level, tok._mask_offsets):
                try:
                    ids, mask, completion, truncated = path(full, spans)
                    outs.append((ids.tolist(), mask.tolist(), list(completion), truncated))
                except errors.MaskMismatch as exc:
                    outs.append(("refused", str(exc)))
            assert outs[0] == outs[1], (answer, limit)


class _ShiftedEncoding:
    """An encoding whose char_to_token is off by ``by`` tokens: an offset bug."""

    def __init__(self, enc, by: int) -> None:  # type: ignore[no-untyped-def]
        self._enc, self._by = enc, by

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._enc, name)

    def char_to_token(self, pos: int) -> int:
        return self._enc.char_to_token(pos) + self._by


class _ShiftedBackend:
    def __init__(self, backend, by: int) -> None:  # type: ignore[no-untyped-def]
        self._backend, self._by = backend, by

    def encode(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
        return _ShiftedEncoding(self._backend.encode(text, **kwargs), self._by)


@pytest.mark.parametrize("by", [-1, 1])
def test_byte_level_self_check_fails_on_a_wrong_mask(tokenizers: dict[str, ChatTokenizer],
                                                     by: int) -> None:
    """Break on purpose: the supervised run one token early or late, or the span one
    character off, must fail the self-check (MaskMismatch), never pass silently."""
    base = tokenizers["qwen3-drop"]
    messages = base.conversation(PROMPTS["single turn"], "Four, 🎉 日本.", None)
    assert base.tokenize(messages).num_supervised
    tok = own_copy(base)
    backend, table = tok._fast  # type: ignore[misc]
    # One token late (one early is walked forward to the right token: no harm done).
    tok._fast = (_ShiftedBackend(backend, 1), table)
    with pytest.raises(errors.MaskMismatch, match="supervised tokens decode to"):
        tok.tokenize(messages)

    tok = own_copy(base)
    span = tok._span
    tok._span = lambda *a, **k: (lambda s: (s[0] + (by > 0), s[1] - (by < 0)))(span(*a, **k))  # type: ignore[method-assign]
    with pytest.raises(errors.MaskMismatch, match="supervised tokens decode to"):
        tok.tokenize(messages)


def test_byte_level_self_check_does_not_trust_a_wrong_byte_table(
        tokenizers: dict[str, ChatTokenizer]) -> None:
    """A token whose bytes in the table are wrong cannot make a wrong mask pass: a
    byte difference goes to the library's decode, which decides as before."""
    base = tokenizers["llama3"]
    messages = base.conversation(PROMPTS["single turn"], "Four.", None)
    good = base.tokenize(messages)
    tok = own_copy(base)
    backend, table = tok._fast  # type: ignore[misc]
    table = list(table)
    for i in good.completion_ids:
        table[i] = b"?"
    tok._fast = (backend, table)
    again = tok.tokenize(messages)
    assert np.array_equal(again.loss_mask, good.loss_mask)

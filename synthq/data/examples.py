"""A sample's training examples: the conversation that is exported and the one that is
tokenized, built in one place.

A done sample holds the dataset's conversation (``samples.prompt``) and what the
target generated: one answer (``--regenerate last``), or one per turn
(``--regenerate all``, :mod:`synthq.data.turns`). :func:`build` makes its
:class:`Example` list; the worker and ``synthq retokenize`` tokenize those
(:func:`tokenize_sample`), the export writes them (:func:`exported`), so the
``conversations`` column and the ``input_ids`` beside it come from the same
messages.

``--examples`` (``jobs.examples``) says how many examples a regenerated
conversation makes:

* ``conversation``: one, the whole regenerated conversation, masked per
  ``--mask``. A template that rewrites history (Qwen3's drops earlier turns'
  reasoning) cannot mask several turns of it: see
  :meth:`synthq.data.tokenize.ChatTokenizer.multi_turn_unstable`.
* ``per-turn``: one per regenerated turn, each the history exactly as it was
  sent for that turn (``--history-reasoning``) plus that turn's answer with
  its reasoning, which alone is supervised: what the target saw and wrote at
  serving time, whatever the template does to history.

Storage: the sample stays the unit of dispatch and holds one result. With
several examples their ``input_ids`` and ``loss_mask`` are concatenated in
example order in ``samples.input_ids`` / ``samples.loss_mask``, and
``samples.examples`` lists them: ``[{"turn": k, "tokens": n, "supervised": s},
...]`` (None: one example, the whole row). Each example is a complete prompt of
its own (it starts where its own rendering starts, BOS included), so a reader
splits the ids at the cumulative ``tokens`` and uses each piece alone.

A turn cut at ``max_tokens`` (kept with ``--keep-truncated``) is supervised
without the end-of-turn marker the template closes it with: the target never
wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from synthq.core import errors
from synthq.core.enums import SampleState
from synthq.data import turns

__all__ = ["EXAMPLE_MODES", "Example", "choose", "build", "exported", "tokenize_sample",
           "tokenization_failure", "split", "engine_example"]

#: ``--examples``: one example per conversation, or one per regenerated turn.
EXAMPLE_MODES = ("conversation", "per-turn")


@dataclass(frozen=True, slots=True)
class Example:
    """One training example of a sample, before tokenization."""

    #: OpenAI messages; the generated answers carry their ``reasoning_content``.
    messages: list[dict[str, Any]]
    #: Index of each message the target generated → its ``finish_reason``.
    generated: dict[int, str | None]
    #: Generated answers whose reasoning is placed per the job's ``--reasoning``
    #: (rendered the target's way, or dropped); the other messages are rendered as
    #: they are (the history as sent).
    placed: tuple[int, ...]
    #: Messages to supervise; None: the job's ``--mask`` decides.
    supervised: tuple[int, ...] | None = None
    #: The regenerated turn this example is (0-based, per-turn examples); else None.
    turn: int | None = None
    #: The row's ``{"tools": [...], "tool_choice": ...}`` (None: no tools).
    tools: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def cut(self) -> tuple[int, ...]:
        """Generated answers cut at max_tokens: supervised without an end marker."""
        return tuple(i for i, reason in self.generated.items() if reason == "length")

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each generated answer's finish_reason, in conversation order."""
        return [self.generated[i] for i in sorted(self.generated)]

    @property
    def finish_reason(self) -> str | None:
        """The last generated answer's finish_reason (the supervised turn's, per turn)."""
        return self.generated[max(self.generated)] if self.generated else None


def choose(requested: str | None, *, regenerate: str, mask: str | None,
           tokenizer: Any | None) -> tuple[str, str | None]:
    """The job's ``--examples`` and the one line that says why, when synthq chose it.

    ``requested``: the user's (None: choose). ``tokenizer``: the job's loaded
    :class:`synthq.data.tokenize.ChatTokenizer` (None: no tokenization). With
    ``--regenerate all`` and a mask over every assistant turn, the template is
    tried on a probe conversation first, before any call: one that cannot give a
    stable multi-turn mask gets ``per-turn``, and ``conversation`` asked for
    explicitly is refused (every sample would fail ``boundary_unstable``).
    """
    from synthq.core.errors import UserError

    if requested is not None and requested not in EXAMPLE_MODES:
        raise UserError(f"--examples must be one of {', '.join(EXAMPLE_MODES)}, got "
                        f"{requested!r}")
    if regenerate != "all":
        if requested == "per-turn":
            raise UserError("--examples per-turn needs --regenerate all (one call per turn)")
        return "conversation", None
    if requested == "per-turn" or tokenizer is None or mask != "all_assistant_turns":
        return requested or "conversation", None
    why = tokenizer.multi_turn_unstable()
    if why is None:
        return requested or "conversation", None
    if requested == "conversation":
        raise UserError(
            "--examples conversation with --mask all_assistant_turns cannot work with this "
            f"chat template: every sample would fail boundary_unstable ({why}); use "
            "--examples per-turn (one example per turn), or --mask last_turn")
    return "per-turn", (
        "the chat template renders earlier turns differently once later ones follow (it "
        "rewrites history, e.g. drops their reasoning), so no mask over the whole "
        "conversation is stable: one training example per regenerated turn (--examples "
        "per-turn)")


def build(prompt: Sequence[Mapping[str, Any]], *, content: str | None = None,
          reasoning: str | None = None, tool_calls: Sequence[Mapping[str, Any]] | None = None,
          finish_reason: str | None = None, answers: Sequence[Mapping[str, Any]] | None = None,
          tools: dict[str, Any] | None = None, per_turn: bool = False,
          history_reasoning: str = "drop") -> list[Example]:
    """The examples of one sample.

    ``answers`` (the sample's ``turns``): it was regenerated turn by turn and
    ``prompt`` is the dataset's whole conversation; else ``prompt`` was answered
    once with ``content``, ``reasoning``, ``tool_calls`` and ``finish_reason``.
    """
    if answers is None:
        answer = turns.answer_message({"content": content, "reasoning_content": reasoning,
                                       "tool_calls": tool_calls}, reasoning=True)
        messages = [dict(m) for m in prompt] + [answer]
        last = len(messages) - 1
        return [Example(messages, {last: finish_reason}, (last,), tools=tools)]
    positions = turns.turn_positions(prompt)[:len(answers)]
    if not per_turn:
        messages = turns.regenerated(prompt, answers)
        generated = {p: answers[k].get("finish_reason") for k, p in enumerate(positions)}
        return [Example(messages, generated, tuple(positions), tools=tools)] if messages else []
    out = []
    for k, position in enumerate(positions):
        # The history as it was sent for turn k, then the answer it got.
        messages = turns.history(prompt, answers, k, reasoning=history_reasoning)
        messages.append(turns.answer_message(answers[k], reasoning=True))
        generated = {p: answers[j].get("finish_reason") for j, p in enumerate(positions[:k + 1])}
        out.append(Example(messages, generated, (position,), supervised=(position,), turn=k,
                           tools=tools))
    return out


def exported(example: Example, *, reasoning: bool,
             finish: bool = True) -> list[dict[str, Any]]:
    """The example's ``conversations`` as the export writes them: ``role``, ``content``,
    ``reasoning_content`` of generated answers when the job keeps reasoning, the tool
    fields, and (``finish``) each generated answer's ``finish_reason``."""
    out = []
    for i, m in enumerate(example.messages):
        message: dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
        if reasoning and i in example.generated and m.get("reasoning_content"):
            message["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        if finish and i in example.generated:
            message["finish_reason"] = example.generated[i]
        out.append(message)
    return out


def tokenization_failure(exc: BaseException) -> tuple[SampleState, errors.PermanentError]:
    """The state and error a failed tokenization leaves its sample in, in the worker and
    in ``synthq retokenize`` alike: ``skipped`` when truncation left nothing to learn,
    else ``failed``; a tokenization error as it is, anything else (a bug, a tokenizer's
    surprise) as ``invalid_input`` naming it, never retried. The response stays stored
    either way: ``synthq retokenize`` may try again."""
    if not isinstance(exc, errors.PermanentError):
        exc = errors.TokenizerCrashed(f"tokenization crashed: {type(exc).__name__}: {exc}"[:2000])
    skipped = isinstance(exc, errors.NoSupervisedTokens)
    return (SampleState.SKIPPED if skipped else SampleState.FAILED), exc


def split(input_ids: np.ndarray, loss_mask: np.ndarray,
          examples: list[dict[str, Any]] | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """A sample's stored ids and mask cut into its examples (``samples.examples``)."""
    if not examples:
        return [(input_ids, loss_mask)]
    cuts = np.cumsum([int(e["tokens"]) for e in examples])
    if int(cuts[-1]) != len(input_ids):
        raise ValueError(f"samples.examples counts {int(cuts[-1])} tokens, input_ids has "
                         f"{len(input_ids)}")
    return list(zip(np.split(input_ids, cuts[:-1]), np.split(loss_mask, cuts[:-1]),
                    strict=True))


def tokenize_sample(job: Any, prompt: list[dict[str, Any]], content: str,
                    reasoning: str | None, server_ids: list[int] | None, *,
                    tool_calls: list[dict[str, Any]] | None = None,
                    tools: dict[str, Any] | None = None,
                    answers: list[dict[str, Any]] | None = None,
                    finish_reason: str | None = None,
                    engine_ids: tuple[list[int], list[int]] | None = None) -> dict[str, Any]:
    """The sample's result columns (``samples.input_ids`` ... ``examples``); raises a
    tokenization error class.

    ``answers``: the sample was regenerated turn by turn (``job.regenerate ==
    "all"``). A per-turn example left with no supervised token by ``max_seq_len``
    (a long history) is left out; the sample is skipped only when none is left.

    ``engine_ids``: the final call's prompt and output token ids as the engine saw and
    wrote them (``--capture inline``): the final answer's example is those ids, its
    output supervised (:func:`engine_example`), so that the hidden states the engine
    saved in that call are this example's. It is still tokenized our way first (every
    check of the conversation holds; ``token_mismatch`` compares the two).
    """
    from synthq.core.packing import pack_ids, pack_mask
    from synthq.data.tokenize import TokenizeSettings, get_chat_tokenizer

    settings = TokenizeSettings.from_job(job)
    assert settings is not None
    tok = get_chat_tokenizer(settings)
    per_turn = answers is not None and getattr(job, "examples", None) == "per-turn"
    built = build(prompt, content=content, reasoning=reasoning, tool_calls=tool_calls,
                  finish_reason=finish_reason, answers=answers, tools=tools,
                  per_turn=per_turn, history_reasoning=getattr(job, "history_reasoning", "drop"))
    if not built:
        raise errors.InvalidInput("the conversation has no generated turn")
    definitions = (tools or {}).get("tools") or None
    done: list[tuple[Example, Any]] = []
    empty: errors.NoSupervisedTokens | None = None
    for example in built:
        messages = [tok.place_reasoning(m) if i in example.placed else dict(m)
                    for i, m in enumerate(example.messages)]
        # Only the arguments that differ from tokenize's defaults are passed.
        options: dict[str, Any] = {k: v for k, v in (
            ("tools", definitions), ("turns", example.supervised), ("cut", example.cut)) if v}
        try:
            done.append((example, tok.tokenize(messages, **options)))
        except errors.NoSupervisedTokens as exc:
            if not per_turn:
                raise
            empty = exc
    if not done:
        assert empty is not None
        raise empty
    results = [r for _, r in done]
    mismatch = None
    if server_ids is not None:  # the stored ids are the last call's: the last turn's
        ours, theirs = results[-1].completion_ids, list(server_ids)
        # An answer cut at max_tokens has no end-of-turn token from the server; where the
        # template still closes the turn with one, that token is the template's, not a
        # tokenization difference (seen against vLLM 0.32 on every finish_reason=length).
        mismatch = theirs != ours and not (len(ours) == len(theirs) + 1
                                           and ours[:-1] == theirs)
    if engine_ids is not None and done[-1][0] is built[-1]:
        results[-1] = engine_example(*engine_ids, max_seq_len=settings.max_seq_len)
    ids = np.concatenate([r.input_ids for r in results])
    mask = np.concatenate([r.loss_mask for r in results])
    listed = [{"turn": e.turn, "tokens": len(r.input_ids), "supervised": r.num_supervised}
              for (e, _), r in zip(done, results, strict=True)] if per_turn else None
    return dict(input_ids=pack_ids(ids), loss_mask=pack_mask(mask), num_tokens=len(ids),
                num_supervised=int(mask.sum()), tokenize_version=job.tokenize_version,
                token_mismatch=mismatch, examples=listed)


def engine_example(prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                   max_seq_len: int) -> Any:
    """The example of one call as the engine saw and wrote it: its prompt's token ids then
    its output's, the output supervised (every token the engine generated, its stop
    token included), cut at ``max_seq_len``; :class:`errors.NoSupervisedTokens` when the
    cut leaves no output token."""
    from synthq.data.tokenize import Tokenized

    ids = np.asarray([*prompt_ids, *output_ids], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt_ids):] = 1
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if not output_ids or not mask.any():
        raise errors.NoSupervisedTokens(
            f"the engine's prompt has {len(prompt_ids):,} tokens: max_seq_len={max_seq_len:,} "
            "leaves none of its output to supervise")
    return Tokenized(input_ids=ids, loss_mask=mask, truncated=truncated,
                     completion_ids=list(output_ids))

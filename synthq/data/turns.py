"""Regenerating every assistant turn: the history each turn is asked on (pure functions).

With ``--regenerate all`` a sample holds the dataset's whole conversation
(``samples.prompt``) and the answers regenerated so far (``samples.turns``).
Its *turns* are the positions of the conversation's assistant messages, plus
one at the end when the conversation ends with a user or tool message (a last
question nobody answered yet). Turn ``k`` is asked on the conversation up to
its position, with the regenerated answers of turns ``0..k-1`` in place of the
dataset's:

>>> conv = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
...         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
>>> turn_positions(conv)
[1, 3]
>>> [m["content"] for m in history(conv, [{"content": "R1"}], 1)]
['q1', 'R1', 'q2']

Tools: a regenerated turn that calls the same functions, as many times each,
as the dataset's turn did gets the dataset's tool results after it, each
``tool_call_id`` pointed at the regenerated call of the same function in the
same order. Any other answer at a turn that has more turns after it cuts the
conversation there (:func:`cut_reason`): the sample ends with that turn, the cut
recorded, never dropped silently.

Nothing here touches the database: the worker (:mod:`synthq.serving.call`), the
export and ``synthq sample`` call these functions on stored columns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from synthq.spec.jobspec import BY_NAME

__all__ = ["ANSWER_FIELDS", "HISTORY_REASONING", "turn_positions", "history", "regenerated",
           "cut_reason", "answer_message", "call_names"]

#: What a stored answer holds (``samples.turns`` items).
ANSWER_FIELDS = ("content", "reasoning_content", "tool_calls", "finish_reason",
                 "prompt_tokens", "completion_tokens")

#: ``--history-reasoning``: earlier turns are sent with their content only, or with
#: their ``reasoning_content`` too.
HISTORY_REASONING = BY_NAME["history_reasoning"].choices  # declared in synthq.spec.jobspec

_ANSWERED = frozenset({"user", "tool"})


def turn_positions(conversation: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of the turns to generate: every assistant message, and ``len(conversation)``
    when the conversation ends with a user or tool message."""
    positions = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
    if conversation and conversation[-1].get("role") in _ANSWERED:
        positions.append(len(conversation))
    return positions


def call_names(message: Mapping[str, Any] | None) -> list[str]:
    """The function names an assistant message calls, in order."""
    calls = (message or {}).get("tool_calls") or []
    return [str((c.get("function") or {}).get("name")) for c in calls]


def answer_message(answer: Mapping[str, Any], *, reasoning: bool) -> dict[str, Any]:
    """An assistant message from a stored answer (``reasoning``: keep its reasoning_content)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.get("content") or ""}
    if answer.get("tool_calls"):
        message["tool_calls"] = [dict(c) for c in answer["tool_calls"]]
    if reasoning and answer.get("reasoning_content"):
        message["reasoning_content"] = answer["reasoning_content"]
    return message


def cut_reason(dataset_turn: Mapping[str, Any] | None, answer: Mapping[str, Any]) -> str | None:
    """Why the conversation cannot go on after this regenerated turn, or None.

    It goes on when the answer calls the same functions as many times each as
    the dataset's turn did (no calls on both sides included): the dataset's
    tool results then fit it.
    """
    theirs = Counter(call_names(dataset_turn))
    ours = Counter(call_names(answer))
    if theirs == ours:
        return None
    if not ours:
        return f"the answer calls no tool where the dataset calls {_names(theirs)}"
    if not theirs:
        return f"the answer calls {_names(ours)} where the dataset calls no tool"
    return f"the answer calls {_names(ours)} where the dataset calls {_names(theirs)}"


def _names(counts: Counter[str]) -> str:
    return ", ".join(f"{n}×{c}" if c > 1 else n for n, c in sorted(counts.items()))


def _id_map(dataset_turn: Mapping[str, Any], answer: Mapping[str, Any]) -> dict[str, str]:
    """Dataset call id → regenerated call id, pairing the k-th call of each function."""
    ours: dict[str, list[str]] = {}
    for call in answer.get("tool_calls") or []:
        ours.setdefault(str((call.get("function") or {}).get("name")), []).append(
            str(call.get("id") or ""))
    mapping: dict[str, str] = {}
    for call in dataset_turn.get("tool_calls") or []:
        name = str((call.get("function") or {}).get("name"))
        if ours.get(name) and call.get("id"):
            mapping[str(call["id"])] = ours[name].pop(0)
    return mapping


def _build(conversation: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
           end: int, *, reasoning: bool) -> list[dict[str, Any]]:
    """``conversation[:end]`` with the first ``len(answers)`` turns replaced by the answers."""
    positions = turn_positions(conversation)
    replaced = dict(zip(positions, answers, strict=False))
    out: list[dict[str, Any]] = []
    ids: dict[str, str] = {}
    for i, message in enumerate(conversation[:end]):
        if i in replaced:
            out.append(answer_message(replaced[i], reasoning=reasoning))
            ids = _id_map(message, replaced[i])
            continue
        if message.get("role") == "assistant":  # a turn not regenerated (yet): never sent
            break
        copy = dict(message)
        if copy.get("role") == "tool" and copy.get("tool_call_id") in ids:
            copy["tool_call_id"] = ids[copy["tool_call_id"]]
        out.append(copy)
    return out


def history(conversation: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
            turn: int, *, reasoning: str = "drop") -> list[dict[str, Any]]:
    """The messages turn ``turn`` is asked on: everything before its position, with the
    regenerated ``answers`` of turns ``0..turn-1`` in place of the dataset's.

    ``reasoning="keep"`` sends the earlier answers' ``reasoning_content`` too.
    """
    positions = turn_positions(conversation)
    if not 0 <= turn < len(positions):
        raise ValueError(f"turn {turn} out of range: the conversation has {len(positions)}")
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
    return _build(conversation, answers[:turn], positions[turn], reasoning=reasoning == "keep")


def regenerated(conversation: Sequence[Mapping[str, Any]],
                answers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as regenerated: through the last answered turn, every answer in
    place (with its reasoning; the tokenizer places or drops it per the job)."""
    positions = turn_positions(conversation)
    n = min(len(answers), len(positions))
    if not n:
        return []
    built = _build(conversation, answers[:n - 1], positions[n - 1], reasoning=True)
    built.append(answer_message(answers[n - 1], reasoning=True))
    return built

"""The history each regenerated turn is asked on (synthq.data.turns), as pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from synthq.data.turns import cut_reason, history, regenerated, turn_positions


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def call(call_id: str, name: str, arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


THREE = [msg("system", "s"), msg("user", "q1"), msg("assistant", "a1"), msg("user", "q2"),
         msg("assistant", "a2"), msg("user", "q3"), msg("assistant", "a3")]
ANSWERS = [{"content": "R1", "reasoning_content": "think1"}, {"content": "R2"},
           {"content": "R3"}]


def test_turn_positions() -> None:
    assert turn_positions(THREE) == [2, 4, 6]
    # A last question nobody answered is a turn too.
    assert turn_positions(THREE[:-1]) == [2, 4, 6]
    assert turn_positions([msg("user", "q")]) == [1]
    assert turn_positions([]) == []


def test_each_turn_is_asked_on_the_regenerated_answers_before_it() -> None:
    assert history(THREE, [], 0) == THREE[:2]
    assert history(THREE, ANSWERS[:1], 1) == [
        msg("system", "s"), msg("user", "q1"), msg("assistant", "R1"), msg("user", "q2")]
    third = history(THREE, ANSWERS[:2], 2)
    assert [m["content"] for m in third] == ["s", "q1", "R1", "q2", "R2", "q3"]
    # The dataset's answers never leak into a request.
    assert not {"a1", "a2", "a3"} & {m["content"] for m in third}
    # Extra answers (a retry of turn 1 after turn 2 was stored) are ignored.
    assert history(THREE, ANSWERS, 1) == history(THREE, ANSWERS[:1], 1)
    with pytest.raises(ValueError, match="needs 2 earlier answers"):
        history(THREE, ANSWERS[:1], 2)
    with pytest.raises(ValueError, match="out of range"):
        history(THREE, ANSWERS, 3)


def test_history_reasoning_is_dropped_unless_kept() -> None:
    dropped = history(THREE, ANSWERS[:1], 1)
    assert "reasoning_content" not in dropped[2]
    kept = history(THREE, ANSWERS[:1], 1, reasoning="keep")
    assert kept[2] == {"role": "assistant", "content": "R1", "reasoning_content": "think1"}


def test_regenerated_conversation_has_every_answer_in_place() -> None:
    full = regenerated(THREE, ANSWERS)
    assert [m["content"] for m in full] == ["s", "q1", "R1", "q2", "R2", "q3", "R3"]
    assert full[2]["reasoning_content"] == "think1"  # the tokenizer places or drops it
    # Cut after turn 2: the conversation ends with that turn's answer.
    assert [m["content"] for m in regenerated(THREE, ANSWERS[:2])] == [
        "s", "q1", "R1", "q2", "R2"]
    assert regenerated(THREE, []) == []
    # A trailing question is answered by the last turn.
    assert [m["content"] for m in regenerated(THREE[:-1], ANSWERS)][-2:] == ["q3", "R3"]


TOOLS = [msg("user", "weather in Oslo and Rome?"),
         {"role": "assistant", "content": "", "tool_calls": [
             call("d1", "get_weather", '{"city": "Oslo"}'),
             call("d2", "get_weather", '{"city": "Rome"}'),
             call("d3", "get_time")]},
         {"role": "tool", "tool_call_id": "d1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "d2", "content": "rain"},
         {"role": "tool", "tool_call_id": "d3", "content": "noon"},
         msg("assistant", "Oslo sunny, Rome rain, noon.")]


def test_matching_tool_calls_get_the_dataset_results_with_their_ids() -> None:
    # Same functions, same counts, another order: the k-th call of each function
    # is paired with the dataset's k-th call of it.
    answer = {"content": "", "tool_calls": [call("g1", "get_time"),
                                            call("g2", "get_weather", '{"city": "Oslo"}'),
                                            call("g3", "get_weather", '{"city": "Rome"}')]}
    assert cut_reason(TOOLS[1], answer) is None
    second = history(TOOLS, [answer], 1)
    assert second[1]["tool_calls"] == answer["tool_calls"]
    assert [(m["tool_call_id"], m["content"]) for m in second[2:]] == [
        ("g2", "sunny"), ("g3", "rain"), ("g1", "noon")]


def test_other_tool_calls_cut_the_conversation() -> None:
    other = {"content": "", "tool_calls": [call("g1", "search")]}
    assert cut_reason(TOOLS[1], other) == (
        "the answer calls search where the dataset calls get_time, get_weather×2")
    fewer = {"content": "", "tool_calls": [call("g1", "get_weather"), call("g2", "get_time")]}
    assert cut_reason(TOOLS[1], fewer) is not None
    assert cut_reason(TOOLS[1], {"content": "no tools"}) == (
        "the answer calls no tool where the dataset calls get_time, get_weather×2")
    assert cut_reason(msg("assistant", "plain"), other) == (
        "the answer calls search where the dataset calls no tool")
    assert cut_reason(msg("assistant", "plain"), {"content": "plain too"}) is None

"""The export of per-turn examples and of tool rows, read the way SpecForge and speculators
read training data (their layout re-implemented here, not their code)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pytest
from sqlalchemy import update

from synthq.core.packing import pack_ids, pack_mask
from synthq.jobs.export import export_job
from synthq.store.db import session_scope
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

CONVERSATION: list[dict[str, Any]] = []
for _t in range(3):
    CONVERSATION += [{"role": "user", "content": f"q{_t}"},
                     {"role": "assistant", "content": f"dataset {_t}"}]
ANSWERS = [{"content": "a0", "reasoning_content": "r0", "finish_reason": "stop"},
           {"content": "a1 cut", "reasoning_content": "r1", "finish_reason": "length"},
           {"content": "a2", "reasoning_content": "r2", "finish_reason": "stop"}]


def make_job(job_factory: Callable[..., Any], **columns: Any) -> int:
    job_id: int = job_factory([]).job_id
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            tokenizer="test-tokenizer", tokenize_version=1, **columns))
    return job_id


def per_turn_sample(sample_factory: Callable[..., int], job_id: int) -> tuple[int, list[int]]:
    """A done sample of three per-turn examples of 4, 5 and 6 tokens (the last 2 supervised)."""
    lengths = [4, 5, 6]
    ids = list(range(sum(lengths)))
    mask = [m for n in lengths for m in [0] * (n - 2) + [1, 1]]
    sid = sample_factory("done", job_id=job_id, prompt=CONVERSATION, turns=ANSWERS, turn=3,
                         turn_count=3, response_content="a2", finish_reason="stop",
                         input_ids=pack_ids(ids), loss_mask=pack_mask(mask),
                         num_tokens=len(ids), num_supervised=6, tokenize_version=1,
                         examples=[{"turn": k, "tokens": n, "supervised": 2}
                                   for k, n in enumerate(lengths)])
    return sid, lengths


def test_per_turn_examples_are_one_row_each(job_factory: Callable[..., Any],
                                            sample_factory: Callable[..., int],
                                            tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    job_id = make_job(job_factory, regenerate="all", examples="per-turn")
    sid, lengths = per_turn_sample(sample_factory, job_id)
    manifest = export_job(job_id, tmp_path / "p")
    assert manifest.exported == 3 and manifest.samples == 1 and manifest.examples == "per-turn"
    rows = pq.read_table(tmp_path / "p" / manifest.shards[0]["file"]).to_pylist()
    assert [r["id"] for r in rows] == [f"{sid}:{k}" for k in range(3)]
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "stop"]
    assert [len(r["input_ids"]) for r in rows] == lengths
    assert rows[1]["input_ids"] == list(range(4, 9))
    for k, row in enumerate(rows):
        conv = row["conversations"]
        # The history as sent for turn k (earlier regenerated answers, no reasoning), then k.
        assert [m["content"] for m in conv] == [
            x for j in range(k + 1) for x in (f"q{j}", ANSWERS[j]["content"])]
        assert conv[-1]["reasoning_content"] == f"r{k}"
        assert all(m["reasoning_content"] is None for m in conv[:-1])
        assert conv[-1]["finish_reason"] == ANSWERS[k]["finish_reason"]
        assert conv[0]["finish_reason"] is None
    lines = [json.loads(x) for x in (tmp_path / "j").joinpath(
        export_job(job_id, tmp_path / "j", fmt="jsonl").shards[0]["file"]).open()]
    assert [(x["id"], x["turn"], x["finish_reason"]) for x in lines] == [
        (f"{sid}:{k}", k, ANSWERS[k]["finish_reason"]) for k in range(3)]
    assert lines[2]["conversations"][-1] == {"role": "assistant", "content": "a2",
                                             "reasoning_content": "r2"}
    # One example of the whole conversation: each generated turn's finish_reason.
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(examples="conversation"))
        s.execute(update(Sample).where(Sample.id == sid).values(
            examples=None, input_ids=pack_ids(list(range(6))), loss_mask=pack_mask([1] * 6),
            num_tokens=6))
    whole = export_job(job_id, tmp_path / "w", fmt="jsonl")
    [line] = [json.loads(x) for x in (tmp_path / "w" / whole.shards[0]["file"]).open()]
    assert line["finish_reasons"] == ["stop", "length", "stop"]
    assert line["finish_reason"] == "stop" and "turn" not in line



def specforge_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """SpecForge's reading of a row's tools: a list (or JSON text of one); anything else is
    logged as "Unexpected tools type" and trained without."""
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    if tools is not None and not isinstance(tools, list):
        return None
    return tools


def speculators_tools(row: dict[str, Any]) -> list[dict[str, Any]]:
    """speculators' regeneration: ``tools`` goes to the request and the chat template as it
    is, a list of ``{"type": "function", "function": {...}}``; anything else raises."""
    tools = row["tools"]
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list, got {type(tools).__name__}")
    for tool in tools:
        if tool["type"] != "function" or not tool["function"]["name"]:
            raise ValueError(f"not a function tool: {tool}")
    return tools


def test_tools_are_exported_as_the_list_both_peers_read(job_factory: Callable[..., Any],
                                                        sample_factory: Callable[..., int],
                                                        tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    job_id = make_job(job_factory)
    call = [{"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    for i, choice in enumerate(["auto", None]):
        tools = {"tools": WEATHER, **({"tool_choice": choice} if choice else {})}
        sample_factory("done", job_id=job_id, prompt=[{"role": "user", "content": f"w{i}"}],
                       response_content="", tool_calls=call, finish_reason="tool_calls",
                       tools=tools, input_ids=pack_ids([1, 2, 3]),
                       loss_mask=pack_mask([0, 1, 1]), num_tokens=3, num_supervised=2,
                       tokenize_version=1)
    manifest = export_job(job_id, tmp_path / "j", fmt="jsonl")
    lines = [json.loads(x) for x in (tmp_path / "j" / manifest.shards[0]["file"]).open()]
    assert len(lines) == 2 and all(x["tools"] == WEATHER for x in lines)
    assert [x.get("tool_choice") for x in lines] == ["auto", None]
    template = AutoTokenizer.from_pretrained(ct.chatml_tools(tmp_path))
    for line in lines:
        assert specforge_tools(line) == WEATHER
        tools = speculators_tools(line)
        # The layout a chat template takes: the definitions are rendered.
        text = template.apply_chat_template(line["conversations"], tools=tools, tokenize=False)
        assert '"get_weather"' in text and "# Tools" in text
    assert lines[0]["conversations"][-1]["tool_calls"] == call
    parquet = export_job(job_id, tmp_path / "p")
    table = pq.read_table(tmp_path / "p" / parquet.shards[0]["file"]).to_pylist()
    assert [specforge_tools(r) for r in table] == [WEATHER, WEATHER]
    assert [r["tool_choice"] for r in table] == ['"auto"', None]

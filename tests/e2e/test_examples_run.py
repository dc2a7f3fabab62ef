"""Per-turn training examples and the tool path as a user runs them: `synthq run` (embedded
SQLite) on the simulator, then `synthq retokenize` and `synthq export`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pytest
from support import sqlite_rows
from test_turns import embedded_env, run_args, synthq, three_turn_rows, write_jsonl

pytestmark = pytest.mark.e2e

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def test_a_thinking_template_trains_every_regenerated_turn(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0.05", "--reasoning")
    qwen = ct.qwen3(tmp_path)
    dataset = write_jsonl(tmp_path / "conv.jsonl", three_turn_rows(3))
    env = embedded_env(tmp_path)
    db = tmp_path / "data" / "synthq.db"
    ran = synthq(env, *run_args(dataset, sim.url, "--regenerate", "all", "--tokenizer", qwen),
                 timeout=300)
    assert ran.returncode == 0, ran.stderr
    # Chosen before any call, and said in one line.
    assert "one training example per regenerated turn (--examples per-turn)" in ran.stdout + \
        ran.stderr
    assert sqlite_rows(db, "select examples from jobs") == [("per-turn",)]
    assert sqlite_rows(db, "select count(*) from attempts") == [(9,)]
    stored = sqlite_rows(db, "select state, examples, num_tokens from samples order by id")
    assert all(state == "done" and [e["turn"] for e in json.loads(examples)] == [0, 1, 2]
               and sum(e["tokens"] for e in json.loads(examples)) == n
               for state, examples, n in stored)

    # Retokenizing recomputes every turn's example, with no call.
    again = synthq(env, "retokenize", "conv", "--max-seq-len", "2048", timeout=300)
    assert again.returncode == 0, again.stderr
    assert sqlite_rows(db, "select count(*) from attempts") == [(9,)]
    assert sqlite_rows(db, "select count(*) from samples where tokenize_version = 2 and "
                           "json_array_length(examples) = 3") == [(3,)]
    out = tmp_path / "export"
    exported = synthq(env, "export", "conv", "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert "exported 9 examples (one per regenerated turn) of 3 samples" in exported.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    lines = [json.loads(x) for s in manifest["shards"] for x in (out / s["file"]).open()]
    assert [x["turn"] for x in lines] == [0, 1, 2] * 3
    assert all(x["conversations"][-1]["reasoning_content"] for x in lines)

    shown = synthq(env, "sample", "1")
    assert "examples: 3, one per regenerated turn" in shown.stdout
    # Asking for one example per conversation on this template is refused up front.
    refused = synthq(env, *run_args(dataset, sim.url, "--regenerate", "all", "--tokenizer",
                                    qwen, "--examples", "conversation", "--job", "other"))
    assert refused.returncode != 0 and "boundary_unstable" in refused.stderr


def test_the_simulator_calls_tools_and_tool_choice_auto_is_sent(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0.05", "--tool-calls", "--record-requests")
    rows = [{"id": "a", "tools": WEATHER, "messages": [{"role": "user", "content": "Oslo?"}]},
            {"id": "b", "tools": WEATHER, "tool_choice": "none",
             "messages": [{"role": "user", "content": "Bergen?"}]}]
    dataset = write_jsonl(tmp_path / "tools.jsonl", rows)
    env = embedded_env(tmp_path)
    ran = synthq(env, *run_args(dataset, sim.url), timeout=300)
    assert ran.returncode == 0, ran.stderr
    requests = sorted(sim.http.get("/sim/requests").json(),
                      key=lambda r: r["messages"][0]["content"])
    assert [r["tool_choice"] for r in requests] == ["none", "auto"]
    calls = dict(sqlite_rows(tmp_path / "data" / "synthq.db",
                             "select source_id, finish_reason from samples"))
    assert calls == {"a": "tool_calls", "b": "stop"}

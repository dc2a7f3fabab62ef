"""Every turn regenerated, tool conversations, and requeue with new settings, as a user
runs them: `synthq run` processes (embedded SQLite), the simulator over HTTP, kill -9."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import Proc, child_env, run_cli, sqlite_rows, wait_for

from synthq.data.turns import history
from synthq.testing.simulator import conversation_tag

pytestmark = pytest.mark.e2e

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def synthq(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli(*args, env=env, timeout=timeout, check=False)


def run_args(dataset: Path, server: str, *extra: str, max_tokens: int = 64) -> list[str]:
    return ["run", "--dataset", str(dataset), "--server", server, "--model", "sim-model",
            "--max-tokens", str(max_tokens), *extra]


def embedded_env(tmp_path: Path) -> dict[str, str]:
    return child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                     SYNTHQ_BROKER_URL="")


def three_turn_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"system {i}"}]
        for t in range(3):
            messages += [{"role": "user", "content": f"row {i} question {t}"},
                         {"role": "assistant", "content": f"dataset answer {i}.{t}"}]
        rows.append({"id": f"r{i}", "messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_turn_on_regenerated_history_survives_a_kill(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0.3", "--history-answers", "--record-requests")
    rows = three_turn_rows(30)
    dataset = write_jsonl(tmp_path / "conv.jsonl", rows)
    env = embedded_env(tmp_path)
    db = tmp_path / "data" / "synthq.db"
    inflight = 6
    first = Proc([sys.executable, "-m", "synthq.cli",
                  *run_args(dataset, sim.url, "--regenerate", "all", "--inflight",
                            str(inflight))], env, tmp_path / "run1.log")
    # Kill between turns: some conversations have stored turns, none is finished.
    wait_for(lambda: (sqlite_rows(db, "select coalesce(sum(turn), 0) from samples")
                      or [(0,)])[0][0] >= 20, 60, "no turn stored")
    first.kill9()
    stored = sqlite_rows(db, "select sum(turn), sum(state = 'done') from samples")[0]
    assert stored[0] < 90

    second = synthq(env, *run_args(dataset, sim.url, "--regenerate", "all", "--inflight",
                                   str(inflight), "--json"))
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 30 and summary["finished"]
    assert summary["turns_done"] == summary["turns_total"] == 90

    # Every turn equals what the server answers for the regenerated history before it.
    samples = sqlite_rows(db, "select prompt, turns, turn, turn_count, response_content "
                              "from samples order by id")
    for prompt, answers, turn, count, last in samples:
        prompt, answers = json.loads(prompt), json.loads(answers)
        assert turn == count == len(answers) == 3
        for k in range(3):
            assert answers[k]["content"].split()[0] == conversation_tag(history(prompt,
                                                                                answers, k))
        assert last == answers[-1]["content"]
    # Turn k's request held the regenerated answers of turns < k, never the dataset's.
    requests = sim.http.get("/sim/requests").json()
    assert not any("dataset answer" in (m.get("content") or "")
                   for r in requests for m in r["messages"])
    # Each turn answered once, except the calls in flight at the kill.
    assert len(requests) <= 90 + inflight
    per_turn = Counter(json.dumps(r["messages"]) for r in requests)
    assert sum(n - 1 for n in per_turn.values()) <= inflight
    # One attempts row per call, with its turn.
    by_turn = dict(sqlite_rows(db, "select turn, count(*) from attempts where outcome = 'ok' "
                                   "group by turn"))
    assert by_turn == {0: 30, 1: 30, 2: 30}
    # The calls cut by the kill are logged as lost, with their turn.
    lost = sqlite_rows(db, "select turn from attempts where outcome = 'lost'")
    assert len(lost) <= inflight and all(t is not None for (t,) in lost)


def tool_row(i: int, call: str) -> dict[str, Any]:
    """user → assistant calls get_weather → tool result → assistant → user → assistant.
    The simulator calls ``call`` on the first turn (a directive in the question)."""
    return {"id": f"t{i}", "tools": WEATHER, "tool_choice": "auto", "messages": [
        {"role": "user", "content": f"weather in city {i}? [[sim-call:{call}]]"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"d{i}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": f"c{i}"})}}]},
        {"role": "tool", "tool_call_id": f"d{i}", "content": f"sunny {i}"},
        {"role": "assistant", "content": f"It is sunny in c{i}."},
        {"role": "user", "content": f"thanks {i}"},
        {"role": "assistant", "content": "You are welcome."}]}


def test_tool_conversations_last_turn_are_sent_whole_with_tools(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--record-requests")
    rows = [tool_row(i, "get_weather") for i in range(10)]
    # Ends with the tool result: the answer to generate follows it.
    for row in rows[:5]:
        row["messages"] = row["messages"][:3]
    dataset = write_jsonl(tmp_path / "tools.jsonl", rows)
    env = embedded_env(tmp_path)
    done = synthq(env, *run_args(dataset, sim.url, "--json"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["counts"]["done"] == 10
    requests = sim.http.get("/sim/requests").json()
    assert len(requests) == 10
    sent = {r["messages"][0]["content"]: r for r in requests}
    for row in rows:
        request = sent[row["messages"][0]["content"]]
        assert request["tools"] == WEATHER and request["tool_choice"] == "auto"
        expected = row["messages"][:3] if len(row["messages"]) == 3 else row["messages"][:5]
        assert [m["role"] for m in request["messages"]] == [m["role"] for m in expected]
        assert request["messages"][1]["tool_calls"][0]["id"] == row["messages"][1][
            "tool_calls"][0]["id"]
        assert request["messages"][2] == {"role": "tool", "content": row["messages"][2]["content"],
                                          "tool_call_id": row["messages"][2]["tool_call_id"]}
    out = tmp_path / "export"
    exported = synthq(env, "export", "tools", "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    lines = [json.loads(line) for line in (out / "data-00000-of-00001.jsonl").read_text()
             .splitlines()]
    # The layout SpecForge and speculators read: the list, tool_choice beside it.
    assert all(line["tools"] == WEATHER and line["tool_choice"] == "auto" for line in lines)


def test_tool_conversations_every_turn_attach_results_or_cut(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--record-requests")
    # Rows 0-3: the regenerated first turn calls get_weather, as the dataset does.
    # Row 4: it calls another function: the conversation is cut after turn 1.
    rows = [tool_row(i, "get_weather") for i in range(4)] + [tool_row(4, "search")]
    dataset = write_jsonl(tmp_path / "tools.jsonl", rows)
    env = embedded_env(tmp_path)
    done = synthq(env, *run_args(dataset, sim.url, "--regenerate", "all", "--json"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 5 and summary["cut"] == 1
    assert (summary["turns_done"], summary["turns_total"]) == (4 * 3 + 1, 4 * 3 + 1)
    db = tmp_path / "data" / "synthq.db"
    cut = sqlite_rows(db, "select source_id, cut_at_turn, cut_reason, turn from samples "
                          "where cut_at_turn is not null")
    assert cut == [("t4", 0, "the answer calls search where the dataset calls get_weather", 1)]
    requests = sim.http.get("/sim/requests").json()
    assert len(requests) == 4 * 3 + 1
    # Turn 2 of a matching row: the regenerated call, then the dataset's result pointed at it.
    second = [r for r in requests if r["messages"][-1]["role"] == "tool"]
    assert len(second) == 4
    for r in second:
        call = r["messages"][1]["tool_calls"][0]
        assert call["id"].startswith("call_c") and call["function"]["name"] == "get_weather"
        assert r["messages"][2]["tool_call_id"] == call["id"]
        assert r["messages"][2]["content"].startswith("sunny")
    out = tmp_path / "export"
    exported = synthq(env, "export", "tools", "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut"] == {"samples": 1, "reasons": {
        "the answer calls search where the dataset calls get_weather": 1}}
    lines = {json.loads(line)["source_id"]: json.loads(line) for line in
             (out / "data-00000-of-00001.jsonl").read_text().splitlines()}
    assert [m["role"] for m in lines["t4"]["conversations"]] == ["user", "assistant"]
    assert lines["t4"]["conversations"][1]["tool_calls"][0]["function"]["name"] == "search"
    assert [m["role"] for m in lines["t0"]["conversations"]] == [
        "user", "assistant", "tool", "assistant", "user", "assistant"]


def test_requeue_truncated_with_max_tokens_resends_only_those(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--record-requests", "--response-tokens", "20")
    # 30 answers fit in 24 tokens; 10 are cut once by the server (finish_reason=length).
    prompts = [f"short prompt {i}" + (" [[sim:length*1]]" if i % 4 == 0 else "")
               for i in range(40)]
    dataset = write_jsonl(tmp_path / "short.jsonl", [{"prompt": p} for p in prompts])
    env = embedded_env(tmp_path)
    first = synthq(env, *run_args(dataset, sim.url, "--json", max_tokens=24))
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 30 and summary["failures"] == {"truncated": 10}

    requeued = synthq(env, "requeue", "short", "--class", "truncated", "--max-tokens", "64")
    assert requeued.returncode == 0, requeued.stderr
    assert "requeued 10 " in requeued.stdout and "max_tokens=64" in requeued.stdout
    again = synthq(env, "run", "--job", "short", "--json")
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 40 and summary["finished"]

    requests = sim.http.get("/sim/requests").json()
    sent = [(r["messages"][-1]["content"], r["max_tokens"]) for r in requests]
    truncated = {p for p in prompts if "[[sim:length" in p}
    assert sorted(sent) == sorted([(p, 24) for p in prompts] + [(p, 64) for p in truncated])
    db = tmp_path / "data" / "synthq.db"
    own = sqlite_rows(db, "select json_extract(overrides, '$.max_tokens'), count(*) from "
                          "samples group by 1 order by 1")
    assert own == [(None, 30), (64, 10)]
    shown = synthq(env, "sample", str(sqlite_rows(
        db, "select id from samples where overrides like '%64%' limit 1")[0][0]))
    assert "own settings (requeue): max_tokens=64" in shown.stdout
    out = tmp_path / "export"
    exported = synthq(env, "export", "short", "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["overrides"] == [{"overrides": {"max_tokens": 64}, "samples": 10}]


def test_run_job_without_a_stored_job_or_with_half_the_flags_says_so(tmp_path: Path) -> None:
    env = embedded_env(tmp_path)
    missing = synthq(env, "run", "--job", "nothing")
    assert missing.returncode != 0 and "no job 'nothing'" in missing.stderr
    assert "Traceback" not in missing.stderr
    ignored = synthq(env, "run", "--job", "j", "--max-tokens", "5")
    assert ignored.returncode != 0 and "--max-tokens would be ignored" in ignored.stderr
    half = synthq(env, "run", "-d", "x.jsonl", "--job", "j")
    assert half.returncode != 0 and "missing -s, -m" in half.stderr
    bad = synthq(env, "requeue", "j", "--max-tokens", "0")
    assert bad.returncode != 0 and "--max-tokens must be a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_turn_retries_and_fails_on_its_own_and_requeue_continues_from_it(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--history-answers", "--record-requests")
    rows = three_turn_rows(3)
    # Row 0: turn 2 fails once (HTTP 500) and is retried; row 1: turn 2 fails twice, more
    # than its one retry: the sample fails there; row 2 runs through.
    rows[0]["messages"][3]["content"] += " [[sim:error*1]]"
    rows[1]["messages"][3]["content"] += " [[sim:error*2]]"
    dataset = write_jsonl(tmp_path / "conv.jsonl", rows)
    env = embedded_env(tmp_path)
    flags = ("--regenerate", "all", "--max-attempts", "2", "--backoff-base", "0.05",
             "--backoff-cap", "0.1", "--json")
    first = synthq(env, *run_args(dataset, sim.url, *flags))
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 2 and summary["failures"] == {"server_error": 1}
    db = tmp_path / "data" / "synthq.db"
    failed = sqlite_rows(db, "select source_id, turn, json_array_length(turns), error_message "
                             "from samples where state = 'failed'")
    assert [f[:3] for f in failed] == [("r1", 1, 1)]  # turn 1 kept, turn 2 failed
    assert failed[0][3].startswith("turn 2 of 3: HTTP 500")
    calls = sqlite_rows(db, "select s.source_id, a.turn, a.outcome from attempts a join "
                            "samples s on s.id = a.sample_id order by a.id")
    assert [(t, o) for sid, t, o in calls if sid == "r0"] == [
        (0, "ok"), (1, "server_error"), (1, "ok"), (2, "ok")]

    requeued = synthq(env, "requeue", "conv", "--class", "server_error")
    assert requeued.returncode == 0, requeued.stderr
    again = synthq(env, "run", "--job", "conv", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["counts"]["done"] == 3
    # Continued from turn 2: turn 1 was not asked again.
    r1 = [(t, o) for sid, t, o in sqlite_rows(
        db, "select s.source_id, a.turn, a.outcome from attempts a join samples s on "
            "s.id = a.sample_id order by a.id") if sid == "r1"]
    assert r1 == [(0, "ok"), (1, "server_error"), (1, "server_error"), (1, "ok"), (2, "ok")]
    prompt, answers = (json.loads(v) for v in sqlite_rows(
        db, "select prompt, turns from samples where source_id = 'r1'")[0])
    for k in range(3):
        assert answers[k]["content"].split()[0] == conversation_tag(history(prompt, answers, k))


@pytest.mark.parametrize("keep", [False, True])
def test_history_reasoning_drop_or_keep(simulator: Callable[..., Any], tmp_path: Path,
                                        keep: bool) -> None:
    sim = simulator("--latency", "0", "--reasoning", "--record-requests")
    rows = three_turn_rows(2)
    dataset = write_jsonl(tmp_path / "conv.jsonl", rows)
    env = embedded_env(tmp_path)
    flags = ["--regenerate", "all", "--json"]
    if keep:
        flags[2:2] = ["--history-reasoning", "keep"]
    done = synthq(env, *run_args(dataset, sim.url, *flags))
    assert done.returncode == 0, done.stderr
    requests = sim.http.get("/sim/requests").json()
    history_turns = [m for r in requests for m in r["messages"] if m["role"] == "assistant"]
    assert len(history_turns) == 2 * (1 + 2)  # turn 2 sees one answer, turn 3 two
    assert all(bool(m.get("reasoning_content")) is keep for m in history_turns)

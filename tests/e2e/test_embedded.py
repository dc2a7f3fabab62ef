"""`synthq run`, the embedded default, as a user runs it: a real CLI process,
SQLite, the simulator over HTTP; killed with SIGKILL and run again."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import Proc, child_env, run_cli, sqlite_rows, wait_for

pytestmark = pytest.mark.e2e


def write_dataset(path: Path, prompts: list[str], bad_rows: list[str] = ()) -> None:
    with path.open("w") as fh:
        for i, p in enumerate(prompts):
            fh.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")
            if i == 3:
                for bad in bad_rows:
                    fh.write(bad + "\n")


def run_args(dataset: Path, server: str, *extra: str) -> list[str]:
    return ["run", "--dataset", str(dataset), "--server", server, "--model", "sim-model",
            "--max-tokens", "64", *extra]


def run_cmd(dataset: Path, server: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "synthq.cli", *run_args(dataset, server, *extra)]


@pytest.mark.smoke  # the fast tier's end-to-end path
def test_run_killed_and_rerun_resumes_without_regenerating(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0.2", "--capacity", "64")
    prompts = [f"resume test prompt {i}" for i in range(200)]
    dataset = tmp_path / "prompts.jsonl"
    write_dataset(dataset, prompts)
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    db = tmp_path / "data" / "synthq.db"
    first = Proc(run_cmd(dataset, sim.url, "--inflight", "8"), env, tmp_path / "run1.log")
    wait_for(lambda: sqlite_rows(db, "select count(*) from samples where state='done'")
             and sqlite_rows(db, "select count(*) from samples where state='done'")[0][0] >= 40,
             60, "first run made no progress")
    first.kill9()
    done_before = {r[0] for r in sqlite_rows(
        db, "select json_extract(prompt, '$[0].content') from samples where state='done'")}
    assert 40 <= len(done_before) < len(prompts)

    second = run_cli(*run_args(dataset, sim.url, "--inflight", "8", "--json"), env=env,
                     check=False)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == len(prompts) and summary["finished"]
    seen = sim.stats()["prompts"]
    # No sample that was done before the kill was sent to the server again.
    assert all(seen[p] == 1 for p in done_before), {p: seen[p] for p in done_before if seen[p] != 1}
    # Every sample was sent at most twice (once more only if it was in flight at the kill).
    assert max(seen[p] for p in prompts) <= 2


def test_run_skips_malformed_rows_with_reasons(simulator: Callable[..., Any],
                                               tmp_path: Path) -> None:
    sim = simulator("--latency", "0")
    dataset = tmp_path / "mixed.jsonl"
    bad = [
        "{not json",
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),
        json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}),
        json.dumps({"messages": [{"role": "user", "content": ["a", "list"]}]}),
        json.dumps({"conversations": []}),
        json.dumps({"prompt": "x" * 300_000}),
    ]
    write_dataset(dataset, [f"good prompt {i}" for i in range(10)], bad)
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    result = run_cli(*run_args(dataset, sim.url, "--json"), env=env, check=False)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 10
    assert summary["counts"]["skipped"] == len(bad)
    reasons = [r[0] for r in sqlite_rows(
        tmp_path / "data" / "synthq.db",
        "select error_message from samples where state='skipped' order by dataset_index")]
    expected = ["not valid JSON", "unknown role 'robot'", "no user turn", "not a string",
                "empty conversation", "over the limit"]
    for reason, fragment in zip(reasons, expected, strict=True):
        assert fragment in reason


def test_run_rejects_bad_input_clearly(tmp_path: Path) -> None:
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    dataset = tmp_path / "d.jsonl"
    write_dataset(dataset, ["hi"])
    cases = [
        (run_args(tmp_path / "missing.jsonl", "http://127.0.0.1:1/v1"), "no such file"),
        (run_args(dataset, "localhost:8000"), "is not an http(s) URL"),
        (run_args(dataset, "http://127.0.0.1:1/v1", "--inflight", "0"), "--inflight must be"),
        (run_args(dataset, "http://127.0.0.1:1/v1", "--chat-template-kwargs", "{bad"),
         "not valid JSON"),
    ]
    for cmd, message in cases:
        result = run_cli(*cmd, env=env, check=False, timeout=60)
        assert result.returncode == 2, (cmd, result.stdout, result.stderr)
        assert message in " ".join(result.stderr.split()), result.stderr
        assert "Traceback" not in result.stderr


def test_ctrl_c_stops_cleanly_and_resumes(simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0.3")
    dataset = tmp_path / "p.jsonl"
    write_dataset(dataset, [f"ctrl-c prompt {i}" for i in range(80)])
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    db = tmp_path / "data" / "synthq.db"
    proc = Proc(run_cmd(dataset, sim.url, "--inflight", "4"), env, tmp_path / "run.log")
    wait_for(lambda: (sqlite_rows(db, "select count(*) from samples where state='done'")
                      or [(0,)])[0][0] >= 8, 60, "no progress")
    proc.proc.send_signal(signal.SIGINT)
    assert proc.proc.wait(30) == 130
    rows = sqlite_rows(db, "select state, count(*) from samples group by state")
    states = dict(rows)
    assert states.get("running", 0) == 0 and states.get("queued", 0) == 0, states
    # The summary shows no load of the run's own (gone) worker: it holds no call.
    assert "workers:" not in proc.log(), proc.log()[-2000:]
    proc.stop()
    again = run_cli(*run_args(dataset, sim.url, "--json"), env=env, check=False)
    assert json.loads(again.stdout.strip().splitlines()[-1])["counts"]["done"] == 80


def test_run_no_stream_retries_and_stores_the_setting(simulator: Callable[..., Any],
                                                      tmp_path: Path) -> None:
    """`synthq run --no-stream`: every call is a plain request, retries still happen, and
    the job keeps the setting (a rerun without the flag streams again)."""
    sim = simulator("--latency", "0")
    prompts = [f"plain prompt {i}" for i in range(20)] + ["flaky [[sim:error*1]]"]
    dataset = tmp_path / "plain.jsonl"
    write_dataset(dataset, prompts)
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    result = run_cli(*run_args(dataset, sim.url, "--no-stream", "--json", "--backoff-base",
                               "0.05", "--backoff-cap", "0.1"), env=env, check=False)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == len(prompts) and summary["finished"]
    stats = sim.stats()
    assert stats["requests"] == len(prompts) + 1 and stats["streamed"] == 0, stats
    db = tmp_path / "data" / "synthq.db"
    assert sqlite_rows(db, "select stream from jobs") == [(0,)]
    assert sqlite_rows(db, "select count(*) from attempts where outcome = 'server_error'") == [(1,)]

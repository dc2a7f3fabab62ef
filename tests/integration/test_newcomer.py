"""A newcomer's first use (issue 25, items 5 and 8): the defaults work with the README's
own tokenizer, and what a rerun or a Ctrl-C prints is true."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import chat_tokenizers as ct
import pytest
from support import REPO, Simulator, run_cli

pytestmark = pytest.mark.integration


def synthq(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``synthq ARGS`` in ``cwd``, the embedded default (no SYNTHQ_ setting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="250")
    result = run_cli(*args, cwd=cwd, env=env, timeout=timeout, check=False)
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return result


@pytest.fixture
def sim(simulator: Callable[..., Simulator]) -> Simulator:
    return simulator("--latency", "0", "--reasoning", "--response-tokens", "16")


def rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(n)))
    return path


def test_the_default_reasoning_works_with_deepseek_v3(tmp_path: Path, sim: Simulator) -> None:
    """The README's DeepSeek-V3 tokenizer with the default settings: `run` resolves
    --reasoning auto to drop in one line and trains on the answers; rerunning the same
    command finds the job (auto is the job's stored mode, not a settings change)."""
    data = rows(tmp_path / "p.jsonl", 3)
    args = ["run", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--max-tokens", "512",
            "--tokenizer", ct.deepseek_v3()]
    first = synthq(tmp_path, *args)
    assert first.returncode == 0, first.stderr
    lines = [line for line in first.stdout.splitlines() if "--reasoning auto" in line]
    assert len(lines) == 1 and lines[0].startswith("--reasoning auto: drop: "), first.stdout
    job = json.loads(synthq(tmp_path, "jobs", "--json").stdout)[0]
    assert job["done"] == 3, job
    shown = synthq(tmp_path, "sample", "1", "--json")
    assert json.loads(shown.stdout)["num_supervised"] > 0, shown.stdout
    again = synthq(tmp_path, *args)
    assert again.returncode == 0, again.stderr
    assert "--reasoning auto" not in again.stdout and "found" in again.stdout, again.stdout


def test_an_impossible_keep_is_refused_before_any_call(tmp_path: Path, sim: Simulator) -> None:
    data = rows(tmp_path / "p.jsonl", 3)
    result = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                    "--tokenizer", ct.deepseek_v3(), "--reasoning", "keep")
    assert result.returncode == 2
    assert "drops reasoning" in " ".join(result.stderr.split())
    assert sim.stats()["requests"] == 0, sim.stats()
    assert json.loads(synthq(tmp_path, "jobs", "--json").stdout) == []


def start_run(cwd: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="250", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "synthq.cli", "run", *args], cwd=cwd,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def done_count(cwd: Path) -> int:
    listed = synthq(cwd, "jobs", "--json")
    return int(json.loads(listed.stdout)[0]["done"]) if listed.stdout.strip() not in ("", "[]") \
        else 0


def test_a_stopped_run_says_how_to_resume_and_one_eta(
        tmp_path: Path, simulator: Callable[..., Simulator]) -> None:
    """Ctrl-C of `synthq run`: the summary says to run it again (not to start a worker),
    and gives one ETA, not two."""
    from support import wait_for

    sim = simulator("--latency", "0.4")
    data = rows(tmp_path / "p.jsonl", 60)
    proc = start_run(tmp_path, "-d", str(data), "-s", sim.url, "-m", "sim-model",
                     "--inflight", "2", "--max-tokens", "32", "--gpu-hour-price", "2")
    try:
        wait_for(lambda: done_count(tmp_path) >= 6, 120, "no progress")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    summary = " ".join(out.split())
    assert "stopped: " in summary and "run the same command again" in summary, out
    assert "no live worker" not in summary and "synthq worker" not in summary, out
    table = summary[summary.index("┃ pending"):]  # the summary, after the live bar's frames
    assert table.count("ETA") == 1 and " to go" not in table, out


def test_a_killed_run_is_not_a_live_worker(tmp_path: Path,
                                           simulator: Callable[..., Simulator]) -> None:
    """kill -9 of `synthq run`: `synthq status` lists no live worker at once (its pid is
    gone on this host), not for its heartbeat's last 15 s."""
    from support import wait_for

    sim = simulator("--latency", "0.4")
    data = rows(tmp_path / "p.jsonl", 60)
    proc = start_run(tmp_path, "-d", str(data), "-s", sim.url, "-m", "sim-model",
                     "--inflight", "2", "--max-tokens", "32")
    try:
        wait_for(lambda: done_count(tmp_path) >= 2, 120, "no progress")
        running = json.loads(synthq(tmp_path, "status", "p", "--json").stdout)
        assert [w["name"].split(":")[1] for w in running["workers"]] == [str(proc.pid)]
    finally:
        proc.kill()
        proc.wait(30)
    after = json.loads(synthq(tmp_path, "status", "p", "--json").stdout)
    assert after["workers"] == [], after["workers"]
    text = " ".join(synthq(tmp_path, "status", "p").stdout.split())
    assert "not running: " in text and "synthq run --job p" in text, text


def test_a_sample_of_turns_counts_its_calls(tmp_path: Path, sim: Simulator) -> None:
    conversation = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "two"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "three"}, {"role": "assistant", "content": "c"}]
    data = tmp_path / "turns.jsonl"
    data.write_text(json.dumps({"messages": conversation}) + "\n")
    assert synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                  "--regenerate", "all", "--max-tokens", "512").returncode == 0
    header = synthq(tmp_path, "sample", "1").stdout.splitlines()[0]
    assert "3 calls over 3 turns" in header and "attempt" not in header, header

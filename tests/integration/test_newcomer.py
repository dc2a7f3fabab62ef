"""A newcomer's first use (issue 25, items 5 and 8): the defaults work with the README's
own tokenizer, and what a rerun or a Ctrl-C prints is true."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import chat_tokenizers as ct
import pytest
from support import REPO, Simulator

pytestmark = pytest.mark.integration


def synthq(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``synthq ARGS`` in ``cwd``, the embedded default (no SYNTHQ_ setting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="250")
    result = subprocess.run([sys.executable, "-m", "synthq.cli", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
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

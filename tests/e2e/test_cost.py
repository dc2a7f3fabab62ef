"""The cost report on a real `synthq run`: a simulator with a known token rate and a
known GPU-hour price give a known $/1M tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import child_env, run_cli

pytestmark = pytest.mark.e2e


def test_dollars_per_million_tokens_from_a_known_rate_and_price(
        simulator: Callable[..., Any], tmp_path: Path) -> None:
    # Two calls at once, 40 tokens each after 5 s (one sleep: an exact rate even on a
    # busy machine, and the client's own overhead per call, ~0.1 s when the machine is
    # loaded, small beside it): the server generates 80 tokens per 5 busy seconds
    # (overlapping calls count once); 2 GPUs at $3.60/GPU-hour = $7.20/h.
    sim = simulator("--capacity", "2", "--latency", "5.0", "--response-tokens", "40")
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
                               + "\n" for i in range(4)))
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    result = run_cli("run", "-d", str(dataset), "-s", sim.url, "-m", "sim-model", "--max-tokens",
                     "64", "--inflight", "2", "--gpus", "2", "--gpu-hour-price", "3.6", "--json",
                     env=env, check=False)
    assert result.returncode == 0, result.stderr
    cost = json.loads(result.stdout.strip().splitlines()[-1])["cost"]
    assert cost["tokens"] == 4 * 40
    rate = 80 / 5.0
    expected = 7.2 / (rate * 3600) * 1e6  # $/h ÷ (tok/s × 3600) × 10⁶ = $125.00
    assert cost["dollars_per_mtok"] == pytest.approx(expected, rel=0.05), cost
    assert cost["tokens_per_s"] == pytest.approx(rate, rel=0.05), cost
    assert cost["gpu_hours"] == pytest.approx(cost["busy_s"] * 2 / 3600)
    assert cost["dollars"] == pytest.approx(cost["gpu_hours"] * 3.6)
    assert cost["remaining_s"] == 0.0 and cost["remaining_dollars"] == 0.0


def test_bad_inflight_options_are_one_line(tmp_path: Path) -> None:
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")
    for args, message in (
            (["--inflight", "lots"], "--inflight must be a number of requests or 'auto'"),
            (["--inflight", "8", "--max-inflight", "16"], "go with --inflight auto"),
            (["--inflight", "auto", "--min-inflight", "64", "--max-inflight", "32"],
             "--min-inflight 64 is above --max-inflight 32"),
            (["--gpu-hour-price", "-1"], "--gpu-hour-price must be a price")):
        result = run_cli("enqueue", "-d", str(tmp_path / "none.jsonl"), "-s",
                         "http://127.0.0.1:9/v1", "-m", "m", *args, env=env, timeout=60,
                         check=False)
        assert result.returncode != 0
        assert message in result.stderr + result.stdout, result.stderr
        assert "Traceback" not in result.stderr

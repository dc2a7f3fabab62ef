"""The docs' "Training on a CPU, no vLLM" walkthrough (docs/engines.md), run as written
(tests/walkthrough.py) with fewer prompts and one epoch: the tiny target built, its
prompts written, answered by `synthq simulate` in the background, trained, and the
drafter where the docs say it lands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import child_env
from walkthrough import reduced, run_walkthrough, walkthrough

from synthq.testing.procs import free_port

pytestmark = [pytest.mark.training, pytest.mark.processes, pytest.mark.timeout(1200)]


def test_the_tiny_cpu_walkthrough_runs_as_written(tmp_path: Path) -> None:
    port = free_port()
    script = reduced(walkthrough("tiny-cpu"), [
        ("--train 300", "--train 40"), ("--epochs 4", "--epochs 1"),
        ("--port 8000", f"--port {port}"), (":8000/v1", f":{port}/v1")])
    env = child_env(SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="", HF_HUB_OFFLINE="1")
    env.pop("SYNTHQ_DATA_DIR", None)  # the walkthrough's ./synthq-data
    done = run_walkthrough(script, tmp_path, env, timeout=1000)
    assert done.returncode == 0, done.stdout[-6000:]
    final = tmp_path / "synthq-data" / "runs" / "t-run1" / "final"  # as the docs say
    assert (final / "model.safetensors").is_file(), done.stdout[-3000:]
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"], config
    assert re.search(r"^\+ \[\d+s\] kill %1$", done.stdout, re.M), done.stdout[-2000:]  # ran

"""The trained drafter served by the real vLLM: checkpoints its loader loads (draft
vocabulary equal to the target's: no d2t; smaller: d2t), and the acceptance vLLM's own
counters measure on the run's held-out prompts against synthq's estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import REPO, child_env

from synthq.testing.tiny import count_prompt, prompts
from synthq.testing.vllm import VllmServer, VllmStartError

# The first test also waits for the session's target and server (minutes on a busy
# machine): the suite's 300 s would cut it.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400),
              # one worker runs the tier (scripts/test.sh): one vLLM start
              pytest.mark.xdist_group("engine")]


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_drafters_trained_on_vllm_data_are_served_by_vllm_eagle3(
        engine: Any, tmp_path: Path) -> None:
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "state"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": count_prompt(*p)}]}) + "\n"
        for i, p in enumerate(prompts(400, 77))))
    status = _synthq(env, "run", "-d", str(data), "-s", engine.url, "-m", engine.name,
                     "--job", "gen", "--id-field", "id", "--max-tokens", "64",
                     "--temperature", "0", "--tokenizer", str(engine.target),
                     "--max-seq-len", "256", "--return-token-ids", "--inflight", "16",
                     "--json")
    assert status["token_mismatches"] == 0 and status["counts"]["done"] > 300, status

    runs = {}
    for label, vocab in (("equal", 100_000), ("smaller", 128)):
        row = _synthq(env, "train", "gen", "--target", str(engine.target),
                      "--draft-vocab-size", str(vocab), "--epochs", "3", "--batch-size", "8",
                      "--lr", "2e-3", "--out", str(tmp_path / label), "--json")
        assert row["state"] == "done", row
        runs[label] = row
    from safetensors import safe_open

    for label, row in runs.items():
        with safe_open(str(Path(row["checkpoint"]) / "model.safetensors"), "pt") as f:
            names = set(f.keys())  # noqa: SIM118 - safe_open has no __contains__
        assert ("d2t" in names) == (label == "smaller"), (label, sorted(names))

    # Both servers at once: each cold start is minutes on this machine.
    servers = {label: VllmServer.start(
        engine.target, engine.name, log_path=tmp_path / f"vllm-{label}.log",
        speculative={"method": "eagle3", "model": row["checkpoint"],
                     "num_speculative_tokens": 4}) for label, row in runs.items()}
    try:
        for label, server in servers.items():
            try:
                server.wait_ready(timeout=1200)
            except VllmStartError as exc:
                pytest.fail(f"vLLM did not load the {label}-vocabulary checkpoint: {exc}",
                            pytrace=False)
        for label, server in servers.items():
            check = _synthq(env, "serve-check", str(runs[label]["id"]), "-s",
                            server.base_url, "-m", engine.name, "--json")
            served, own = check["served_acceptance_length"], check["eval_acceptance_length"]
            assert check["engine"] == "vllm" and check["version"] == "0.32.0"
            assert check["drafts"] > 100, check
            assert served >= 2.0, (label, check)
            assert abs(served - own) <= 0.3, (label, check)
    finally:
        for server in servers.values():
            server.stop()
    # Stored on the runs, beside synthq's own estimate.
    listed = {r["id"]: r for r in _synthq(env, "runs", "gen", "--json")}
    for row in runs.values():
        stored = listed[row["id"]]
        assert stored["served_acceptance_length"] >= 2.0
        assert (stored["served_engine"], stored["served_engine_version"]) == ("vllm", "0.32.0")

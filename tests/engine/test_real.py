"""A real model through the whole pipeline, reduced to the suite's budget: SmolLM2-135M-
Instruct (``synthq testing real-target``) served by vLLM, on real prompts (the standard
library's docstrings).

Generation through vLLM (streamed), masks checked against the template (its injected
system turn never supervised), capture through vLLM at the default layers [2, 15, 27,
30], training with a draft vocabulary smaller than the target's (d2t) on captured and
on online features, and the captured-features checkpoint served by vLLM's EAGLE-3,
acceptance from its counters. Figures (acceptance against ngram and suffix, the data
curve) are ``scripts/check_real.py``'s and ``bench/engine.py``'s, not this test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import REPO, child_env

from synthq.testing.vllm import VllmServer, VllmStartError, start_capture_server

# Three vLLM cold starts (two at once) on a busy machine: minutes.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400),
              # one worker runs the tier (scripts/test.sh): one vLLM start
              pytest.mark.xdist_group("engine")]

NAME = "smol"
PROMPTS = 24
LAYERS = [2, 15, 27, 30]


@pytest.fixture(scope="session")
def real_target() -> Path:
    """The folder built from the wheel, cached by the code that builds it."""
    if given := os.environ.get("SYNTHQ_ENGINE_REAL_TARGET"):
        return Path(given)
    from synthq.testing.real import cached_real_target

    return cached_real_target()


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    if args[0] == "capture":  # its JSON is indented, after the plan's line
        return json.loads(out.stdout[out.stdout.index("{"):])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ready(*servers: VllmServer) -> None:
    for server in servers:
        try:
            server.wait_ready(timeout=1500)
        except VllmStartError as exc:
            pytest.fail(f"vLLM did not serve the real target: {exc}", pytrace=False)


def test_real_model_generation_masks_capture_training_and_served_acceptance(
        real_target: Path, tmp_path: Path) -> None:
    from synthq.testing.docprompts import write_prompt_set
    from synthq.testing.real import SYSTEM_TURN, check_masks

    config = json.loads((real_target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        (30, 576, 49_152)
    assert "quantization_config" not in config  # vLLM must read plain fp32 weights

    # Both cold starts at once: generation's server and the capture server.
    plain = VllmServer.start(real_target, NAME, log_path=tmp_path / "vllm-plain.log",
                             max_model_len=1024)
    capturer = start_capture_server(real_target, NAME, layers=LAYERS,
                                    engine_dir=tmp_path / "engine",
                                    log_path=tmp_path / "vllm-capture.log", max_model_len=1024)
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "state"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1")
    try:
        _ready(plain, capturer)
        write_prompt_set(tmp_path / "prompts", train=PROMPTS, held_out=1)
        status = _synthq(env, "run", "-d", str(tmp_path / "prompts" / "train.jsonl"), "-s",
                         plain.base_url, "-m", NAME, "--job", "docs", "--id-field", "id",
                         "--max-tokens", "32", "--temperature", "0", "--keep-truncated",
                         "--tokenizer", str(real_target), "--max-seq-len", "512",
                         "--return-token-ids", "--stream", "--inflight", "12", "--json")
        assert status["counts"]["done"] == PROMPTS, status
        # A real model may write a token sequence its tokenizer would not produce for the
        # same text (the answer is retokenized): counted, not zero by construction.
        assert status["token_mismatches"] <= PROMPTS // 4, status

        _synthq(env, "export", "docs", "--format", "parquet", "--out", str(tmp_path / "out"),
                "--json")
        masks = check_masks(tmp_path / "out", real_target)
        assert masks["examples"] == PROMPTS and masks["supervised"] > PROMPTS * 10, masks
        assert "You are a helpful AI assistant named SmolLM" in SYSTEM_TURN

        captured = _synthq(env, "capture", "docs", "--server", capturer.base_url,
                           "--target", str(real_target), "--json")
        assert captured["done"] == PROMPTS and captured["failures"] == {}, captured
    finally:
        plain.stop()
        capturer.stop()

    runs = {}
    for features, extra in (("captured", ["--epochs", "1"]),
                            ("online", ["--epochs", "1", "--max-steps", "2"])):
        row = _synthq(env, "train", "docs", "--target", str(real_target), "--hidden-states",
                      features, "--draft-vocab-size", "512", "--batch-size", "4",
                      "--lr", "1e-3", "--ttt-steps", "3", "--max-len", "256",
                      "--eval-fraction", "0.1", "--eval-draft-tokens", "3",
                      "--eval-max-new", "32", "--out", str(tmp_path / features), "--json",
                      *extra)
        assert row["state"] == "done", row
        final = Path(row["checkpoint"])
        cfg = json.loads((final / "config.json").read_text())
        assert cfg["draft_vocab_size"] == 512 < cfg["vocab_size"] == 49_152
        assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYERS[:3]
        from safetensors import safe_open

        with safe_open(str(final / "model.safetensors"), "pt") as f:
            assert "d2t" in set(f.keys())  # noqa: SIM118 - safe_open has no __contains__
        runs[features] = row

    server = VllmServer.start(real_target, NAME, log_path=tmp_path / "vllm-eagle3.log",
                              max_model_len=1024, speculative={
                                  "method": "eagle3", "model": runs["captured"]["checkpoint"],
                                  "num_speculative_tokens": 3})
    try:
        _ready(server)
        check = _synthq(env, "serve-check", str(runs["captured"]["id"]), "-s",
                        server.base_url, "-m", NAME, "--json")
    finally:
        server.stop()
    assert (check["engine"], check["version"]) == ("vllm", "0.32.0")
    assert check["drafts"] > 0 and check["served_acceptance_length"] >= 1.0, check
    print(f"served acceptance {check['served_acceptance_length']:.2f}, the run's own "
          f"{check['eval_acceptance_length']:.2f} ({check['prompts']} held-out prompts)")

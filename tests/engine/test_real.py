"""A real model through the whole pipeline, reduced to the suite's budget: the README's
walkthrough "A real model on a CPU, in minutes", run as written (tests/walkthrough.py)
with fewer prompts and tokens: SmolLM2-135M-Instruct (``synthq testing real-target``)
served by vLLM, on real prompts (the standard library's docstrings), a drafter trained
on online features with a draft vocabulary smaller than the target's (d2t), served by
vLLM's EAGLE-3, ``serve-check`` started while vLLM still loads it.

On the walkthrough's own data, beside its later steps: masks checked against the
template (its injected system turn never supervised) and capture through a capture
server at the default layers [2, 15, 27, 30] (started beside the walkthrough's first
server) once its generation is done, and training on the captured features once its
run 1 is trained. Figures (acceptance against ngram and suffix, the data curve) are
``scripts/check_real.py``'s and ``bench/engine.py``'s, not this test's.
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
from walkthrough import reduced, start_walkthrough, walkthrough

from synthq.testing.procs import free_port
from synthq.testing.vllm import VllmServer, VllmStartError, start_capture_server

# Three vLLM cold starts (two at once) on a busy machine: minutes.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400),
              # a group of its own (scripts/test.sh): its vLLM starts go on beside the
              # other engine groups'
              pytest.mark.xdist_group("engine-real")]

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


def _synthq(env: dict[str, str], *args: str, cwd: Path = REPO) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=cwd,
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
    from synthq.testing.real import SYSTEM_TURN, check_masks

    config = json.loads((real_target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        (30, 576, 49_152)
    assert "quantization_config" not in config  # vLLM must read plain fp32 weights

    # The capture server's cold start overlaps the walkthrough's (the same weights: the
    # cached build of what the walkthrough's first line builds).
    capturer = start_capture_server(real_target, NAME, layers=LAYERS,
                                    engine_dir=tmp_path / "engine",
                                    log_path=tmp_path / "vllm-capture.log", max_model_len=1024)
    work = tmp_path / "walk"
    ports = {8000: free_port(), 8001: free_port()}
    script = reduced(walkthrough("real-cpu"), [
        ("--train 250", f"--train {PROMPTS}"), ("--max-tokens 128", "--max-tokens 32"),
        ("--port 8000", f"--port {ports[8000]}"), (":8000/v1", f":{ports[8000]}/v1"),
        ("--port 8001", f"--port {ports[8001]}"), (":8001/v1", f":{ports[8001]}/v1")])
    env = child_env(SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("SYNTHQ_DATA_DIR", None)  # the walkthrough's ./synthq-data
    # The test's own steps on the walkthrough's data go beside the walkthrough's later
    # ones: masks and capture once its `synthq run` is done (beside its training), the
    # training on the captured features once its run 1 is trained (beside its second
    # server's cold start and serve-check).
    walk = start_walkthrough(script, work, env)
    try:
        walk.reached("synthq train docs", timeout=2000)
        try:
            _ready(capturer)
            target = work / "synthq-data" / "smol"
            status = _synthq(env, "status", "docs", "--json", cwd=work)
            assert status["counts"]["done"] == PROMPTS, status
            # A real model may write a token sequence its tokenizer would not produce for
            # the same text (the answer is retokenized): counted, not zero by construction.
            assert status["token_mismatches"] <= PROMPTS // 4, status

            _synthq(env, "export", "docs", "--format", "parquet", "--out",
                    str(tmp_path / "out"), "--json", cwd=work)
            masks = check_masks(tmp_path / "out", target)
            assert masks["examples"] == PROMPTS and masks["supervised"] > PROMPTS * 10, masks
            assert "You are a helpful AI assistant named SmolLM" in SYSTEM_TURN

            captured = _synthq(env, "capture", "docs", "--server", capturer.base_url,
                               "--target", str(target), "--json", cwd=work)
            assert captured["done"] == PROMPTS and captured["failures"] == {}, captured
        finally:
            capturer.stop()

        # The walkthrough's run 1 (online features, draft vocabulary 4096), then one on the
        # captured features.
        walk.reached("synthq serve-check 1", timeout=2000)
        row = _synthq(env, "train", "docs", "--target", str(target), "--hidden-states",
                      "captured", "--draft-vocab-size", "512", "--batch-size", "4",
                      "--lr", "1e-3", "--ttt-steps", "3", "--max-len", "256",
                      "--eval-fraction", "0.1", "--eval-draft-tokens", "3",
                      "--eval-max-new", "32", "--epochs", "1",
                      "--out", str(tmp_path / "captured"), "--json", cwd=work)
        done = walk.wait(timeout=2000)
    finally:
        walk.stop()
    assert done.returncode == 0, done.stdout[-6000:]
    assert row["state"] == "done", row
    runs = {r["id"]: r for r in _synthq(env, "runs", "docs", "--json", cwd=work)}
    assert set(runs) == {1, row["id"]}, runs
    from safetensors import safe_open

    for run, vocab in ((runs[1], 4096), (runs[row["id"]], 512)):
        assert run["state"] == "done", run
        final = Path(run["checkpoint"])
        cfg = json.loads((final / "config.json").read_text())
        assert cfg["draft_vocab_size"] == vocab < cfg["vocab_size"] == 49_152
        assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYERS[:3]
        with safe_open(str(final / "model.safetensors"), "pt") as f:
            assert "d2t" in set(f.keys())  # noqa: SIM118 - safe_open has no __contains__

    # The walkthrough's serve-check stored vLLM's figure on run 1.
    served = runs[1]
    assert (served["served_engine"], served["served_engine_version"]) == ("vllm", "0.32.0")
    assert served["served_acceptance_length"] >= 1.0, served
    print(f"served acceptance {served['served_acceptance_length']:.2f}, the run's own "
          f"{served.get('eval_acceptance_length')}")

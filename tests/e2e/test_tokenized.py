"""Training data end to end: a real tokenizer, the simulator over HTTP, the CLI as a
user runs it, Parquet read back through `datasets`; retokenize across real Celery
worker processes with zero calls to the server."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pytest
from sqlalchemy import select
from support import child_env, counts, run_cli, wait_for

from synthq.store.db import session_scope
from synthq.store.models import Sample

pytestmark = pytest.mark.e2e


def test_run_then_export_parquet_reads_back_in_datasets(simulator: Callable[..., Any],
                                                        tmp_path: Path) -> None:
    import datasets
    from transformers import AutoTokenizer

    sim = simulator("--latency", "0", "--reasoning", "--response-tokens", "24")
    tokenizer = ct.qwen3(tmp_path)
    data = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"问题 {i}: what is {i} squared? 🤔"}]}
            for i in range(30)]
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "state"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="")

    def synthq(*args: str) -> subprocess.CompletedProcess[str]:
        out = run_cli(*args, env=env, timeout=180, check=False)
        assert out.returncode == 0, out.stderr + out.stdout
        return out

    run = synthq("run", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--job", "tok",
                 "--tokenizer", tokenizer, "--max-seq-len", "512", "--json")
    assert json.loads(run.stdout.splitlines()[-1])["counts"]["done"] == 30
    out = tmp_path / "export"
    manifest = json.loads(synthq("export", "tok", "--format", "parquet", "--out", str(out),
                                 "--shard-size", "8", "--json").stdout)
    assert manifest["exported"] == 30 and len(manifest["shards"]) == 4
    ds = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train")
    assert len(ds) == 30
    tok = AutoTokenizer.from_pretrained(tokenizer)
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]) <= 512
        answer = row["conversations"][-1]
        assert answer["role"] == "assistant"
        supervised = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(supervised) == (f"<think>\n{answer['reasoning_content']}\n</think>"
                                          f"\n\n{answer['content']}<|im_end|>")
    # The JSONL layout SpecForge reads.
    jsonl = tmp_path / "jsonl"
    synthq("export", "tok", "--format", "jsonl", "--out", str(jsonl))
    lines = [json.loads(line) for shard in sorted(jsonl.glob("*.jsonl"))
             for line in shard.read_text().splitlines()]
    assert len(lines) == 30 and [m["role"] for m in lines[0]["conversations"]] == \
        ["system", "user", "assistant"]


def test_retokenize_runs_on_worker_processes_without_server_calls(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any],
        tmp_path: Path) -> None:
    sim = simulator("--latency", "0", "--response-tokens", "40")
    tokenizer = ct.qwen3(tmp_path)
    n = 120
    report = job_factory([f"retok {i}" for i in range(n)], servers=[sim.url],
                         tokenizer=tokenizer, inflight_limit=16)
    first, second = workers.worker(concurrency=4, name="a"), workers.worker(concurrency=4,
                                                                           name="b")
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] == n, 90, workers.logs())
    requests = sim.stats()["requests"]
    result = run_cli("retokenize", report.job_name, "--max-seq-len", "30", "--batch-size", "10",
                     timeout=180, check=False)
    assert result.returncode == 0, result.stderr + result.stdout + workers.logs()
    assert "tokenize_version 2" in result.stdout
    with session_scope() as s:
        smps = s.scalars(select(Sample)).all()
    assert all(x.tokenize_version == 2 and x.num_tokens <= 30 for x in smps if x.state == "done")
    assert sim.stats()["requests"] == requests  # no generation was paid for twice
    # The batches were spread over both worker processes.
    assert "synthq.retokenize" in first.log() and "synthq.retokenize" in second.log()

"""`synthq export` against real PostgreSQL: Parquet/JSONL round trips, manifest, atomicity."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, update
from support import run_cli

from synthq.core.errors import UserError
from synthq.core.packing import pack_ids, pack_mask
from synthq.jobs import export as export_mod
from synthq.jobs.export import export_job, tokenizer_fingerprint
from synthq.store.db import get_engine, session_scope, utcnow
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration


def make_job(job_factory: Callable[..., Any], *, tokenizer: str | None = "test-tokenizer",
             **columns: Any) -> int:
    job_id: int = job_factory([]).job_id
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            tokenizer=tokenizer, tokenize_version=1, **columns))
    return job_id


def example(i: int, n: int | None = None) -> dict[str, Any]:
    """Columns of a done, tokenized sample: ``n`` tokens, the last half supervised."""
    n = n if n is not None else 5 + 3 * i
    ids = [1000 * i + k for k in range(n)]
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    prompt = [{"role": "user", "content": f"question {i}"}]
    if i % 3 == 0:  # a multi-turn prompt with a system message
        prompt = [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  *prompt]
    return dict(prompt=prompt, response_content=f"answer {i} ✓", input_ids=pack_ids(ids),
                loss_mask=pack_mask(mask), num_tokens=n, num_supervised=sum(mask),
                tokenize_version=1, finish_reason="stop")


def unpacked(columns: dict[str, Any]) -> tuple[list[int], list[int]]:
    import numpy as np

    ids = np.frombuffer(columns["input_ids"], dtype="<i4").tolist()
    mask = np.unpackbits(np.frombuffer(columns["loss_mask"], dtype=np.uint8),
                         count=len(ids)).tolist()
    return ids, mask


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def populated(job_factory: Callable[..., Any],
              sample_factory: Callable[..., int]) -> tuple[int, dict[int, dict[str, Any]]]:
    """A tokenizer job: 7 done samples (one with reasoning), one failed, skipped, pending."""
    job_id = make_job(job_factory)
    done: dict[int, dict[str, Any]] = {}
    for i in range(7):
        columns = example(i)
        if i == 1:
            columns["reasoning_content"] = "let me think"
        done[sample_factory("done", job_id=job_id, **columns)] = columns
    sample_factory("failed", job_id=job_id, error_class="timeout", error_message="slow")
    sample_factory("skipped", job_id=job_id, prompt=None, error_class="invalid_input")
    sample_factory("pending", job_id=job_id)
    return job_id, done


def test_parquet_shards_read_back_with_datasets(
        pg: str, populated: tuple[int, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    import datasets

    job_id, done = populated
    out = tmp_path / "exports" / "run1"
    seen: list[tuple[int, int]] = []
    manifest = export_job(job_id, out, fmt="parquet", shard_size=3,
                          progress=lambda n, total: seen.append((n, total)))

    files = sorted(p.name for p in out.iterdir())
    assert files == ["data-00000-of-00003.parquet", "data-00001-of-00003.parquet",
                     "data-00002-of-00003.parquet", "manifest.json"]
    assert seen[-1] == (7, 7)
    assert leftovers(out.parent) == []

    data = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train",
                                 cache_dir=str(tmp_path / "hf-cache"))
    assert data.num_rows == 7
    assert set(data.column_names) == {"id", "source_id", "input_ids", "loss_mask",
                                      "conversations", "tools", "tool_choice",
                                      "finish_reason", "turn"}
    assert data["source_id"] == [None] * 7  # these rows had no id of their own
    assert data["id"] == [str(i) for i in sorted(done)]  # id order across shards
    for row in data:
        columns = done[int(row["id"])]
        ids, mask = unpacked(columns)
        assert row["input_ids"] == ids
        assert row["loss_mask"] == mask and len(row["loss_mask"]) == len(row["input_ids"])
        conv = row["conversations"]
        assert [m["role"] for m in conv[:-1]] == [m["role"] for m in columns["prompt"]]
        assert [m["content"] for m in conv[:-1]] == [m["content"] for m in columns["prompt"]]
        assert conv[-1]["role"] == "assistant"
        assert conv[-1]["content"] == columns["response_content"]
        assert conv[-1]["reasoning_content"] == columns.get("reasoning_content")
        assert conv[-1]["finish_reason"] == row["finish_reason"] == "stop"
        assert row["turn"] is None

    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest.to_dict()
    assert on_disk["format"] == "parquet"
    assert on_disk["counts"] == {"pending": 1, "queued": 0, "running": 0, "done": 7,
                                 "failed": 1, "skipped": 1}
    assert on_disk["exported"] == 7
    assert on_disk["excluded"] == {"stale": 0, "truncated": 0}
    assert on_disk["shards"] == [
        {"file": "data-00000-of-00003.parquet", "rows": 3},
        {"file": "data-00001-of-00003.parquet", "rows": 3},
        {"file": "data-00002-of-00003.parquet", "rows": 1}]
    assert on_disk["num_tokens"] == sum(c["num_tokens"] for c in done.values())
    assert on_disk["num_supervised"] == sum(c["num_supervised"] for c in done.values())
    assert on_disk["tokenizer"] == "test-tokenizer"
    # Neither a local directory nor in the HF cache: unknown, and nothing was downloaded.
    assert on_disk["tokenizer_hash"] is None and on_disk["chat_template_hash"] is None
    assert on_disk["settings"]["tokenize_version"] == 1
    assert on_disk["settings"]["model"] == "sim-model"
    assert on_disk["settings"]["reasoning"] == "auto"  # made without enqueue: unresolved
    assert on_disk["job"]["id"] == job_id
    assert on_disk["synthq_version"] and on_disk["created_at"].endswith("+00:00")


def test_jsonl_round_trip_and_reasoning_setting(
        pg: str, populated: tuple[int, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    job_id, done = populated
    manifest = export_job(job_id, tmp_path / "j", fmt="jsonl", shard_size=4)
    assert [s["file"] for s in manifest.shards] == ["data-00000-of-00002.jsonl",
                                                    "data-00001-of-00002.jsonl"]
    lines = [json.loads(line) for shard in manifest.shards
             for line in (tmp_path / "j" / shard["file"]).read_text().splitlines()]
    assert len(lines) == 7 == manifest.exported
    for obj in lines:
        assert set(obj) == {"id", "source_id", "conversations", "finish_reason"}
        columns = done[int(obj["id"])]
        assert obj["conversations"][:-1] == columns["prompt"]
        answer = {"role": "assistant", "content": columns["response_content"]}
        assert obj["finish_reason"] == "stop"
        if "reasoning_content" in columns:
            answer["reasoning_content"] = columns["reasoning_content"]
        assert obj["conversations"][-1] == answer

    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(reasoning="drop"))
    dropped = export_job(job_id, tmp_path / "d", fmt="jsonl")
    text = (tmp_path / "d" / dropped.shards[0]["file"]).read_text()
    assert "reasoning_content" not in text and "let me think" not in text


def test_job_without_tokenizer_exports_jsonl_only(
        pg: str, job_factory: Callable[..., Any], sample_factory: Callable[..., int],
        tmp_path: Path) -> None:
    job_id = make_job(job_factory, tokenizer=None)
    for i in range(3):
        sample_factory("done", job_id=job_id, prompt=[{"role": "user", "content": f"q{i}"}],
                       response_content=f"a{i}")
    with pytest.raises(UserError, match="job has no tokenizer: parquet needs input_ids; use "
                       "--format jsonl or set one with synthq retokenize"):
        export_job(job_id, tmp_path / "p", fmt="parquet")
    assert not (tmp_path / "p").exists()

    manifest = export_job(job_id, tmp_path / "j", fmt="jsonl")
    assert manifest.exported == 3
    assert manifest.num_tokens is None and manifest.tokenizer is None
    rows = [json.loads(x) for x in (tmp_path / "j" / manifest.shards[0]["file"]).open()]
    assert [r["conversations"][-1]["content"] for r in rows] == ["a0", "a1", "a2"]


def test_stale_samples_are_refused(pg: str, job_factory: Callable[..., Any],
                                   sample_factory: Callable[..., int], tmp_path: Path) -> None:
    job_id = make_job(job_factory)
    ids = [sample_factory("done", job_id=job_id, **example(i)) for i in range(4)]
    with session_scope() as s:  # retokenize under way: version 2, one sample redone so far
        s.execute(update(Job).where(Job.id == job_id).values(tokenize_version=2))
        s.execute(update(Sample).where(Sample.id == ids[0]).values(tokenize_version=2))
        s.execute(update(Sample).where(Sample.id == ids[1]).values(
            input_ids=None, loss_mask=None, tokenize_version=None))
    with pytest.raises(UserError, match=r"3 of 4 done samples are not tokenized at the job's "
                       r"current tokenize_version 2: wait for `synthq retokenize`"):
        export_job(job_id, tmp_path / "out", fmt="parquet")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []

    manifest = export_job(job_id, tmp_path / "out", fmt="parquet", allow_stale=True)
    assert manifest.exported == 1 and manifest.excluded["stale"] == 3
    assert manifest.num_tokens == example(0)["num_tokens"]
    # JSONL carries no tokens: every done sample's conversation is current.
    assert export_job(job_id, tmp_path / "j", fmt="jsonl").exported == 4


def test_truncated_answers_can_be_left_out(pg: str, job_factory: Callable[..., Any],
                                           sample_factory: Callable[..., int],
                                           tmp_path: Path) -> None:
    job_id = make_job(job_factory)
    for i in range(3):
        sample_factory("done", job_id=job_id, **{**example(i), "finish_reason":
                                                 "length" if i == 2 else "stop"})
    assert export_job(job_id, tmp_path / "a").exported == 3
    kept = export_job(job_id, tmp_path / "b", include_truncated=False)
    assert kept.exported == 2 and kept.excluded == {"stale": 0, "truncated": 1}


def test_existing_directory_is_refused_and_untouched(
        pg: str, populated: tuple[int, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    job_id, _ = populated
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists; choose a new directory or pass --overwrite"):
        export_job(job_id, out)
    with pytest.raises(UserError, match="not a synthq export"):
        export_job(job_id, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_job(job_id, empty, shard_size=100).exported == 7

    first = export_job(job_id, tmp_path / "again", shard_size=100)
    assert len(first.shards) == 1
    with pytest.raises(UserError, match="pass --overwrite"):
        export_job(job_id, tmp_path / "again", shard_size=2)
    second = export_job(job_id, tmp_path / "again", shard_size=2, overwrite=True)
    assert len(second.shards) == 4
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(
        [s["file"] for s in second.shards] + ["manifest.json"])
    assert leftovers(tmp_path) == []


def test_error_mid_export_leaves_nothing(
        pg: str, populated: tuple[int, dict[int, dict[str, Any]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    job_id, _ = populated
    real = pq.ParquetWriter
    opened: list[str] = []

    def writer(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(path))
        if len(opened) == 2:  # the first shard is complete
            raise OSError("disk full")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetWriter", writer)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        export_job(job_id, out, shard_size=3)
    assert len(opened) == 2
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temp directory either


def test_export_streams_in_pages(pg: str, job_factory: Callable[..., Any], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = make_job(job_factory)
    now = utcnow()
    rows = [dict(job_id=job_id, content_key=hashlib.sha256(str(i).encode()).hexdigest(),
                 dataset_index=i, state="done", attempts=1, created_at=now, updated_at=now,
                 **example(i % 50, n=8)) for i in range(2500)]
    with session_scope() as s:
        s.execute(insert(Sample), rows)
    monkeypatch.setattr(export_mod, "BATCH", 1000)

    pages: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM samples" in statement and "ORDER BY samples.id" in statement:
            pages.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", count)
    try:
        manifest = export_job(job_id, tmp_path / "out", shard_size=1000)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert manifest.exported == 2500 and [s["rows"] for s in manifest.shards] == [1000] * 2 + [500]
    assert len(pages) == 3  # three pages of at most 1,000 rows, never one query for all
    assert all("LIMIT" in p and "samples.id >" in p for p in pages)
    assert manifest.num_tokens == 2500 * 8


def test_export_is_one_snapshot(pg: str, job_factory: Callable[..., Any],
                                sample_factory: Callable[..., int], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples finishing while the export runs are in neither the counts nor the shards."""
    job_id = make_job(job_factory)
    for i in range(5):
        sample_factory("done", job_id=job_id, **example(i))
    monkeypatch.setattr(export_mod, "BATCH", 2)
    late: list[int] = []

    def progress(n: int, total: int) -> None:
        if not late:  # after the first page: workers finish three more
            late.extend(sample_factory("done", job_id=job_id, **example(10 + i))
                        for i in range(3))

    manifest = export_job(job_id, tmp_path / "out", fmt="jsonl", progress=progress)
    assert len(late) == 3
    assert manifest.exported == 5 == manifest.counts["done"]
    ids = [json.loads(x)["id"] for x in (tmp_path / "out" / manifest.shards[0]["file"]).open()]
    assert not set(ids) & {str(i) for i in late}


def test_tokenizer_fingerprint_of_a_local_tokenizer(
        pg: str, populated: tuple[int, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    core = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                            chat_template=template).save_pretrained(path)

    found = tokenizer_fingerprint(str(path))
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    assert found["tokenizer_hash"] == digest.hexdigest()
    assert found["chat_template_hash"] == hashlib.sha256(template.encode()).hexdigest()
    assert found["chat_template_source"] == "tokenizer"

    override = tokenizer_fingerprint(str(path), chat_template="mine")
    assert override["chat_template_hash"] == hashlib.sha256(b"mine").hexdigest()
    assert override["chat_template_source"] == "job"
    assert tokenizer_fingerprint("no-such/tokenizer")["tokenizer_hash"] is None
    assert tokenizer_fingerprint(None)["chat_template_hash"] is None

    job_id, _ = populated
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(tokenizer=str(path)))
    manifest = export_job(job_id, tmp_path / "out", fmt="jsonl")
    assert manifest.tokenizer_hash == found["tokenizer_hash"]
    assert manifest.chat_template_hash == found["chat_template_hash"]


def synthq(*args: str) -> subprocess.CompletedProcess[str]:
    result = run_cli(*args, check=False)
    if "--json" not in args:  # rich wraps long lines at the terminal width
        result.stdout, result.stderr = (" ".join(result.stdout.split()),
                                        " ".join(result.stderr.split()))
    return result


def test_cli_export(pg: str, populated: tuple[int, dict[int, dict[str, Any]]],
                    tmp_path: Path) -> None:
    job_id, _ = populated
    out = tmp_path / "cli"
    result = synthq("export", str(job_id), "--format", "jsonl", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    manifest = json.loads(result.stdout)
    assert manifest["exported"] == 7 and manifest["format"] == "jsonl"
    assert manifest == json.loads((out / "manifest.json").read_text())

    again = synthq("export", str(job_id), "--format", "jsonl", "--out", str(out))
    assert again.returncode == 2 and "pass --overwrite" in again.stderr

    human = synthq("export", str(job_id), "--out", str(tmp_path / "pq"), "--shard-size", "5")
    assert human.returncode == 0, human.stderr + human.stdout
    assert "exported 7 samples" in human.stdout and "2 parquet shard(s)" in human.stdout

    for args, message in [(("--format", "csv"), "--format must be one of parquet, jsonl"),
                          (("--shard-size", "0"), "--shard-size must be at least 1")]:
        bad = synthq("export", str(job_id), "--out", str(tmp_path / "bad"), *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()
    missing = synthq("export", "no-such-job", "--out", str(tmp_path / "bad"))
    assert missing.returncode == 2 and "no job 'no-such-job'" in missing.stderr

"""Issue 11 on real PostgreSQL, real tokenizers and the simulator over HTTP: the prompt
ends with the last user turn, the dataset's own ids reach both exports, a tokenizer
that loses characters is refused at enqueue, and the JSONL export loads into the
features SpecForge reads."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chat_tokenizers as ct
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select, update
from support import run_cli

from synthq.app.embedded import run_job
from synthq.jobs.enqueue import JobSpec, enqueue, get_or_create_job
from synthq.jobs.export import export_job
from synthq.jobs.samplecopy import insert_rows
from synthq.store.db import session_scope
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


synthq = run_cli


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def words(messages: list[dict[str, str]]) -> int:
    """The simulator's prompt_tokens: whitespace-separated words of every message."""
    return sum(len(m["content"].split()) for m in messages)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return ct.llama3(tmp_path_factory.mktemp("tok"))


# --- the prompt rule ---------------------------------------------------------------------


def _others(warnings: list[str]) -> list[str]:
    """The warnings but the one every job without a tokenizer gets at enqueue."""
    return [w for w in warnings if "has no tokenizer" not in w]


def test_the_request_ends_with_the_last_user_turn(
        pg: str, simulator: Callable[..., Any], tmp_path: Path) -> None:
    sim = simulator("--latency", "0")
    follow_up = [msg("system", "Answer plainly."), msg("user", "Name a fantasy city."),
                 msg("assistant", "Ashgrove."),
                 msg("user", "Describe Ashgrove in detail please.")]
    answered = [msg("system", "Be brief."), msg("user", "What is a prime?"),
                msg("assistant", "A number with two divisors."),
                msg("user", "Is seven prime or not?"), msg("assistant", "Yes.")]
    path = write_jsonl(tmp_path / "turns.jsonl", [{"id": "follow-up", "messages": follow_up},
                                                  {"id": "answered", "messages": answered}])
    spec = JobSpec(name="turns", model="sim-model", servers=[sim.url], max_tokens=512)
    report = enqueue(spec, str(path))
    assert (report.inserted, report.key_version, _others(report.warnings)) == (2, 2, [])
    run_job(report.job_id)

    # [system, user, assistant, user]: sent whole, ending with the final question.
    # [system, user, assistant, user, assistant]: ending with the second user message.
    expected = {"follow-up": follow_up, "answered": answered[:4]}
    with session_scope() as s:
        samples = {smp.source_id: smp for smp in s.scalars(select(Sample))}
        for sid, prompt in expected.items():
            smp = samples[sid]
            assert smp.state == "done" and smp.prompt == prompt
            # The simulator counts every word it was sent: exactly these messages.
            assert smp.prompt_tokens == words(prompt)
            # ... and echoes the last user message it was sent.
            assert smp.response_content.startswith(prompt[-1]["content"].split()[0])
    # The last user message of each request, as the simulator received it.
    assert sim.stats()["prompts"] == {follow_up[-1]["content"]: 1, answered[3]["content"]: 1}


def test_an_old_job_keeps_its_rule_and_says_so(pg: str, tmp_path: Path) -> None:
    rows = [{"id": "demo-001", "messages": [msg("system", "s"), msg("user", "Name a city."),
                                            msg("assistant", "Ashgrove."),
                                            msg("user", "Describe it.")]},
            {"id": "demo-002", "prompt": "Plain question?"}]
    path = write_jsonl(tmp_path / "old.jsonl", rows)
    # A job as synthq made it before key versions: rule 1 prompts and keys.
    from synthq.data.dataset import iter_rows
    from synthq.jobs.enqueue import EnqueueReport

    spec = JobSpec(name="old", model="m", servers=["http://127.0.0.1:9/v1"])
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, spec)
        job.key_version = 1
        job_id, settings = job.id, job.generation_settings()
    insert_rows(job_id, settings, iter_rows(str(path), key_version=1),
                EnqueueReport(job_id=job_id, job_name="old", created=True), key_version=1)

    args = ["enqueue", "-d", str(path), "-s", "http://127.0.0.1:9/v1", "-m", "m"]
    again = json.loads(synthq(*args, "--job", "old", "--json").stdout)
    assert (again["inserted"], again["duplicates"], again["key_version"]) == (0, 2, 1)
    assert len(_others(again["warnings"])) == 1
    assert "prompt rule 1" in _others(again["warnings"])[0]
    human = synthq(*args, "--job", "old")
    assert "nothing new to add" in human.stdout
    assert "warning:" in human.stderr and "prompt rule 1" in human.stderr

    new = json.loads(synthq(*args, "--job", "new", "--json").stdout)
    assert (new["inserted"], new["key_version"], _others(new["warnings"])) == (2, 2, [])
    with session_scope() as s:
        prompts = {(smp.job_id, smp.source_id): smp.prompt for smp in s.scalars(select(Sample))}
    assert prompts[(job_id, "demo-001")][-1] == msg("user", "Name a city.")
    assert prompts[(new["job_id"], "demo-001")][-1] == msg("user", "Describe it.")


def test_migration_makes_existing_jobs_key_version_1(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text

    from synthq.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0005")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (name, model, servers, sampling, extra_body, max_tokens, "
            "total_timeout, stall_timeout, max_attempts, backoff_base, backoff_cap, "
            "inflight_limit, keep_truncated, state, dataset, chat_template_kwargs, "
            "max_seq_len, reasoning, think_open, think_close, mask, tokenize_version, "
            "created_at, updated_at) VALUES ('j', 'm', '[]', '{}', '{}', 1, 1, 1, 1, 1, 1, 1, "
            "0, 'active', '', '{}', 8, 'keep', '', '', 'last_turn', 1, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00')"))
    upgrade(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT key_version FROM jobs")).scalar_one() == 1
    engine.dispose()


# --- source ids --------------------------------------------------------------------------


def _write_source(form: str, tmp_path: Path) -> Path:
    """Four rows with their ids in four different fields, and one without an id."""
    questions = [f"question number {i} about rivers" for i in range(5)]
    ids: list[tuple[str, Any]] = [("id", "row-a"), ("uuid", "6f1c-uuid"),
                                  ("conversation_id", 77), ("sample_id", "row-d")]
    if form == "parquet":
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.table({
            "messages": [[msg("user", q)] for q in questions],
            "id": ["row-a", None, None, None, None],
            "uuid": [None, "6f1c-uuid", None, None, None],
            "conversation_id": pa.array([None, None, 77, None, None], pa.int64()),
            "sample_id": [None, None, None, "row-d", None]}), path)
        return path
    rows = []
    for i, q in enumerate(questions):
        if form == "sharegpt":
            row: dict[str, Any] = {"conversations": [{"from": "human", "value": q},
                                                     {"from": "gpt", "value": "old answer"}]}
        else:
            row = {"messages": [msg("user", q)]}
        if i < len(ids):
            row[ids[i][0]] = ids[i][1]
        rows.append(row)
    return write_jsonl(tmp_path / "rows.jsonl", rows)


@pytest.mark.parametrize("form", ["jsonl", "parquet", "sharegpt"])
def test_source_ids_reach_both_exports(pg: str, simulator: Callable[..., Any], tmp_path: Path,
                                       llama3_dir: str, form: str) -> None:
    import datasets

    sim = simulator("--latency", "0")
    spec = JobSpec(name=f"ids-{form}", model="sim-model", servers=[sim.url], max_tokens=512,
                   tokenizer=llama3_dir, reasoning="drop")
    report = enqueue(spec, str(_write_source(form, tmp_path)))
    assert (report.inserted, report.source_ids, report.duplicate_source_ids) == (5, 4, 0)
    assert run_job(report.job_id).counts["done"] == 5
    expected = {"row-a": "question number 0 about rivers",
                "6f1c-uuid": "question number 1 about rivers",
                "77": "question number 2 about rivers", "row-d": "question number 3 about rivers",
                None: "question number 4 about rivers"}

    export_job(report.job_id, tmp_path / "pq", fmt="parquet")
    table = datasets.load_dataset("parquet", data_files=str(tmp_path / "pq" / "*.parquet"),
                                  split="train", cache_dir=str(tmp_path / "cache"))
    assert {r["source_id"]: r["conversations"][0]["content"] for r in table} == expected
    assert table.features["source_id"] == datasets.Value("string")

    export_job(report.job_id, tmp_path / "jl", fmt="jsonl")
    lines = [json.loads(line) for f in sorted((tmp_path / "jl").glob("*.jsonl"))
             for line in f.read_text().splitlines()]
    assert {r["source_id"]: r["conversations"][0]["content"] for r in lines} == expected
    with session_scope() as s:
        by_sample = dict(s.execute(select(Sample.id, Sample.source_id)).tuples().all())
    assert all(by_sample[int(r["id"])] == r["source_id"] for r in lines)  # id stays synthq's


def test_duplicate_and_missing_source_ids_are_reported(pg: str, tmp_path: Path) -> None:
    rows = [{"id": f"dup-{i % 3}", "prompt": f"distinct question {i}"} for i in range(8)]
    rows += [{"id": "dup-0", "prompt": "distinct question 0"},  # the same row again: not a dup
             {"prompt": "no id at all"}]
    path = write_jsonl(tmp_path / "dups.jsonl", rows)
    args = ["enqueue", "-d", str(path), "-s", "http://127.0.0.1:9/v1", "-m", "m", "--job", "d"]
    report = json.loads(synthq(*args, "--json").stdout)
    assert (report["rows"], report["inserted"], report["source_ids"]) == (10, 9, 9)
    assert report["duplicate_source_ids"] == 3
    assert report["duplicate_source_id_examples"] == ["dup-0", "dup-1", "dup-2"]
    assert len(_others(report["warnings"])) == 1
    assert "dup-0, dup-1, dup-2" in _others(report["warnings"])[0]

    named = synthq(*args[:-1], "named", "--id-field", "prompt_id")
    assert "warning:" in named.stderr and "10 of 10 rows have no field 'prompt_id'" in \
        " ".join(named.stderr.split())

    with session_scope() as s:
        first = s.scalars(select(Sample).where(Sample.source_id == "dup-1")
                          .order_by(Sample.id)).first()
        assert first is not None
        sample_id = first.id
    shown = synthq("sample", str(sample_id))
    assert "(id dup-1)" in shown.stdout
    assert json.loads(synthq("sample", str(sample_id), "--json").stdout)["source_id"] == "dup-1"


# --- the tokenizer round trip ------------------------------------------------------------


def _space_dropping_tokenizer(root: Path) -> Path:
    """DeepSeek-V3's real tokenizer.json, split on whitespace and decoded without byte-level."""
    out = root / "deepseek-split-on-whitespace"
    out.mkdir()
    source = Path(ct.deepseek_v3())
    shutil.copy(source / "tokenizer_config.json", out)
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    spec["decoder"] = {"type": "Fuse"}
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return out


def test_a_tokenizer_that_drops_spaces_is_refused_at_enqueue(pg: str, tmp_path: Path) -> None:
    import transformers

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello there"}])
    broken = _space_dropping_tokenizer(tmp_path)
    result = synthq("enqueue", "-d", str(path), "-s", "http://127.0.0.1:9/v1", "-m", "m",
                    "--tokenizer", str(broken), check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr  # the cause, in one line
    line = errors[0]
    assert "loses characters in a round trip" in line
    assert f"transformers {transformers.__version__}" in line
    assert "spaces and line breaks dropped" in line and "mask_mismatch" in line
    assert json.loads(synthq("jobs", "--json").stdout) == []  # nothing was created
    # The same file unedited is accepted.
    synthq("enqueue", "-d", str(path), "-s", "http://127.0.0.1:9/v1", "-m", "m",
           "--tokenizer", ct.deepseek_v3(), "--reasoning", "drop")


# --- SpecForge reads the JSONL export ----------------------------------------------------


def test_jsonl_export_loads_into_specforge_features(
        pg: str, job_factory: Callable[..., Any], tmp_path: Path) -> None:
    import datasets

    from synthq.data.dataset import Row

    rows = [Row(0, [msg("system", "s"), msg("user", "q0"), msg("assistant", "a"),
                    msg("user", "q1")], source_id="src-0"),
            Row(1, [msg("user", "only question")], source_id=None)]
    job_id = job_factory(rows=rows).job_id
    with session_scope() as s:
        s.execute(update(Sample).values(state="done", response_content="an answer ✓",
                                        reasoning_content="kept out: reasoning off",
                                        finish_reason="stop"))
        s.execute(update(Job).values(reasoning="drop"))
    export_job(job_id, tmp_path / "out", fmt="jsonl")

    # What SpecForge's training script does: load_dataset("json") on the file.
    specforge = datasets.Features({
        "id": datasets.Value("string"),
        "source_id": datasets.Value("string"),
        "conversations": datasets.List({"role": datasets.Value("string"),
                                        "content": datasets.Value("string")}),
        "finish_reason": datasets.Value("string"),
    })
    files = str(tmp_path / "out" / "*.jsonl")
    inferred = datasets.load_dataset("json", data_files=files, split="train",
                                     cache_dir=str(tmp_path / "c1"))
    assert inferred.features == specforge
    typed = datasets.load_dataset("json", data_files=files, split="train", features=specforge,
                                  cache_dir=str(tmp_path / "c2"))
    batch = typed[:]
    # build_eagle3_dataset pops these two and hands any other column to its parser.
    conversations, _ = batch.pop("conversations"), batch.pop("id")
    assert set(batch) == {"source_id", "finish_reason"} and batch["source_id"] == ["src-0", None]
    assert batch["finish_reason"] == ["stop", "stop"]
    assert conversations[0] == [msg("system", "s"), msg("user", "q0"), msg("assistant", "a"),
                                msg("user", "q1"), msg("assistant", "an answer ✓")]
    assert conversations[1] == [msg("user", "only question"), msg("assistant", "an answer ✓")]

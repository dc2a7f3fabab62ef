"""Enqueue writes the same samples on both databases.

PostgreSQL takes rows by binary ``COPY`` (straight into ``samples``, or through
a temporary table and ``ON CONFLICT DO NOTHING`` once a batch meets a key the
job holds), SQLite by ``INSERT … ON CONFLICT DO NOTHING``; the prompt's JSON
and the content key are built from parts (``ContentKeys``). Whatever the path,
every column a new sample is written with, the report and the skip reasons
must be the same, and every key must be :func:`synthq.data.dataset.content_key`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from synthq.data.dataset import content_key
from synthq.jobs import samplecopy
from synthq.jobs.enqueue import JobSpec, enqueue
from synthq.store.db import session_scope
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _rows() -> list[Any]:
    """Every kind of row (a string is written as it is); the same prompt twice within
    a batch of 3 (rows 0 and 1) and across batches (3 and 8)."""
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    question = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tab\there, quote \" and \\ too"}]
    return [
        {"id": "a", "messages": [*question, {"role": "assistant", "content": "ok"}]},
        {"id": "a-again", "messages": question},
        {"conversations": [{"from": "human", "value": "日本語 🎉 naïve\nline two"},
                           {"from": "gpt", "value": "x"}], "uuid": 7},
        {"prompt": "Plain question?", "system": "You answer.", "id": "p"},
        "[1, 2]",
        {"messages": [{"role": "assistant", "content": "no user turn"}], "id": "bad"},
        {"id": "tools", "tools": [WEATHER], "tool_choice": "auto",
         "messages": [{"role": "user", "content": "Weather in Oslo?"},
                      {"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3}"},
                      {"role": "user", "content": "And tomorrow?"}]},
        {"messages": [{"role": "wizard", "content": "?"}]},
        {"prompt": "Plain question?", "system": "You answer.", "id": "p-dup"},
        {"prompt": "Last one, \u2028 and \u00e9."},
        "{not json",
        # Text no database stores: skipped with its reason, the rest of the batch stays.
        {"prompt": "a NUL \x00 inside", "id": "nul"},
        {"prompt": "fine", "id": "id with a NUL \x00"},
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": '
        'null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "weather", '
        '"arguments": "\\ud800"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}, '
        '{"role": "user", "content": "next"}]}',
        '{"broken": "\\u0000 and \\udc00", ',
    ]


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
                            + "\n" for r in rows), encoding="utf-8")
    return path


def _run(tmp_path: Path) -> list[Any]:
    """Enqueue, enqueue again, then a longer file; what each report said and every sample."""
    tmp_path.mkdir()
    first = _write(tmp_path / "first.jsonl", _rows())
    longer = _write(tmp_path / "longer.jsonl",
                    _rows() + [{"prompt": f"new row {i}"} for i in range(7)])
    spec = JobSpec(name="paths", model="m", servers=["http://127.0.0.1:9/v1"])
    reports = []
    for path in (first, first, longer):
        r = enqueue(spec, str(path))
        reports.append((r.rows, r.inserted, r.skipped, r.duplicates, r.source_ids,
                        r.skip_examples))
    with session_scope() as s:
        job = s.scalars(select(Job)).one()
        settings, key_version = job.key_generation_settings(), job.key_version
        samples = s.scalars(select(Sample).order_by(Sample.id)).all()
        stored = [(smp.job_id, smp.content_key, smp.dataset_index, smp.source_id, smp.prompt,
                   str(smp.state), smp.attempts, smp.next_attempt_at is None,
                   smp.finished_at is None, smp.error_class, smp.error_message, smp.tools,
                   smp.turn_count) for smp in samples]
    for row in stored:
        if row[4] is not None:  # a prompt: its key is content_key's, the reference
            assert row[1] == content_key(row[4], settings, key_version, row[11])
    return [reports, stored]


@pytest.mark.parametrize("rows, size", [(3, 64 << 20), (1000, 60)],
                         ids=["batches-of-3-rows", "batches-of-60-prompt-bytes"])
def test_postgres_copy_and_sqlite_insert_write_the_same_samples(
        pg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, size: int) -> None:
    # Small batches (by rows, or by the prompts' size): direct COPYs, a duplicate within
    # a batch, a re-enqueue, and a batch that holds old and new rows all happen.
    monkeypatch.setattr(samplecopy, "BATCH", rows)
    monkeypatch.setattr(samplecopy, "BATCH_BYTES", size)
    on_postgres = _run(tmp_path / "pg")

    from synthq.spec.config import get_settings
    from synthq.store.db import dispose_engines
    from synthq.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'lite.db'}"
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", url)
    get_settings.cache_clear()
    dispose_engines()
    upgrade(url)
    on_sqlite = _run(tmp_path / "lite")

    reports, stored = on_postgres
    assert reports == on_sqlite[0]
    assert stored == on_sqlite[1]
    # 15 rows: 13 new (two repeat a prompt), 7 of them skipped; then nothing; then 7 more.
    assert [r[:5] for r in reports] == [(15, 13, 7, 2, 9), (15, 0, 7, 15, 9),
                                        (22, 7, 7, 15, 9)]
    assert [s[2] for s in stored] == [0, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14,
                                      *range(15, 22)]
    # A NUL in an id is stored escaped; the rows NUL or a lone surrogate spoil are skipped.
    assert stored[10][3] == "id with a NUL \\u0000" and stored[10][5] == "pending"
    assert [s[3] for s in stored[:7]] == ["a", "7", "p", None, "bad", "tools", None]
    assert stored[0][4][1]["content"] == "Tab\there, quote \" and \\ too"
    assert stored[5][11] == {"tools": [WEATHER], "tool_choice": "auto"}
    assert reports[0][5] == [
        ("line 5", "row is not a JSON object"), ("line 6", "no user turn"),
        ("line 8", "unknown role 'wizard' in message 1"),
        ("line 11", "not valid JSON: Expecting property name enclosed in double quotes: "
                    "line 1 column 2 (char 1)"),
        ("line 12", "the conversation holds a NUL character (\\u0000), which cannot be "
                    "stored"),
        ("line 14", "the conversation holds text that is not valid Unicode (a lone "
                    "surrogate)"),
        ("line 15", "not valid JSON: Expecting property name enclosed in double quotes: "
                    "line 1 column 32 (char 31)")]

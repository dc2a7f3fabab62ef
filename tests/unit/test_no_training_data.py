"""A job that can make no training data is told so when it is made, and `synthq train` says
what it takes (issue: the README's first job had no `--tokenizer`, so `train` failed with
the export's advice, `use --format jsonl`, which train does not take; and the README's
tiny target met the demo's DeepSeek-V3 ids as `token id 45585, beyond the target's
vocabulary of 400` once the run had started). In process, on SQLite."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import _reset_process_state
from typer.testing import CliRunner


@pytest.fixture
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", f"sqlite:///{tmp_path / 't.db'}")
    monkeypatch.setenv("SYNTHQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    _reset_process_state()
    yield tmp_path
    _reset_process_state()


def _cli(*args: str) -> tuple[int, str]:
    from synthq.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    return result.exit_code, result.output


def _enqueue(tmp_path: Path, name: str) -> str:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q {i}"}) + "\n" for i in range(3)))
    code, out = _cli("enqueue", "-d", str(data), "-s", "http://127.0.0.1:9/v1", "-m", "m",
                     "--job", name)
    assert code == 0, out
    return " ".join(out.split())


def _target(tmp_path: Path, vocab: int) -> str:
    folder = tmp_path / f"target-{vocab}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return str(folder)


def _runs() -> int:
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import TrainingRun

    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(TrainingRun)) or 0


def test_enqueue_without_a_tokenizer_says_it_makes_no_training_data(embedded: Path) -> None:
    out = _enqueue(embedded, "plain")
    assert ("warning: job plain has no tokenizer: its answers are stored, but they make no "
            "training data") in out, out
    assert "`synthq retokenize plain --tokenizer TARGET`" in out, out


def test_train_names_what_train_takes_before_making_a_run(embedded: Path) -> None:
    _enqueue(embedded, "plain")
    code, out = _cli("train", "plain", "--target", _target(embedded, 400))
    line = " ".join(out.split())
    assert code == 2, out
    assert line.startswith("error: job plain has no tokenizer, so no training examples"), line
    assert "`synthq retokenize plain --tokenizer TARGET`" in line
    assert "--format" not in line  # the export's advice, which train does not take
    assert _runs() == 0


def test_train_refuses_a_target_whose_vocabulary_the_ids_exceed(embedded: Path) -> None:
    from sqlalchemy import text

    from synthq.core.packing import pack_ids
    from synthq.store.db import session_scope

    _enqueue(embedded, "demo")
    with session_scope() as s:  # the demo's examples, as DeepSeek-V3's tokenizer made them
        s.execute(text("UPDATE jobs SET tokenizer = 'deepseek-v3'"))
        s.execute(text("UPDATE samples SET state = 'done', input_ids = :ids, num_tokens = 3"),
                  {"ids": pack_ids([0, 128_000, 45_585])})
    tiny = _target(embedded, 400)
    code, out = _cli("train", "demo", "--target", tiny)
    line = " ".join(out.split())
    assert code == 2, out
    assert line == (
        f"error: job demo holds token id 128,000, beyond the vocabulary of --target {tiny} "
        "(400 tokens): its examples were tokenized with deepseek-v3, not this target's "
        "tokenizer. Train with the target of that tokenizer, or tokenize the stored answers "
        f"for this one first, with no new calls: `synthq retokenize demo --tokenizer {tiny}`")
    assert _runs() == 0

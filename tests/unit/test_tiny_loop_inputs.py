"""The loop on the tiny target, on a CPU: `synthq testing tiny-prompts` writes its prompts
(the walkthrough read a `prompts.jsonl` that no command made), and `synthq simulate`
answers them as the target does, so a job made on the simulator holds ids the tiny
target reads (the README trained it on the demo's DeepSeek-V3 ids: `token id 45585,
beyond the target's vocabulary of 400`). In process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner


def _rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_prompts_writes_distinct_training_and_held_out_prompts(tmp_path: Path) -> None:
    from synthq.cli import app
    from synthq.data.dataset import iter_rows

    result = CliRunner().invoke(app, ["testing", "tiny-prompts", str(tmp_path / "p"),
                                      "--train", "300", "--held-out", "30"])
    assert result.exit_code == 0, result.output
    train, held = _rows(tmp_path / "p" / "train.jsonl"), _rows(tmp_path / "p" / "held_out.jsonl")
    assert len(train) == 300 and len(held) == 30
    prompts = [r["messages"][0]["content"] for r in train]
    held_prompts = {r["messages"][0]["content"] for r in held}
    assert len(set(prompts)) == 300 and not held_prompts & set(prompts)
    assert all(p.startswith("count from ") for p in prompts)
    read = [r for r in iter_rows(str(tmp_path / "p" / "train.jsonl")) if not r.skipped]
    assert len(read) == 300  # what `synthq run -d` reads
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert (manifest["train"], manifest["held_out"]) == (300, 30)
    again = CliRunner().invoke(app, ["testing", "tiny-prompts", str(tmp_path / "q"),
                                     "--train", "300", "--held-out", "30"])
    assert again.exit_code == 0 and _rows(tmp_path / "q" / "train.jsonl") == train  # seeded
    too_many = CliRunner().invoke(app, ["testing", "tiny-prompts", str(tmp_path / "r"),
                                        "--train", "1500", "--held-out", "200"])
    assert too_many.exit_code == 2 and "1,611 distinct prompts" in too_many.output


def _ask(client, text: str, **extra: object) -> dict:  # type: ignore[no-untyped-def, type-arg]
    r = client.post("/v1/chat/completions", json={
        "model": "sim-model", "stream": False,
        "messages": [{"role": "user", "content": text}], **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def test_the_simulator_counts_as_the_tiny_target_does() -> None:
    from starlette.testclient import TestClient

    from synthq.testing.simulator import SimConfig, build_app
    from synthq.testing.tiny import count_answer

    with TestClient(build_app(SimConfig(latency=0.0))) as client:
        answer = _ask(client, "count from 23 to 29")
        assert answer["message"]["content"] == count_answer(7, 23) == "23 24 25 26 27 28 29"
        assert answer["finish_reason"] == "stop"
        cut = _ask(client, "count from 23 to 29", max_tokens=3)
        assert (cut["message"]["content"], cut["finish_reason"]) == ("23 24 25", "length")
        other = _ask(client, "count the sheep")  # any other prompt: the usual answer
        assert other["message"]["content"].startswith("count the sheep ")


def test_tiny_target_is_built_once_and_copied_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second `synthq testing tiny-target` copies the first one's build (the same
    files, linked: no second build); another spec is another build; `--no-cache` builds
    in place and leaves the cache alone."""
    from synthq.cli import app
    from synthq.testing import tiny

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = ["--layers", "4", "--steps", "0"]
    builds: list[Path] = []

    def build(name: str, *extra: str) -> dict:  # type: ignore[type-arg]
        result = CliRunner().invoke(app, ["testing", "tiny-target", str(tmp_path / name),
                                          *small, *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout[result.stdout.index("{"):])

    real_build = tiny.build_tiny_target

    def counted(directory: Path, *args: Any, **kwargs: Any) -> dict:  # type: ignore[type-arg]
        builds.append(directory)
        return real_build(directory, *args, **kwargs)

    monkeypatch.setattr(tiny, "build_tiny_target", counted)
    first, second = build("a"), build("b")
    assert len(builds) == 1 and first["cache"] == second["cache"]
    cached = Path(first["cache"])
    assert cached.parent == tmp_path / "cache" / "synthq"
    weights = [tmp_path / d / "model.safetensors" for d in ("a", "b")]
    assert weights[0].stat().st_ino == weights[1].stat().st_ino == (
        cached / "model.safetensors").stat().st_ino
    assert (first["directory"], second["directory"]) == (str(tmp_path / "a"), str(tmp_path / "b"))

    # The rest needs no real model: a build that writes its summary alone.
    def fake(directory: Path, spec: Any = None, say: Any = None) -> dict:  # type: ignore[type-arg]
        builds.append(directory)
        directory.mkdir(parents=True)
        summary = {"directory": str(directory), "seed": spec.seed}
        (directory / "tiny_target.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(tiny, "build_tiny_target", fake)
    other = build("c", "--seed", "1")
    assert len(builds) == 2 and other["cache"] != first["cache"] and other["seed"] == 1
    plain = build("d", "--no-cache")
    assert len(builds) == 3 and builds[-1] == tmp_path / "d"
    assert "cache" not in plain and plain["directory"] == str(tmp_path / "d")
    assert len(list(cached.parent.iterdir())) == 2  # a's (b copied it) and c's


def test_an_unwritable_cache_is_one_line_before_any_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.cli import app
    from synthq.testing import tiny

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no folder can go there
    monkeypatch.setattr(tiny, "build_tiny_target", lambda *a, **k: pytest.fail("built"))
    result = CliRunner().invoke(app, ["testing", "tiny-target", str(tmp_path / "t")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "cannot keep the build in synthq's cache" in result.output
    assert "--no-cache" in result.output, result.output

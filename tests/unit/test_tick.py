"""The scheduler tick (synthq.app.tick): one order for the beat and the embedded loop, stages
that run on a wake or only on full ticks, guarded stages that never stop the dispatch."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from synthq.app import tick
from synthq.app.tick import STAGES, Effects, Stage, run_tick

REPO = Path(__file__).resolve().parents[2]


def test_the_order_is_probe_sweep_adapt_dispatch_finish_train() -> None:
    names = [s.name for s in STAGES]
    assert names[:6] == ["probe", "sweep", "adapt", "dispatch", "finish", "train"]
    # The controller before the dispatch: what it decided is what this dispatch fills.
    assert names.index("adapt") < names.index("dispatch")
    assert [s.name for s in STAGES if s.every_wake] == ["adapt", "dispatch"]


def test_a_wake_runs_only_the_every_wake_stages_and_a_full_tick_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def stage(name: str, every_wake: bool = False) -> Stage:
        return Stage(name, lambda t: seen.append(name) or name, every_wake=every_wake)

    monkeypatch.setattr(tick, "STAGES", (stage("a"), stage("b", True), stage("c")))
    done = run_tick(Effects(publish=None), full=False)
    assert seen == ["b"] and done.did == {"b": "b"}
    seen.clear()
    assert run_tick(Effects(publish=None)).did == {"a": "a", "b": "b", "c": "c"}
    assert seen == ["a", "b", "c"]


def test_a_guarded_stage_that_fails_is_logged_and_the_tick_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(t: Any) -> None:
        raise RuntimeError("bug")

    def db_down(t: Any) -> None:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    after = Stage("after", lambda t: "ran")
    monkeypatch.setattr(tick, "STAGES", (Stage("x", broken, guarded=True), after))
    assert run_tick(Effects(publish=None)).did == {"after": "ran"}
    assert "the x stage failed" in caplog.text
    # Unguarded, a bug stops the tick; a database error stops it even in a guarded stage,
    # except in one whose database trouble is its own.
    monkeypatch.setattr(tick, "STAGES", (Stage("x", broken), after))
    with pytest.raises(RuntimeError):
        run_tick(Effects(publish=None))
    monkeypatch.setattr(tick, "STAGES", (Stage("x", db_down, guarded=True), after))
    with pytest.raises(OperationalError):
        run_tick(Effects(publish=None))
    monkeypatch.setattr(tick, "STAGES", (Stage("x", db_down, guarded=True,
                                               database_stops=False), after))
    assert run_tick(Effects(publish=None)).did == {"after": "ran"}


def _calls_to(path: Path, names: set[str]) -> list[str]:
    """The calls to any of ``names`` (bare or as an attribute) in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr \
                if isinstance(fn, ast.Attribute) else None
            if name in names:
                found.append(name)
    return found


def test_the_beat_and_the_embedded_loop_both_run_the_one_tick() -> None:
    """Neither scheduler runs a stage of its own: both call run_tick. (The exceptions
    are not ticks: a worker's refill dispatch, the embedded start's reclaim-all sweep
    and its finish of a job it sees ending between two ticks.)"""
    stages = {"probe_due", "adapt", "tick", "check_readiness", "_train_tick", "_adapt_tick"}
    for path in (REPO / "worker" / "tasks.py", REPO / "synthq" / "app" / "embedded.py"):
        assert "run_tick" in _calls_to(path, {"run_tick"}), path
        assert not _calls_to(path, stages), path
    assert _calls_to(REPO / "worker" / "tasks.py", {"dispatch", "sweep", "finish_jobs"}) \
        == ["dispatch"]  # the refill
    assert sorted(_calls_to(REPO / "synthq" / "app" / "embedded.py",
                            {"dispatch", "sweep", "finish_jobs"})) == ["finish_jobs", "sweep"]

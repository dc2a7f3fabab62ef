"""`synthq worker` names its Celery node per process (``gen-PID@%h``, ``train-PID@%h``) or as
``--name`` says: two workers on one host were both ``celery@HOST``, one worker in Flower.
In process: the command line `synthq worker` would exec is caught, not run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import _reset_process_state
from typer.testing import CliRunner


@pytest.fixture
def execs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """The celery command lines `synthq worker` would exec (SQLite, a broker URL that is
    never reached)."""
    from synthq.cli import services

    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", f"sqlite:///{tmp_path / 'w.db'}")
    monkeypatch.setenv("SYNTHQ_BROKER_URL", "redis://127.0.0.1:9/0")
    _reset_process_state()
    seen: list[list[str]] = []
    monkeypatch.setattr(services.os, "execv", lambda exe, argv: seen.append(list(argv)))
    yield seen
    _reset_process_state()


def _node(argv: list[str]) -> str:
    assert argv.count("-n") == 1, argv
    return argv[argv.index("-n") + 1]


def _worker(*args: str) -> None:
    from synthq.cli import app

    result = CliRunner().invoke(app, ["worker", *args])
    assert result.exit_code == 0, result.output


def test_two_workers_on_one_host_get_two_names(execs: list[list[str]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.cli import services

    for pid in (4101, 4102):
        monkeypatch.setattr(services.os, "getpid", lambda pid=pid: pid)
        _worker("-c", "4")
    monkeypatch.setattr(services.os, "getpid", lambda: 4103)
    _worker("--queues", "train")
    assert [_node(a) for a in execs] == ["gen-4101@%h", "gen-4102@%h", "train-4103@%h"]


def test_a_given_name_is_kept(execs: list[list[str]]) -> None:
    _worker("--name", "gpu-a")
    _worker("-n", "w1@box")
    _worker("--hostname", "mine@box")  # celery's own option, passed through
    assert _node(execs[0]) == "gpu-a@%h" and _node(execs[1]) == "w1@box"
    assert "-n" not in execs[2] and execs[2][-2:] == ["--hostname", "mine@box"]

"""The CLI against real PostgreSQL: enqueue, status, requeue, pause, sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import update
from support import REPO, child_env, cli_host, run_cli

from synthq.store.db import session_scope
from synthq.store.models import Sample

pytestmark = pytest.mark.integration


synthq = run_cli


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(20)]
    rows += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
             {"prompt": "plain prompt", "system": "be brief"}, {"messages": "nope"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def enqueue_args(dataset: Path, *extra: str) -> list[str]:
    return ["enqueue", "-d", str(dataset), "-s", "http://127.0.0.1:9/v1", "-m", "m", "--job",
            "cli-job", "--json", *extra]


def test_enqueue_twice_adds_nothing(pg: str, dataset: Path) -> None:
    first = json.loads(synthq(*enqueue_args(dataset)).stdout)
    assert (first["created"], first["rows"], first["inserted"], first["skipped"]) == \
        (True, 23, 23, 1)
    again = json.loads(synthq(*enqueue_args(dataset)).stdout)
    assert (again["created"], again["inserted"], again["duplicates"]) == (False, 0, 23)
    human = synthq(*enqueue_args(dataset)[:-1])
    assert "nothing new to add" in human.stdout


def test_enqueue_with_other_generation_settings_is_refused(pg: str, dataset: Path) -> None:
    synthq(*enqueue_args(dataset))
    result = synthq(*enqueue_args(dataset, "--temperature", "0.7"), check=False)
    assert result.returncode == 2
    assert "other generation settings" in result.stderr


def test_status_requeue_pause(pg: str, dataset: Path) -> None:
    job_id = json.loads(synthq(*enqueue_args(dataset)).stdout)["job_id"]
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.id <= 3).values(
            state="failed", error_class="timeout", error_message="x"))
        s.execute(update(Sample).where(Sample.id == 4).values(
            state="failed", error_class="context_length", error_message="y"))
    status = json.loads(synthq("status", "cli-job", "--json").stdout)
    assert status["id"] == job_id
    assert status["counts"]["failed"] == 4 and status["failures"] == {"timeout": 3,
                                                                      "context_length": 1}
    assert "requeued 3" in synthq("requeue", "cli-job", "--failed", "--class", "timeout").stdout
    bad = synthq("requeue", "cli-job", "--class", "nonsense", check=False)
    assert bad.returncode == 2 and "unknown class" in bad.stderr
    assert "active → paused" in synthq("pause", str(job_id)).stdout
    assert "paused → active" in synthq("resume", "cli-job").stdout
    synthq("cancel", "cli-job")
    assert "cannot be resumed" in synthq("resume", "cli-job", check=False).stderr
    missing = synthq("status", "no-such-job", check=False)
    assert missing.returncode == 2 and "no job 'no-such-job'" in missing.stderr
    shown = json.loads(synthq("sample", "4", "--json").stdout)
    assert shown["error_class"] == "context_length" and shown["attempt_log"] == []
    jobs = json.loads(synthq("jobs", "--json").stdout)
    assert [j["name"] for j in jobs] == ["cli-job"]


@pytest.mark.processes
def test_every_command_has_an_example_in_help() -> None:
    from typer.main import get_command

    from synthq.cli import app

    group = get_command(app)
    names = list(group.commands) + ["db upgrade"]  # type: ignore[attr-defined]
    for name in names:
        out = synthq(*name.split(), "--help", timeout=60, check=False).stdout
        assert "Example" in out, name


def test_enqueue_refuses_a_tokenizer_that_cannot_work(pg: str, dataset: Path,
                                                      tmp_path: Path) -> None:
    import chat_tokenizers as ct

    missing = synthq(*enqueue_args(dataset, "--tokenizer", str(tmp_path / "nope")), check=False)
    assert missing.returncode == 2 and "nope: no such directory" in missing.stderr
    keep = synthq(*enqueue_args(dataset, "--tokenizer", ct.deepseek_v3(), "--reasoning", "keep"),
                  check=False)
    assert keep.returncode == 2 and "drops reasoning" in " ".join(keep.stderr.split())
    assert json.loads(synthq("jobs", "--json").stdout) == []  # nothing was created
    ok = json.loads(synthq(*enqueue_args(dataset, "--tokenizer", ct.deepseek_v3(),
                                         "--reasoning", "drop")).stdout)
    assert ok["inserted"] == 23
    changed = synthq(*enqueue_args(dataset, "--tokenizer", ct.deepseek_v3(), "--reasoning",
                                   "drop", "--max-seq-len", "99"), check=False)
    assert changed.returncode == 2 and "synthq retokenize" in changed.stderr


def test_status_watch_ends_when_the_job_finishes(pg: str, dataset: Path) -> None:
    synthq(*enqueue_args(dataset))
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.state == "pending").values(state="done"))
    out = synthq("status", "cli-job", "--watch", "--interval", "0.2")
    assert "100%" in out.stdout and "finished: 22 done" in " ".join(out.stdout.split())


def test_concurrent_first_enqueues_both_succeed(pg: str, dataset: Path) -> None:
    """Two first enqueues of one job at once: both exit 0 (get-or-create with ON
    CONFLICT), and the samples are there once."""
    for round_ in range(4):
        args = ["enqueue", "-d", str(dataset), "-s", "http://127.0.0.1:9/v1", "-m", "m",
                "--job", f"race-{round_}", "--json"]
        host = cli_host()  # two processes at once, forked side by side
        started = [host.start(args, child_env(), REPO) for _ in range(2)]
        procs = [host.wait(run, 120) for run in started]  # type: ignore[arg-type] - forked
        assert [p.returncode for p in procs] == [0, 0], procs
        reports = [json.loads(p.stdout) for p in procs]
        assert sorted(r["created"] for r in reports) == [False, True]
        assert sum(r["inserted"] for r in reports) == reports[0]["rows"]  # each row once


def test_reenqueue_says_which_live_settings_changed(pg: str, dataset: Path) -> None:
    synthq(*enqueue_args(dataset, "--inflight", "4"))
    again = json.loads(synthq(*enqueue_args(dataset, "--inflight", "8")).stdout)
    assert again["updated_settings"] == ["inflight_limit 4 -> 8"]
    assert any("inflight_limit 4 -> 8" in w for w in again["warnings"])


def test_enqueue_asks_the_workers_for_a_tick_at_once(pg: str, redis_url: str,
                                                     dataset: Path) -> None:
    """New samples start at once, not at beat's next tick: one expiring ``synthq.dispatch``
    message on the control queue (its expiry a Redis key, not Celery's ``expires``, which
    a worker checks against its own clock); an enqueue that adds nothing sends none."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        synthq(*enqueue_args(dataset))
        messages = [json.loads(m) for m in client.lrange("control", 0, -1)]
        assert [m["headers"]["task"] for m in messages] == ["synthq.dispatch"]
        assert not messages[0]["headers"].get("expires")  # no clock but Redis' decides
        ttl = client.pttl("synthq:tick:" + messages[0]["headers"]["id"])
        assert 0 < ttl <= 5000, ttl  # a late tick is dropped, not run
        synthq(*enqueue_args(dataset))
        assert client.llen("control") == 1
    finally:
        client.close()

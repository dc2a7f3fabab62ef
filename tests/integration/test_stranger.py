"""A stranger's run (issue 17): each wrong step gets one clear line, in a fresh directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import REPO, Simulator, free_port, run_default_python
from test_first_use import QUICK, error_line, jobs, synthq, write_rows


@pytest.fixture
def sim(simulator: Callable[..., Simulator]) -> Simulator:
    return simulator("--latency", "0")


def test_a_server_url_without_v1_is_refused_with_the_fix(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    base = sim.url.removesuffix("/v1")
    result = synthq(tmp_path, "run", "-d", str(data), "-s", base, "-m", "sim-model", *QUICK)
    assert result.returncode == 2
    assert f"did you mean --server {base}/v1" in error_line(result)
    assert jobs(tmp_path) == []


@pytest.mark.processes
def test_a_url_without_v1_on_a_server_without_models_pauses_at_the_first_404(
        tmp_path: Path) -> None:
    """No /models route: the enqueue check cannot tell; the first 404 pauses the job, one
    line says why, and no sample is failed or charged."""
    sim = Simulator(config="latency=0, models_route=False", log_dir=tmp_path)
    try:
        data = write_rows(tmp_path / "d.jsonl", [f"p{i}" for i in range(40)])
        base = sim.url.removesuffix("/v1")
        result = synthq(tmp_path, "run", "-d", str(data), "-s", base, "-m", "sim-model", *QUICK)
        assert result.returncode == 1, result.stderr
        line = error_line(result)
        assert "paused" in line and "ending in /v1" in line and "synthq resume d" in line
        job = jobs(tmp_path)[0]
        assert job["state"] == "paused" and job["failed"] == 0 and job["pending"] == 40
        status = json.loads(synthq(tmp_path, "status", "d", "--json").stdout)
        assert status["failures"] == {} and status["retrying"]["bad_request"] >= 1
        # The reason is kept on the job: status and the job page say it, not only a log.
        assert "ending in /v1" in status["pause_reason"]
        assert "paused by synthq" in synthq(tmp_path, "status", "d").stdout
        refused = synthq(tmp_path, "run", "--job", "d")
        assert "is paused (server " in error_line(refused), refused.stderr
        # The fix: resume, run again with the base URL.
        assert synthq(tmp_path, "resume", "d").returncode == 0
        assert json.loads(synthq(tmp_path, "status", "d", "--json").stdout)[
            "pause_reason"] is None
        again = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                       *QUICK)
        assert again.returncode == 0, again.stderr
        assert jobs(tmp_path)[0]["done"] == 40
    finally:
        sim.stop()


def test_run_exits_non_zero_when_every_sample_failed(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", [f"{c} [[sim:context_length]]" for c in "ab"])
    result = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model", *QUICK)
    assert result.returncode == 1, result.stderr
    assert "every sample failed (2)" in error_line(result)
    ok = write_rows(tmp_path / "ok.jsonl", ["fine"])
    assert synthq(tmp_path, "run", "-d", str(ok), "-s", sim.url, "-m", "sim-model",
                  *QUICK).returncode == 0


@pytest.mark.processes
def test_bad_settings_are_refused_without_a_tokenizer(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    server = f"http://127.0.0.1:{free_port()}/v1"
    for args, message in ((["--reasoning", "maybe"], "--reasoning must be one of auto, keep, drop"),
                          (["--mask", "all"], "--mask must be last_turn or all_assistant"),
                          (["--temperature", "-1"], "--temperature must be 0 to 100"),
                          (["--tokenizer", "/no/such/tok"], "--tokenizer /no/such/tok: no such "
                           "directory")):
        result = synthq(tmp_path, "enqueue", "-d", str(data), "-s", server, "-m", "m", *args)
        assert result.returncode == 2 and message in error_line(result), (args, result.stderr)
    assert jobs(tmp_path) == []


@pytest.mark.processes
def test_path_typos_say_what_is_wrong(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "dir" / "x.db"
    result = synthq(tmp_path, "jobs", env={"SYNTHQ_DATABASE_URL": f"sqlite:///{missing}"})
    assert result.returncode == 2 and "does not exist" in error_line(result)
    assert not (tmp_path / "nonexistent").exists()
    # A dataset folder names the files it does not read.
    folder = tmp_path / "set"
    write_rows(folder / "a.jsonl", ["hi"])
    (folder / "notes.md").write_text("# notes")
    (folder / "b.csv").write_text("prompt\nx\n")
    result = synthq(tmp_path, "enqueue", "-d", str(folder), "-s",
                    f"http://127.0.0.1:{free_port()}/v1", "-m", "m")
    assert result.returncode == 0, result.stderr
    assert "skipped 2 files in" in result.stderr and "b.csv, notes.md" in result.stderr


@pytest.mark.processes
def test_a_short_api_token_is_one_line(tmp_path: Path) -> None:
    result = synthq(tmp_path, "api", "--port", str(free_port()),
                    env={"SYNTHQ_API_TOKEN": "short-token"})
    assert result.returncode == 2 and "at least 16 characters" in error_line(result)


@pytest.mark.processes
def test_piped_output_is_not_wrapped(tmp_path: Path) -> None:
    name = "a-job-name-" + "x" * 90
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")
            and k not in ("COLUMNS", "LINES")}
    result = subprocess.run([sys.executable, "-m", "synthq.cli", "enqueue", "-d", str(data),
                             "-s", f"http://127.0.0.1:{free_port()}/v1", "-m", "m", "--job",
                             name], cwd=tmp_path, env={**base, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert any(name in line and "created" in line for line in result.stdout.splitlines()), \
        result.stdout


def test_a_rerun_with_the_right_server_redoes_its_404s(pg: str, job_factory: Any,
                                                       sample_factory: Any) -> None:
    from synthq.app import service
    from synthq.jobs.enqueue import find_job
    from synthq.store.counts import state_counts
    from synthq.store.db import session_scope

    report = job_factory([], servers=["http://h:8000/v1"])
    for server, cls in (("http://h:8000", "bad_request"), ("http://h:8000", "timeout"),
                        ("http://h:8000/v1", "bad_request")):
        sample_factory("failed", job_id=report.job_id, error_class=cls, server=server)
    with session_scope() as s:
        assert service.requeue_left_servers(s, find_job(s, report.job_id)) == 1
    with session_scope() as s:
        assert state_counts(s, report.job_id)["pending"] == 1


@pytest.mark.processes
def test_train_without_torch_is_one_line_and_leaves_no_run(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    assert synthq(tmp_path, "enqueue", "-d", str(data), "-s",
                  f"http://127.0.0.1:{free_port()}/v1", "-m", "m", "--job", "t").returncode == 0
    code = ("import sys; sys.modules['torch'] = None; from synthq.cli import app; "
            "app(['train', 't', '--target', '" + str(data.parent) + "'])")
    result = run_default_python(code, tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2 and "training needs torch" in error_line(result)
    runs = synthq(tmp_path, "runs", "--json")
    assert runs.returncode == 0 and json.loads(runs.stdout) == [], runs.stdout


def test_a_finished_run_reads_right(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    result = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model", *QUICK)
    assert result.returncode == 0, result.stderr
    assert "finished" in result.stdout and "workers:" not in result.stdout  # no stale load
    assert ", 1 attempt, server" in synthq(tmp_path, "sample", "1").stdout
    out = tmp_path / "export"
    assert synthq(tmp_path, "export", "d", "--format", "jsonl", "--out", str(out)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # like its files, not 0700


@pytest.mark.processes
def test_jobs_reads_sqlite_without_sqlalchemy_and_says_the_same(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi", "there"])
    assert synthq(tmp_path, "enqueue", "-d", str(data), "-s",
                  f"http://127.0.0.1:{free_port()}/v1", "-m", "m").returncode == 0
    fast = synthq(tmp_path, "jobs", "--json")
    # Any other setting takes the ordinary path (it validates the settings).
    slow = synthq(tmp_path, "jobs", "--json", env={"SYNTHQ_LEASE_MARGIN": "31"})
    assert fast.returncode == slow.returncode == 0
    assert json.loads(fast.stdout) == json.loads(slow.stdout)
    assert json.loads(fast.stdout)[0]["pending"] == 2
    code = ("import sys; from synthq.cli import app\n"
            "app(['jobs', '--json'], standalone_mode=False)\n"
            "print('sqlalchemy' in sys.modules, 'pydantic_settings' in sys.modules,\n"
            "      'rich.console' in sys.modules)")
    result = run_default_python(code, tmp_path)
    assert result.stdout.splitlines()[-1] == "False False False", result.stdout + result.stderr


@pytest.mark.processes
def test_status_reads_sqlite_without_sqlalchemy_and_says_the_same(tmp_path: Path) -> None:
    """`synthq status` on the embedded default takes the sqlite3 path (synthq.cli.fast):
    the same output as the ordinary path, and the ordinary path's errors."""
    data = write_rows(tmp_path / "d.jsonl", ["hi", "there"])
    assert synthq(tmp_path, "enqueue", "-d", str(data), "-s",
                  f"http://127.0.0.1:{free_port()}/v1", "-m", "m", "--gpu-hour-price", "2",
                  "--inflight", "auto").returncode == 0
    other = {"SYNTHQ_LEASE_MARGIN": "31"}  # any other setting: the ordinary path
    for args in (["status", "d", "--json"], ["status", "--json"], ["status", "d"],
                 ["status", "nope"], ["status", "nope", "--json"]):
        fast, slow = synthq(tmp_path, *args), synthq(tmp_path, *args, env=other)
        assert (fast.returncode, fast.stdout, fast.stderr) == \
            (slow.returncode, slow.stdout, slow.stderr), args
    assert fast.returncode == 2 and "no job 'nope'" in error_line(fast)
    code = ("import sys; from synthq.cli import app\n"
            "app(['status', 'd', '--json'], standalone_mode=False)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in\n"
            "             ('sqlalchemy', 'pydantic_settings', 'rich', 'httpx')\n"
            "             or m in ('synthq.store.models', 'synthq.store.db',\n"
            "                      'synthq.spec.config')))")
    result = run_default_python(code, tmp_path)
    assert result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
    assert json.loads(result.stdout.splitlines()[0])["name"] == "d"

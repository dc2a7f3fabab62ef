"""``--capture-server``, a declared job setting (synthq.spec.jobspec): `synthq enqueue` and
`synthq run` refuse one that does not answer in one line with exit 2 and store nothing,
store one that answers (the simulator's /v1/models), and `synthq status` (text and
--json) shows the capture stage from the job's real ``captures`` rows in PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from support import capture_rows, run_cli
from test_cli_jobspec import one_error_line, synthq

pytestmark = pytest.mark.integration

DEAD = "http://127.0.0.1:9/v1"  # nothing listens on port 9


def _jobs() -> int:
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    with session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(Job)) or 0)


def test_a_capture_server_that_does_not_answer_is_refused_and_nothing_stored(
        pg: str, simulator: Any, tmp_path: Path) -> None:
    sim = simulator("--latency", "0")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    base = ["enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--job", "cap"]
    line = one_error_line(run_cli(*base, "--capture-server", DEAD, check=False))
    assert line.startswith(f"error: capture server {DEAD} does not list a model"), line
    line = one_error_line(run_cli(*base, "--capture-server", "ftp://nope", check=False))
    assert line == ("error: --capture-server 'ftp://nope' is not an http(s) URL such as "
                    "http://localhost:8000/v1"), line
    line = one_error_line(run_cli(*base, "--capture-server", sim.url, "--capture-server",
                                  sim.url + "/", check=False))
    assert line == "error: the same --capture-server is given twice", line
    assert _jobs() == 0
    # `synthq run` (the embedded mode, its SQLite file) takes the same option, checked alike.
    line = one_error_line(synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m",
                                 "sim-model", "--capture-server", DEAD))
    assert line.startswith(f"error: capture server {DEAD} does not list a model"), line
    assert synthq(tmp_path, "jobs", "--json").stdout.strip() == "[]"


def test_a_capture_server_that_answers_is_stored_and_status_shows_the_stage(
        pg: str, simulator: Any, tmp_path: Path) -> None:
    from synthq.queue import jobs
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job

    sim = simulator("--latency", "0")
    secret = sim.url.replace("http://", "http://user:hunter2pw@")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(8)))
    out = run_cli("enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--job", "cap",
                  "--capture-server", secret + "/", "--json")
    job_id = json.loads(out.stdout)["job_id"]
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        assert job.capture_servers == [secret]  # as given, its trailing / dropped
        jobs.update_job(s, job, {"capture_layers": [2, 4, 5, 8]}, now=utcnow())
    before = json.loads(run_cli("status", str(job_id), "--json").stdout)["capture"]
    assert before["servers"] == [sim.url.replace("http://", "http://user:***@")]
    assert before["total"] == 0 and before["counts"] == {
        "pending": 0, "running": 0, "done": 0, "failed": 0}

    capture_rows(job_id, secret)
    status = run_cli("status", str(job_id), "--json").stdout
    capture = json.loads(status)["capture"]
    assert capture["counts"] == {"pending": 2, "running": 0, "done": 1, "failed": 1}
    assert (capture["total"], capture["waiting"]) == (6, 2)
    assert capture["failures"] == {"capture_mismatch": 1}
    assert capture["reasons"] == {"capture_mismatch": "the engine's token ids are not the "
                                                      "sample's"}
    assert capture["retrying"] == {"timeout": 1} and capture["calls"] == 3
    assert (capture["bytes"], capture["tokens"], capture["layers"]) == (4096, 8, [2, 4, 5, 8])
    # 512 B per token (4 layers × 32 wide × 4 B, from the file captured) × the 32 tokens
    # of the five samples not captured yet.
    assert capture["projected_bytes"] == 512 * 32
    assert capture["free_bytes"] > 0
    text = run_cli("status", str(job_id)).stdout
    assert "capture: 1/6 done, 0 running, 2 pending, 1 failed, 2 not picked up yet" in text
    assert "capture disk: 4.1 kB on disk (8 tokens" in text and "16.4 kB more to write" in text
    assert "capture failed: capture_mismatch 1: the engine's token ids" in text
    assert "hunter2pw" not in status + text + out.stdout

    # Enqueueing the job again changes it to the command's capture servers, as --server.
    again = run_cli("enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--job",
                    "cap", "--capture-server", sim.url, "--json").stdout
    assert "hunter2pw" not in again
    assert json.loads(again)["updated_settings"] == [
        f"capture_servers ['{sim.url.replace('http://', 'http://user:***@')}'] -> "
        f"['{sim.url}']"]
    # Without --capture-server the job keeps the ones it has.
    kept = run_cli("enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model", "--job",
                   "cap", "--json").stdout
    assert json.loads(kept)["updated_settings"] == []
    with session_scope() as s:
        assert s.scalars(select(Job.capture_servers).where(Job.name == "cap")).one() == \
            [sim.url]

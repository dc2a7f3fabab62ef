"""The capture stage on the queue: Celery ``capture`` workers and beat over real
PostgreSQL and Redis, against a capture server of our own that writes files in the
connector's layout and counts the requests it holds at once.

What a real engine can't be made to do here (hold each request 0.3 s, count its
concurrency exactly) is what this server is for; tests/engine/test_capture.py runs
the stage against the real vLLM.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import (
    LAYERS,
    FakeEngine,
    capture_answer,
    capture_job,
    captures_by_state,
    engine_file,
)
from sqlalchemy import select, update
from support import wait_for

from synthq.capture import files

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

HIDDEN = 16


def hidden_of(ids: list[int]) -> np.ndarray:
    """What the fake engine "computes": a function of the token and its position."""
    t = np.arange(len(ids), dtype=np.float32)[:, None, None]
    tok = np.asarray(ids, dtype=np.float32)[:, None, None]
    layer = np.arange(len(LAYERS), dtype=np.float32)[None, :, None]
    h = np.arange(HIDDEN, dtype=np.float32)[None, None, :]
    return (tok * 0.001 + t * 0.01 + layer + h * 0.1).astype(np.float32)


class FakeCaptureServer(FakeEngine):
    def __init__(self, engine_dir: Path, hold: float = 0.3) -> None:
        self.engine_dir, self.hold = engine_dir, hold
        self.active = self.most = self.requests = 0
        #: A hostile server's answer: this path instead of the file it wrote.
        self.answer_path: Path | None = None
        #: Name files by request id, as vLLM's stock connector does (not synthq_name);
        #: write token ids other than the request's.
        self.stock_naming = False
        self.wrong_ids = False
        self.lock = threading.Lock()
        super().__init__()

    def capture(self, body: dict[str, Any]) -> Any:
        with self.lock:
            self.active += 1
            self.requests += 1
            request_no = self.requests
            self.most = max(self.most, self.active)
        try:
            time.sleep(self.hold)
            ids = body["prompt"]
            name = body["kv_transfer_params"]["synthq_name"]
            if self.stock_naming:
                name = f"cmpl-{request_no}-0"
            path = self.engine_dir / f"{name}.safetensors"
            hidden = hidden_of(ids)
            if self.wrong_ids:
                ids = [i + 1 for i in ids]
            path.write_bytes(engine_file(hidden, ids))
        finally:
            with self.lock:
                self.active -= 1
        return capture_answer(self.answer_path or path)


@pytest.fixture
def fake_engine(tmp_path: Path) -> Iterator[FakeCaptureServer]:
    (tmp_path / "engine").mkdir()
    server = FakeCaptureServer(tmp_path / "engine")
    yield server
    server.close()


def _done_samples(job_factory: Any, n: int, engine_url: str, limit: int) -> int:
    """``n`` done samples of 5 to 11 ids each, captured by ``engine_url``."""
    return capture_job(job_factory, n, engine_url, limit=limit,
                       tokens=lambda sid: np.arange(5 + sid % 7, dtype="<i4") + sid)


def _check_store(job_id: int, store: Path) -> int:
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Sample

    with session_scope() as s:
        rows = s.execute(select(Capture.path, Capture.sha256, Sample.input_ids)
                         .join(Sample, Sample.id == Capture.sample_id)
                         .where(Capture.job_id == job_id, Capture.state == "done")).all()
    for path, sha, raw in rows:
        blob = (store / path).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == sha
        tensors, _ = files.read(store / path)
        ids = np.frombuffer(raw, dtype="<i4").tolist()
        np.testing.assert_array_equal(tensors["hidden_states"].array(), hidden_of(ids))
    return len(rows)


def test_two_capture_workers_keep_the_limit_and_survive_a_kill9(
        workers: Any, job_factory: Any, fake_engine: FakeCaptureServer,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 captures: 8 done before the kill, 12 after it (the limit's room four times over).
    n, limit = 20, 3
    monkeypatch.setenv("SYNTHQ_CAPTURE_TASK_SECONDS", "6")
    # Each call held 1 s: the victim's calls are still on the server for a while after the
    # kill (a server finishes, or notices and aborts, a dead client's call), so taking its
    # captures back at once would show here as more than the limit at the server.
    fake_engine.hold = 1.0
    job_id = _done_samples(job_factory, n, fake_engine.url, limit)
    victim = workers.worker(concurrency=2, name="cap1", queues="capture,control")
    workers.worker(concurrency=2, name="cap2", queues="capture,control")
    workers.beat()
    wait_for(lambda: captures_by_state(job_id).get("done", 0) >= 8, 240,
             f"no capture progress: {captures_by_state(job_id)}\n{workers.logs()}")
    victim.kill9()
    wait_for(lambda: captures_by_state(job_id).get("done", 0) == n, 240,
             f"the stage did not finish after the kill: {captures_by_state(job_id)}\n"
             f"{workers.logs()}")
    # The exact limit held across both processes, kill and reclaim included.
    assert fake_engine.most <= limit, fake_engine.most
    # Every capture counted as done has its whole, checked file.
    from synthq.spec.config import get_settings

    assert _check_store(job_id, get_settings().data_dir / "hidden-states") == n
    # Sent twice: only what the victim held at the kill (at most the limit).
    assert n <= fake_engine.requests <= n + limit


def test_a_server_naming_another_file_gets_it_neither_read_nor_deleted(
        job_factory: Any, fake_engine: FakeCaptureServer, tmp_path: Path) -> None:
    """The stage deletes the engine's file once stored: a hostile server answering the path
    of some other file of this host must not get it read into the store or deleted."""
    from synthq.capture.stage import Stage

    victim = tmp_path / "victim.safetensors"
    victim.write_text("not yours")
    fake_engine.answer_path = victim
    job_id = _done_samples(job_factory, 3, fake_engine.url, 2)
    left = Stage(job_id).run()
    assert victim.read_text() == "not yours"
    assert left.done == 0 and left.failures == {"bad_request": 3}, left


def test_a_dead_capture_process_does_not_hold_its_servers_room(
        pg: str, job_factory: Any) -> None:
    """A capture process killed with its servers' room full (limit 3, 3 running): the
    tick frees its captures and finds the job due, though no stage runs to free them
    (it had stalled the stage for good: the surviving worker was never sent a task)."""
    from synthq.capture.due import due_jobs
    from synthq.queue import capture_states
    from synthq.store.db import session_scope, utcnow

    url = "http://127.0.0.1:9/v1"
    job_id = _done_samples(job_factory, 6, url, limit=3)
    with session_scope() as s:
        now = utcnow()
        capture_states.add_missing(s, job_id, now=now)
        held = capture_states.claim(s, job_id, server=url, limit=3, most=3,
                                    worker="gone@elsewhere", token="t" * 32, lease=3600.0,
                                    now=now)
    assert len(held) == 3  # the dead process holds the whole room, leases of an hour
    with session_scope() as s:
        assert due_jobs(s, now=utcnow()) == [job_id]
    assert captures_by_state(job_id) == {"pending": 6}


def test_a_misconfigured_server_stops_the_stage_after_a_few_calls(
        job_factory: Any, fake_engine: FakeCaptureServer, tmp_path: Path) -> None:
    """Issue 30 item 2: a server that names every file its own way (the stock connector's
    naming, without synthq's) failed each of 176 captures with bad_request, each a
    prefill. Now the stage stops after ``stop_after`` (5) identical failures: one line
    naming the server and the cause, in the job's status; a rerun sends nothing until
    ``synthq capture JOB --retry-failed`` after the fix, which captures everything."""
    from support import run_cli

    from synthq.capture.stage import Stage
    from synthq.store.db import session_scope
    from synthq.store.models import Job
    from synthq.views.report import job_status

    fake_engine.answer_path = fake_engine.engine_dir / "cmpl-request-id.safetensors"
    n, limit = 40, 2
    job_id = _done_samples(job_factory, n, fake_engine.url, limit)
    said: list[str] = []
    left = Stage(job_id, say=said.append).run()
    calls = fake_engine.requests
    print(f"\nmisconfigured capture server: stopped after {calls} calls of {n}")
    assert 5 <= calls <= 5 + limit - 1, calls  # the fifth, and what was in flight with it
    assert left.failures == {"bad_request": calls} and left.done == 0, left
    [line] = [x for x in said if "stopped" in x]
    assert line.startswith(f"capture stopped: server {fake_engine.url} failed 5 captures in "
                           "a row with bad_request: the server answered the file")
    assert "--retry-failed" in line
    with session_scope() as s:
        status = job_status(s, s.get_one(Job, job_id))
    assert status.capture is not None and status.capture.stopped == line
    assert line in status.capture.lines()
    Stage(job_id, say=said.append).run()  # stopped: sends nothing
    assert fake_engine.requests == calls
    fake_engine.answer_path = None  # the fix
    run_cli("capture", str(job_id), "--retry-failed")
    assert captures_by_state(job_id) == {"done": n}
    with session_scope() as s:
        status = job_status(s, s.get_one(Job, job_id))
    assert status.capture is not None and status.capture.stopped is None


def test_a_per_turn_sample_is_captured_one_prompt_per_example(
        job_factory: Any, fake_engine: FakeCaptureServer) -> None:
    """Issue 30 item 3: a per-turn sample (``--examples per-turn``) holds its examples' ids
    end to end, each a whole prompt of its own. Before, the stage refused it
    (invalid_input). Now each example is sent as its own prompt, and the sample's file
    holds their states end to end: its rows align with the sample's concatenated ids
    and mask, each example's from its own offset (what training reads)."""
    from synthq.capture.stage import Stage
    from synthq.spec.config import get_settings
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Sample
    from synthq.training.captured import captured_paths

    job_id = _done_samples(job_factory, 3, fake_engine.url, 2)
    pieces = [np.arange(5, dtype="<i4") + 100, np.arange(7, dtype="<i4") + 200]
    with session_scope() as s:
        sid = s.scalar(select(Sample.id).where(Sample.job_id == job_id).order_by(Sample.id))
        s.execute(update(Sample).where(Sample.id == sid).values(
            input_ids=np.concatenate(pieces).tobytes(), num_tokens=12,
            loss_mask=np.array([0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1], np.uint8).tobytes(),
            examples=[{"turn": 0, "tokens": 5, "supervised": 2},
                      {"turn": 2, "tokens": 7, "supervised": 3}]))
    left = Stage(job_id).run()
    assert left.done == 3 and left.failures == {}, left
    assert fake_engine.requests == 4  # two for the per-turn sample, one for each other
    with session_scope() as s:
        path = s.scalar(select(Capture.path).where(Capture.sample_id == sid))
    tensors, meta = files.read(get_settings().data_dir / "hidden-states" / path)
    got = tensors["hidden_states"].array()
    want = np.concatenate([hidden_of(p.tolist()) for p in pieces])
    np.testing.assert_array_equal(got, want)  # each example computed as its own prompt
    assert not np.array_equal(got, hidden_of(np.concatenate(pieces).tolist()))
    assert tensors["token_ids"].array().tolist() == np.concatenate(pieces).tolist()
    assert meta["example_tokens"] == "5,7"
    found = captured_paths(job_id, LAYERS)
    assert found[f"{sid}:0"][1] == 0 and found[f"{sid}:2"][1] == 5
    assert str(sid) not in found


@pytest.mark.parametrize("case", ["declared", "undeclared", "outside", "symlink", "other_ids"])
def test_stock_connector_files_are_taken_only_from_the_declared_folder(
        job_factory: Any, fake_engine: FakeCaptureServer, tmp_path: Path, case: str) -> None:
    """Issue 30 item 1: files named by request id (vLLM's stock connector) are captured
    when the server has a declared engine-files folder (``--engine-files URL=DIR``), and
    then only from it: a path outside it, a symlink in it, and a file whose token_ids are
    not the sample's are refused, and nothing but the request's own file is read or
    deleted. Without the folder such files are refused as before."""
    from synthq.capture.stage import Stage
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    fake_engine.stock_naming = True
    n = 6
    job_id = _done_samples(job_factory, n, fake_engine.url, 2)
    if case != "undeclared":
        with session_scope() as s:
            s.execute(update(Job).where(Job.id == job_id).values(
                capture_files={fake_engine.url: str(fake_engine.engine_dir)}))
    victim = tmp_path / "victim.safetensors"
    victim.write_text("not yours")
    if case == "outside":
        fake_engine.answer_path = victim
    elif case == "symlink":
        link = fake_engine.engine_dir / "link.safetensors"
        link.symlink_to(victim)
        fake_engine.answer_path = link
    fake_engine.wrong_ids = case == "other_ids"
    left = Stage(job_id).run()
    assert victim.read_text() == "not yours"
    if case == "declared":
        assert left.done == n and left.failures == {}, left
        from synthq.spec.config import get_settings

        assert _check_store(job_id, get_settings().data_dir / "hidden-states") == n
        assert list(fake_engine.engine_dir.iterdir()) == []  # each taken, then deleted
    elif case == "other_ids":
        # The stage stops a server after 5 identical failures: the sixth capture is
        # refused too, or never sent, as the stop races with its claim.
        assert left.done == 0 and set(left.failures) == {"capture_mismatch"}, left
        assert 5 <= left.failures["capture_mismatch"] <= n, left
    else:
        assert left.done == 0 and set(left.failures) == {"bad_request"}, left
        if case == "symlink":
            assert (fake_engine.engine_dir / "link.safetensors").is_symlink()  # left alone


def test_the_engine_files_folder_is_checked(pg: str, tmp_path: Path) -> None:
    """A declared folder must be an absolute, existing, real directory."""
    from synthq.capture.confine import check_folder
    from synthq.core.errors import UserError

    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    assert check_folder("u", str(tmp_path / "real")) == tmp_path / "real"
    for bad, why in [("relative/dir", "absolute"), (str(tmp_path / "none"), "not a folder"),
                     (str(tmp_path / "via"), "symlink")]:
        with pytest.raises(UserError, match=why):
            check_folder("u", bad)


def test_a_cancelled_jobs_captures_are_not_claimed(
        job_factory: Any, fake_engine: FakeCaptureServer) -> None:
    """A cancel is final for the capture stage too: `synthq capture` of a cancelled job is
    refused in one line and calls nothing, and a stage running when its job is cancelled
    claims nothing more and ends, its captures left pending (before, both captured the
    whole job)."""
    from support import run_cli

    from synthq.app import service
    from synthq.capture.stage import Stage
    from synthq.core.enums import JobState
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    n = 30
    job_id = _done_samples(job_factory, n, fake_engine.url, 2)
    said: list[str] = []
    out: list[Any] = []
    runner = threading.Thread(target=lambda: out.append(Stage(job_id, say=said.append).run()),
                              daemon=True)
    runner.start()
    wait_for(lambda: fake_engine.requests >= 1, timeout=30)
    with session_scope() as s:  # as `synthq cancel` and the API's cancel
        service.set_job_state(s, s.get_one(Job, job_id), JobState.CANCELLED)
    runner.join(60)
    assert not runner.is_alive() and out, "the stage ran on after its job was cancelled"
    sent = fake_engine.requests
    print(f"\ncancelled after the first call: {sent} of {n} captures sent")
    assert sent < n, sent  # at most what it held at the cancel and claimed just before
    assert captures_by_state(job_id) == {"done": sent, "pending": n - sent}
    assert [x for x in said if "cancelled" in x] == [
        f"job job1 was cancelled: capture stopped with {n - sent} captures not run"], said
    result = run_cli("capture", str(job_id), check=False)
    assert (result.returncode, result.stderr) == (
        2, "error: job job1 is cancelled: its captures do not run\n"), result
    assert fake_engine.requests == sent

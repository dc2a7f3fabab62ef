"""Issue 41: the capture stage against servers that misbehave on purpose, on real sockets
and real files (tests/hostile_capture.py): an answer trickled a byte at a time, a
server that answers 500 to everything, a symlink planted as the server answers, a path
through a file. Each stage runs with a claim deadline (``Stage(seconds=...)``) so that
the code before the fix, which never ended, fails here instead of hanging."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import LAYERS, capture_job, captures_by_state, engine_file
from hostile_capture import HostileServer, Request, answer, describe_or
from sqlalchemy import select

pytestmark = pytest.mark.integration


def _capture_bytes(ids: list[int]) -> bytes:
    return engine_file(np.ones((len(ids), len(LAYERS), 8), dtype="<f4"), ids, checksum=False)


def _run(job_id: int, seconds: float, within: float, server: HostileServer) -> Any:
    """The stage in a thread; its summary, or a failure if it is still running after
    ``within`` s (the server is closed then, which releases a stage that never gives up)."""
    from synthq.capture.stage import Stage

    out: list[Any] = []
    said: list[str] = []
    thread = threading.Thread(
        target=lambda: out.append(Stage(job_id, seconds=seconds, say=said.append).run()),
        daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(within)
    took = time.monotonic() - started
    if thread.is_alive():
        server.close()
        thread.join(30)
        pytest.fail(f"the stage still ran after {within:g} s: {captures_by_state(job_id)}; {said}")
    assert out, "the stage raised (see the log)"
    return out[0], took, said


@pytest.fixture
def short_capture_timeouts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from synthq.spec.config import get_settings

    monkeypatch.setenv("SYNTHQ_CAPTURE_TIMEOUT", "1")
    monkeypatch.setenv("SYNTHQ_CAPTURE_FILE_TIMEOUT", "1")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.parametrize("where", ["body", "headers"])
def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_deadline(
        job_factory: Any, short_capture_timeouts: None, where: str) -> None:
    """Item 5: a body trickling a byte at a time never ended (each byte reset the read
    timeout); the lease expired and the same process sent the capture again. Now each
    capture ends at its deadline (capture timeout + file timeout) as ``timeout``."""
    def trickle(server: HostileServer, conn: socket.socket, req: Request) -> None:
        if where == "headers":
            server.trickle(conn, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000, 0.2)
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 10000\r\n\r\n")
            server.trickle(conn, b" " * 10_000, 0.2)

    server = HostileServer(describe_or(trickle))
    try:
        job_id = capture_job(job_factory, 1, server.url, max_attempts=2)
        left, took, _ = _run(job_id, seconds=30, within=25, server=server)
    finally:
        server.close()
    print(f"\ntrickled {where}: {left.failures} after {took:.1f} s, "
          f"{server.requests.get('POST')} calls")
    assert left.failures == {"timeout": 1} and left.done == 0, left
    assert server.requests.get("POST") == 2  # each attempt once: none sent again meanwhile
    assert took < 15, took


def test_a_jobs_own_capture_timeout_bounds_its_calls(
        job_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's ``capture_timeout`` (``synthq capture JOB --timeout``, set through the
    service function the CLI and the API share) bounds its calls, not the service's 120 s:
    an answer trickling its headers ends as ``timeout`` well before the service's bound."""
    from synthq.app import service
    from synthq.spec.config import get_settings
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    monkeypatch.setenv("SYNTHQ_CAPTURE_FILE_TIMEOUT", "1")  # the service's call timeout kept
    get_settings.cache_clear()
    assert get_settings().capture_timeout >= 60

    def trickle(server: HostileServer, conn: socket.socket, req: Request) -> None:
        server.trickle(conn, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000, 0.2)

    server = HostileServer(describe_or(trickle))
    try:
        job_id = capture_job(job_factory, 1, server.url, max_attempts=1)
        with session_scope() as s:
            after = service.set_capture(s, s.get_one(Job, job_id), {"capture_timeout": 1.0})
        assert after["capture_timeout"] == 1.0
        left, took, _ = _run(job_id, seconds=30, within=25, server=server)
    finally:
        server.close()
        get_settings.cache_clear()
    assert left.failures == {"timeout": 1} and left.done == 0, left
    assert took < 15, took


def test_a_server_that_always_answers_500_fails_its_captures(
        job_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Low item: a capture server answering 500 to every call was probed for ever (47 calls
    in 90 s) and nothing failed or paused. It is still seen down (one probe at a time), but
    an answer it gives is charged, as generation charges it: each capture fails as
    ``server_error`` after max_attempts, and the calls end."""
    from synthq.queue import outage

    monkeypatch.setattr(outage, "PROBE_INTERVAL", 0.05)

    def always_500(server: HostileServer, conn: socket.socket, req: Request) -> None:
        answer(conn, {"error": "boom"}, status="500 Internal Server Error")

    server = HostileServer(describe_or(always_500))
    try:
        job_id = capture_job(job_factory, 3, server.url, max_attempts=2)
        left, took, said = _run(job_id, seconds=20, within=40, server=server)
    finally:
        server.close()
    calls = server.requests.get("POST")
    print(f"\nalways 500: {left.failures} after {took:.1f} s and {calls} calls")
    assert left.failures == {"server_error": 3} and left.done == 0, (left, said)
    assert calls == 6, calls  # 3 captures × max_attempts
    assert any("is down" in line for line in said), said  # still seen down, probed
    assert took < 18, took  # ended on its own, not at the claim deadline


def test_a_symlink_planted_as_the_server_answers_is_not_followed(
        job_factory: Any, tmp_path: Path) -> None:
    """Items 2-3: the server writes a valid file of the sample's ids outside its folder and
    answers a path to a symlink to it (planted before the answer is sent). Before, the
    stage read it through the link and stored it. Now it is refused, the target kept."""
    engine, victims = tmp_path / "engine", tmp_path / "victims"
    engine.mkdir()
    victims.mkdir()

    def plant(server: HostileServer, conn: socket.socket, req: Request) -> None:
        name = req.body["kv_transfer_params"]["synthq_name"]
        victim = victims / f"{name}.safetensors"
        victim.write_bytes(_capture_bytes(req.body["prompt"]))
        (engine / f"{name}.safetensors").symlink_to(victim)
        answer(conn, {"choices": [{"text": ""}], "kv_transfer_params": {
            "hidden_states_path": str(engine / f"{name}.safetensors")}})

    server = HostileServer(describe_or(plant))
    try:
        job_id = capture_job(job_factory, 3, server.url)
        left, _, _ = _run(job_id, seconds=20, within=40, server=server)
    finally:
        server.close()
    assert left.done == 0 and left.failures == {"bad_request": 3}, left
    assert len(list(victims.iterdir())) == 3  # read by no one, deleted by no one


def test_a_path_through_a_file_fails_in_one_line(job_factory: Any, tmp_path: Path) -> None:
    """Item 2: ``/etc/hostname/<name>.safetensors`` made the cleanup raise
    NotADirectoryError: ``synthq capture`` exited 1 with a traceback on every run."""
    hostname = tmp_path / "hostname"
    hostname.write_text("host\n")

    def through_a_file(server: HostileServer, conn: socket.socket, req: Request) -> None:
        name = req.body["kv_transfer_params"]["synthq_name"]
        answer(conn, {"choices": [{"text": ""}], "kv_transfer_params": {
            "hidden_states_path": str(hostname / f"{name}.safetensors")}})

    server = HostileServer(describe_or(through_a_file))
    try:
        job_id = capture_job(job_factory, 3, server.url)
        left, _, _ = _run(job_id, seconds=20, within=40, server=server)
    finally:
        server.close()
    assert left.done == 0 and left.failures == {"bad_request": 3}, left
    from synthq.store.db import session_scope
    from synthq.store.models import Capture

    with session_scope() as s:
        messages = list(s.scalars(select(Capture.error_message).where(
            Capture.job_id == job_id)))
    assert all("is not a folder" in m and "\n" not in m for m in messages), messages
    assert hostname.read_text() == "host\n"


def test_the_capture_body_names_each_file(job_factory: Any, tmp_path: Path) -> None:
    """The happy path through the same server: a file the server writes in its one folder
    is taken, stored and deleted (json answers of the connector's shape)."""
    engine = tmp_path / "engine"
    engine.mkdir()

    def write(server: HostileServer, conn: socket.socket, req: Request) -> None:
        path = engine / f"{req.body['kv_transfer_params']['synthq_name']}.safetensors"
        path.write_bytes(_capture_bytes(req.body["prompt"]))
        answer(conn, json.loads(json.dumps({"choices": [{"text": ""}], "kv_transfer_params": {
            "hidden_states_path": str(path)}})))

    server = HostileServer(describe_or(write))
    try:
        job_id = capture_job(job_factory, 3, server.url, limit=2)
        left, _, _ = _run(job_id, seconds=20, within=40, server=server)
    finally:
        server.close()
    assert left.done == 3 and left.failures == {}, left
    assert list(engine.iterdir()) == []

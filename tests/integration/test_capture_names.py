"""Each capture attempt names its engine file anew (issue 41 item 1): a re-send while the
first attempt still runs on the server never reuses the first's name.

vLLM with synthq's connector serves a second request naming a file in flight without
a file (the connector refuses the name); with vLLM's stock code such a pair wedged the
engine for good. A capture server of the test's own holds the first attempt until the
re-send is done, and records every name it is sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select, update

from synthq.capture import files

pytestmark = [pytest.mark.integration]

LAYERS = [2, 4, 5, 8]
HIDDEN = 16


class HoldingServer:
    """Writes each request's file as the connector does (``<synthq_name>.safetensors``)
    and answers its path; the first request is held until :attr:`release` is set."""

    def __init__(self, engine_dir: Path) -> None:
        self.engine_dir = engine_dir
        self.names: list[str] = []
        #: Set once the first request has arrived (the first attempt runs).
        self.first_arrived = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._json({"data": [{"id": "fake"}]} if self.path.endswith("/models")
                           else {"version": "fake"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                name = body["kv_transfer_params"]["synthq_name"]
                server.names.append(name)
                if len(server.names) == 1:
                    server.first_arrived.set()
                    server.release.wait(60)
                ids = body["prompt"]
                hidden = np.zeros((len(ids), len(LAYERS), HIDDEN), dtype=np.float32)
                hidden += np.arange(len(ids), dtype=np.float32)[:, None, None]
                tensors = {"hidden_states": files.Tensor("F32", hidden.shape, hidden.tobytes()),
                           "token_ids": files.Tensor("I64", (len(ids),), np.asarray(
                               ids, dtype="<i8").tobytes())}
                path = server.engine_dir / f"{name}.safetensors"
                path.write_bytes(files.dumps(tensors, {"sha256_hidden_states": hashlib.sha256(
                    hidden.tobytes()).hexdigest()}))
                self._json({"choices": [{"text": ""}],
                            "kv_transfer_params": {"hidden_states_path": str(path)}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def holding(tmp_path: Path) -> Iterator[HoldingServer]:
    (tmp_path / "engine").mkdir()
    server = HoldingServer(tmp_path / "engine")
    yield server
    server.close()


def test_a_resend_while_the_first_attempt_runs_names_a_new_file(
        job_factory: Any, holding: HoldingServer) -> None:
    from synthq.capture.stage import Stage
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Job, Sample

    report = job_factory(["one prompt"])
    with session_scope() as s:
        sid = s.scalar(select(Sample.id).where(Sample.job_id == report.job_id))
        tokens = np.arange(7, dtype="<i4") + 3
        s.execute(update(Sample).where(Sample.id == sid).values(
            state="done", input_ids=tokens.tobytes(), num_tokens=len(tokens),
            tokenize_version=1))
        s.execute(update(Job).where(Job.id == report.job_id).values(
            capture_servers=[holding.url], capture_layers=LAYERS, capture_limit=2,
            state="finished"))
    errors: list[BaseException] = []

    def first_stage() -> None:
        try:
            Stage(report.job_id).run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    first = threading.Thread(target=first_stage, daemon=True)
    first.start()
    assert holding.first_arrived.wait(60), "the first attempt was never sent"
    # The re-send: a process that takes every lease as expired (as `synthq capture` after
    # a crash does) claims the capture again while the server still runs the first call.
    second = Stage(report.job_id, reclaim_all=True).run()
    holding.release.set()
    first.join(60)
    assert not first.is_alive() and not errors, errors
    assert second.done == 1, second
    first_name, resend_name = holding.names
    assert first_name != resend_name, holding.names
    for name in holding.names:
        assert name.startswith(f"synthq-{report.job_id}-{sid}-"), name
    with session_scope() as s:
        capture = s.scalars(select(Capture).where(Capture.sample_id == sid)).one()
        assert (capture.state, capture.attempts) == ("done", 2)
    # The stored file is the re-send's; each attempt deleted only its own engine file.
    assert list(holding.engine_dir.iterdir()) == []

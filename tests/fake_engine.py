"""What the capture tests share: a fake capture engine over real HTTP, the files it writes,
and a capture job of done samples to point at it.

:class:`FakeEngine` is an ``http.server`` on 127.0.0.1 (a port of its own, served in a
daemon thread) answering ``GET /v1/models`` and ``/version`` as vLLM does; a test's engine
gives only its capture call: :meth:`FakeEngine.capture` takes the POST's JSON body and
returns the JSON answer. Servers that misbehave at the socket level (a trickled answer,
a 500) are tests/hostile_capture.py's.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from sqlalchemy import func, select, update

from synthq.capture import files

#: The capture layers of the tests' jobs (an 8-layer target's drafter layers).
LAYERS = [2, 4, 5, 8]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        model = self.server.engine.model
        self._json({"data": [{"id": model}]} if self.path.endswith("/models")
                   else {"version": model})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self._json(self.server.engine.capture(body))


class _Server(ThreadingHTTPServer):
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        super().__init__(("127.0.0.1", 0), _Handler)


class FakeEngine:
    """A capture engine of the test's own at :attr:`url` (``http://127.0.0.1:PORT/v1``),
    serving from construction until :meth:`close`. A subclass sets its own state before
    calling ``super().__init__()`` and gives :meth:`capture`."""

    #: The one model ``/v1/models`` lists (and ``/version``'s answer).
    model = "fake"

    def __init__(self) -> None:
        self.httpd = _Server(self)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def capture(self, body: dict[str, Any]) -> Any:
        """The answer to a capture call (``POST .../completions``) of JSON ``body``."""
        raise NotImplementedError

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def capture_answer(path: Any) -> dict[str, Any]:
    """A capture call's answer naming the engine file at ``path`` (the connector's shape)."""
    return {"choices": [{"text": ""}], "kv_transfer_params": {"hidden_states_path": str(path)}}


def engine_file(hidden: np.ndarray, ids: Sequence[int], *, checksum: bool = True,
                **meta: str) -> bytes:
    """An engine file: ``hidden_states`` (F32 ``hidden``) and ``token_ids`` (I64 ``ids``),
    with the states' sha256 in its metadata (``checksum``) and then ``meta``."""
    head = {}
    if checksum:
        head["sha256_hidden_states"] = hashlib.sha256(hidden.tobytes()).hexdigest()
    return files.dumps({"hidden_states": files.Tensor("F32", hidden.shape, hidden.tobytes()),
                        "token_ids": files.Tensor("I64", (len(ids),), np.asarray(
                            ids, dtype="<i8").tobytes())}, {**head, **meta})


def capture_job(job_factory: Any, n: int, url: str, *, limit: int = 1,
                layers: list[int] = LAYERS,
                tokens: Callable[[int], np.ndarray] | None = None, **fields: Any) -> int:
    """A finished job of ``n`` done samples (prompts ``prompt 0``, ...; ``fields`` go to its
    spec) captured by ``url`` at ``layers`` with ``capture_limit`` ``limit``: each sample's
    ids ``tokens(sample_id)``, five ids from the sample's id unless given."""
    from synthq.store.db import session_scope
    from synthq.store.models import Job, Sample

    report = job_factory([f"prompt {i}" for i in range(n)], **fields)
    with session_scope() as s:
        for sid in list(s.scalars(select(Sample.id).where(Sample.job_id == report.job_id))):
            ids = np.arange(5, dtype="<i4") + sid if tokens is None else tokens(sid)
            s.execute(update(Sample).where(Sample.id == sid).values(
                state="done", input_ids=ids.tobytes(), num_tokens=len(ids),
                tokenize_version=1))
        s.execute(update(Job).where(Job.id == report.job_id).values(
            capture_servers=[url], capture_layers=layers, capture_limit=limit,
            state="finished"))
    return int(report.job_id)


def captures_by_state(job_id: int) -> dict[str, int]:
    """The job's captures counted by state."""
    from synthq.store.db import session_scope
    from synthq.store.models import Capture

    with session_scope() as s:
        return {str(k): v for k, v in s.execute(
            select(Capture.state, func.count()).where(Capture.job_id == job_id)
            .group_by(Capture.state))}

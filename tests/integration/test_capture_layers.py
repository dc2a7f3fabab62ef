"""Issue 43 item 5: a capture server started with other layers than the job's.

The file's ``hidden_states`` [tokens, layers, hidden] only counts its layers: an engine
started with ``eagle_aux_hidden_state_layer_ids`` [1, 3, 5, 8] for a job of [2, 4, 5, 8]
passed, and the drafter trained on the wrong layers. synthq's connector now names the
layers in each file's metadata (synthq.capture.protocol.LAYERS_KEY); here a capture server
of our own (tests/hostile_capture.py, on a real socket, writing real files as the
connector does) names other ones with the same count, and each way in refuses it in one
line naming both lists, nothing stored as done: the capture stage (at its first file),
the streamed run's start (synthq.capture.spool.probe) and ``--capture inline``'s probe
(synthq.capture.inline.probe). A file without the key (vLLM's stock connector) keeps the
count check, and the job's own ids pass. tests/engine/test_capture.py's layer test runs
the real connector in vLLM.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import LAYERS, capture_job, captures_by_state, engine_file
from hostile_capture import HostileServer, Request, answer, describe_or
from sqlalchemy import select

from synthq.capture.protocol import LAYERS_KEY, NAME_KEY
from synthq.core.errors import UserError

pytestmark = pytest.mark.integration

OTHER = [1, 3, 5, 8]  # the same count: only the ids tell them apart
HIDDEN = 8


class Engine:
    """Writes each request's file as synthq's connector does, naming ``layer_ids`` in its
    metadata (None: as the stock connector, no ids), and answers its path."""

    def __init__(self, folder: Path, layer_ids: list[int] | None) -> None:
        self.folder, self.layer_ids = folder, layer_ids
        self.server = HostileServer(describe_or(self._capture))
        self.url = self.server.url

    def _capture(self, server: HostileServer, conn: socket.socket, req: Request) -> None:
        body = req.body
        prompt = body["prompt"]
        if isinstance(prompt, str):  # --capture inline's probe: prompt and output, less one
            usage = {"prompt_tokens": 3, "completion_tokens": int(body["max_tokens"])}
            ids = list(range(10, 10 + sum(usage.values()) - 1))
        else:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 1}
            ids = [int(i) for i in prompt]
        states = np.ones((len(ids), len(LAYERS), HIDDEN), dtype="<f4")
        meta = {"writer": "synthq_connector"}
        if self.layer_ids is not None:
            meta[LAYERS_KEY] = ",".join(str(i) for i in self.layer_ids)
        path = self.folder / f"{body['kv_transfer_params'][NAME_KEY]}.safetensors"
        path.write_bytes(engine_file(states, ids, **meta))
        answer(conn, {"choices": [{"text": ""}], "usage": usage,
                      "kv_transfer_params": {"hidden_states_path": str(path)}})

    @property
    def calls(self) -> int:
        return self.server.requests.get("POST", 0)


@pytest.fixture
def engine_at(tmp_path: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def start(layer_ids: list[int] | None) -> Engine:
        folder = tmp_path / f"engine{len(made)}"
        folder.mkdir()
        made.append(Engine(folder, layer_ids))
        return made[-1]

    yield start
    for engine in made:
        engine.server.close()


def _stage(job_id: int) -> tuple[Any, list[str]]:
    """The capture stage run to its end in a thread (120 s at most: a failure, not a hang)."""
    from synthq.capture.stage import Stage

    out: list[Any] = []
    said: list[str] = []
    thread = threading.Thread(
        target=lambda: out.append(Stage(job_id, seconds=60, say=said.append).run()),
        daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"the stage still ran after 120 s: {captures_by_state(job_id)}"
    assert out, "the stage raised (see the log)"
    return out[0], said


def _stored() -> list[Path]:
    from synthq.capture.stage import store

    root = store().root
    return list(root.rglob("*.safetensors")) if root.exists() else []


def test_the_stage_stops_at_the_first_file_of_other_layers(
        job_factory: Any, engine_at: Any) -> None:
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    engine = engine_at(OTHER)
    job_id = capture_job(job_factory, 3, engine.url)
    left, said = _stage(job_id)
    stops = [line for line in said if "stopped" in line]
    print(f"\nthe stage said: {stops}")
    assert len(stops) == 1 and "\n" not in stops[0], said
    assert f"captures layers {OTHER}, the job's are {LAYERS}" in stops[0], stops[0]
    # One file was enough: the others were not sent (each a prefill), nothing counts done.
    assert engine.calls == 1, engine.calls
    assert left.done == 0 and captures_by_state(job_id).get("done", 0) == 0, left
    assert _stored() == []
    with session_scope() as s:
        assert s.scalar(select(Job.capture_stopped).where(Job.id == job_id)) == stops[0]


@pytest.mark.parametrize("layer_ids", [LAYERS, None], ids=["the-jobs-ids", "stock-no-ids"])
def test_the_jobs_own_layers_or_a_stock_file_of_their_count_are_captured(
        job_factory: Any, engine_at: Any, layer_ids: list[int] | None) -> None:
    engine = engine_at(layer_ids)
    job_id = capture_job(job_factory, 3, engine.url)
    left, said = _stage(job_id)
    assert left.done == 3 and engine.calls == 3, (left, said)
    assert len(_stored()) == 3


def _loaded_job(job_factory: Any, url: str) -> Any:
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    job_id = capture_job(job_factory, 1, url)
    with session_scope() as s:
        job = s.get(Job, job_id)
        s.expunge(job)
    return job


def test_a_streamed_runs_probe_refuses_other_layers_in_one_line(
        job_factory: Any, engine_at: Any) -> None:
    from synthq.capture.spool import probe

    ids = np.arange(6, dtype=np.int64) + 7
    other, same = engine_at(OTHER), engine_at(LAYERS)
    with pytest.raises(UserError) as caught:
        probe(_loaded_job(job_factory, other.url), [other.url], LAYERS, ids, hidden=None,
              timeout=30)
    line = str(caught.value)
    print(f"\nthe streamed run's probe: {line}")
    assert "\n" not in line and other.url in line, line
    assert f"captures layers {OTHER}, the job's are {LAYERS}" in line, line
    got = probe(_loaded_job(job_factory, same.url), [same.url], LAYERS, ids, hidden=None,
                timeout=30)
    assert list(got.engines) == [same.url] and got.layers == len(LAYERS)


def test_the_inline_probe_refuses_other_layers_in_one_line(engine_at: Any) -> None:
    from synthq.capture.deadline import client
    from synthq.capture.inline import probe

    other, same, stock = engine_at(OTHER), engine_at(LAYERS), engine_at(None)
    with client() as http:
        with pytest.raises(UserError) as caught:
            probe(http, other.url, "hostile", layers=LAYERS)
        line = str(caught.value)
        print(f"\nthe inline probe: {line}")
        assert "\n" not in line and other.url in line, line
        assert f"captures layers {OTHER}, the job's are {LAYERS}" in line, line
        assert probe(http, same.url, "hostile", layers=LAYERS) == same.folder
        assert probe(http, stock.url, "hostile", layers=LAYERS) == stock.folder
        with pytest.raises(UserError, match=r"not \[tokens, 3, hidden\]"):
            probe(http, stock.url, "hostile", layers=LAYERS[:3])  # the count still checked
    # Each probe deleted its file.
    for engine in (other, same, stock):
        assert list(engine.folder.glob("*.safetensors")) == []

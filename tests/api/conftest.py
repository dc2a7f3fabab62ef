"""Fixtures for the REST API: an in-process client and a real `synthq api` process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import child_env

from synthq.testing import procs

#: The token the tests' API runs with (not the .env.example placeholder).
TOKEN = "test-token-5f0c2a9b7e41d3c8a6"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _reset_api() -> None:
    from api.config import api_settings

    api_settings.cache_clear()


@pytest.fixture(autouse=True)
def allowed_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The API accepts no server URL unless SYNTHQ_ALLOWED_SERVERS lists its host: the
    tests' servers (the simulator, unreachable ports) are all on this machine."""
    from synthq.spec.config import get_settings

    monkeypatch.setenv("SYNTHQ_ALLOWED_SERVERS", "127.0.0.1,localhost")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def api_env(pg: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("SYNTHQ_API_TOKEN", TOKEN)
    monkeypatch.delenv("SYNTHQ_API_DEV", raising=False)
    _reset_api()
    yield TOKEN
    _reset_api()


@pytest.fixture
def client(api_env: str) -> Iterator[Any]:
    """A TestClient of a fresh app, sending the bearer token."""
    from fastapi.testclient import TestClient

    from api.app import create_app

    with TestClient(create_app(), headers=AUTH) as c:
        yield c


class ApiServer(procs.ApiServer):
    """`synthq api` in a subprocess on a free port, its output in a log file."""

    def __init__(self, log_path: Path, **env: str) -> None:
        super().__init__(log_path, child_env(SYNTHQ_API_TOKEN=TOKEN, **env))


@pytest.fixture
def api_server(pg: str, tmp_path: Path) -> Iterator[Callable[..., ApiServer]]:
    """``api_server(**env)`` starts `synthq api` against the test database."""
    started: list[ApiServer] = []

    def start(**env: str) -> ApiServer:
        server = ApiServer(tmp_path / f"api-{len(started)}.log", **env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def settle(job_id: int, max_rounds: int = 20) -> None:
    """Dispatch and process in this process (the production path), ignoring backoff waits."""
    from sqlalchemy import select, update

    from synthq.queue.dispatch import Dispatched, dispatch
    from synthq.serving.executor import process_sample
    from synthq.store.db import session_scope
    from synthq.store.models import Sample

    for _ in range(max_rounds):
        batch: list[Dispatched] = []
        dispatch(batch.extend, job_ids=[job_id])
        for item in batch:
            process_sample(item.sample_id, item.token, job_id=item.job_id)
        with session_scope() as s:
            open_ = s.scalars(select(Sample.id).where(
                Sample.job_id == job_id,
                Sample.state.in_(["pending", "queued", "running"]))).all()
            if not open_:
                return
            s.execute(update(Sample).where(Sample.id.in_(open_))
                      .values(next_attempt_at=Sample.created_at))
    raise AssertionError(f"job {job_id} did not settle")

"""The engine tier: one real vLLM (CPU, its own venv) per test session, serving a tiny
target the session builds (``synthq testing tiny-target``).

If the server does not come up, every test of the tier fails with the server's log:
the tier is never skipped (``scripts/vllm-venv.sh`` makes the venv first).

``SYNTHQ_ENGINE_TARGET=DIR`` reuses a target built earlier (iterating on a test
without the minute the build takes on a busy machine); ``SYNTHQ_ENGINE_URL=URL``
(with the target) reuses a server already running (its name: ``tiny``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from synthq.testing.vllm import VllmServer, VllmStartError

if TYPE_CHECKING:
    from capture_server import CaptureServer

#: The served model name.
SERVED = "tiny"
#: The server's context window (the 400 test sends more).
MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """``synthq testing tiny-target``'s model, built once per version of its code (a
    minute or more on a busy machine) and kept in synthq's cache."""
    if given := os.environ.get("SYNTHQ_ENGINE_TARGET"):
        return Path(given)
    from synthq.testing.tiny import cached_tiny_target

    return cached_tiny_target()


class Engine:
    """The running server: ``url`` (OpenAI base URL), ``name``, ``target`` (its model dir)."""

    def __init__(self, url: str, target: Path, server: VllmServer | None) -> None:
        self.url, self.target, self.server, self.name = url, target, server, SERVED

    def metrics(self) -> dict[str, float]:
        from synthq.testing.vllm import metrics

        return metrics(self.url)

    def log(self) -> str:
        if self.server is None:
            return "(a server started outside the tests)"
        return self.server.log_path.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="session")
def _engine_server(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[VllmServer | VllmStartError | None]:
    """The session's server, started (not yet serving); the error when it cannot start;
    None for ``SYNTHQ_ENGINE_URL``."""
    if os.environ.get("SYNTHQ_ENGINE_URL"):
        yield None
        return
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    try:
        server = VllmServer.start(tiny_target, SERVED, log_path=log,
                                  max_model_len=MAX_MODEL_LEN)
    except VllmStartError as exc:
        yield exc
        return
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _engine_starts_early(request: pytest.FixtureRequest) -> None:
    """The session's server starts with the first test of its group (``engine``: the
    modules that use it, kept on one worker by scripts/test.sh), not with the first
    test that needs it: its cold start (half a minute, one core) overlaps that group's
    tests that run first. The other engine groups (the capture server's, the real
    target's) run on other workers and never start it."""
    group = request.node.get_closest_marker("xdist_group")
    if group is not None and group.args[:1] == ("engine",):
        request.getfixturevalue("_engine_server")


@pytest.fixture(scope="session")
def engine(_engine_server: VllmServer | VllmStartError | None, tiny_target: Path) -> Engine:
    if _engine_server is None:
        return Engine(os.environ["SYNTHQ_ENGINE_URL"], tiny_target, None)
    try:
        if isinstance(_engine_server, VllmStartError):
            raise _engine_server
        _engine_server.wait_ready(
            timeout=float(os.environ.get("SYNTHQ_VLLM_START_TIMEOUT", 900)))
    except VllmStartError as exc:
        pytest.fail(f"the engine tier needs a real vLLM, and it did not start: {exc}",
                    pytrace=False)
    return Engine(_engine_server.base_url, tiny_target, _engine_server)


@pytest.fixture(scope="session")
def launched_capture_server(tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[CaptureServer]:
    """The session's capture server (synthq's connector: tests/engine/capture_server.py's
    configuration), launched once and shared by the capture and streamed-features
    modules (one cold start, not one per module: scripts/test.sh keeps both on one
    process). It may not serve yet, or a test that killed it may have failed before its
    restart: each module's ``capture_server`` takes it through
    :func:`capture_server.serving`."""
    from capture_server import launch_capture_server

    server = launch_capture_server(tmp_path_factory.mktemp("vllm-capture"))
    try:
        yield server
    finally:
        server.stop()

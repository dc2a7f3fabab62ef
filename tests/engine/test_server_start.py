"""A vLLM that cannot start fails the tier with its own log, never a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from synthq.testing.vllm import VllmServer, VllmStartError

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600),
              # the modules on the session's plain server, on one worker (scripts/test.sh):
              # one start
              pytest.mark.xdist_group("engine")]


def test_a_server_that_does_not_come_up_raises_with_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = VllmServer.start(broken, "broken", log_path=tmp_path / "vllm.log")
    with pytest.raises(VllmStartError) as caught:
        server.wait_ready(timeout=500)
    message = str(caught.value)
    assert "exited with status" in message and str(tmp_path / "vllm.log") in message
    assert "no-such-architecture" in message  # vLLM's own words, from its log
    assert not server.alive()

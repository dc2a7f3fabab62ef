"""`synthq run` as a user runs it, against a hostile server in its own process (issue 24)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, Proc, child_env, free_port, wait_for

pytestmark = pytest.mark.e2e

#: Runs a command and prints the peak RSS of its process tree (KiB) as the last line.
_PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def test_run_against_a_3gb_error_body_stays_small_and_ends(tmp_path: Path) -> None:
    """A 500 with a 3 GB body took `synthq run` to 4.3 GB RSS. Now: peak RSS under
    300 MB, the sample fails as server_error after max_attempts calls, the run ends."""
    import httpx

    port = free_port()
    server = Proc([sys.executable, "-m", "synthq.testing.hostile", "--port", str(port),
                   "--error-status", "500", "--error-bytes", "3e9"],
                  child_env(), tmp_path / "hostile.log", name="hostile")
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 20, "the hostile server did not start")
        dataset = tmp_path / "p.jsonl"
        dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
        run = [sys.executable, "-m", "synthq.cli", "run", "-d", str(dataset),
               "-s", f"http://127.0.0.1:{port}/v1", "-m", "hostile", "--max-tokens", "16",
               "--max-attempts", "2", "--backoff-base", "0.1", "--backoff-cap", "0.2", "--json"]
        env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                        SYNTHQ_BROKER_URL="")
        done = subprocess.run([sys.executable, "-c", _PEAK, *run], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=180)
    finally:
        server.stop()
    lines = done.stdout.strip().splitlines()
    peak_mb = int(lines[-1]) / 1024
    summary = json.loads(lines[-2])
    assert done.returncode == 1, done.stderr  # every sample failed: said, exit 1
    assert "every sample failed" in done.stderr
    assert summary["counts"]["failed"] == 1 and summary["failures"] == {"server_error": 1}
    assert summary["calls"] == {"server_error": 2}, summary["calls"]
    assert peak_mb <= 300, peak_mb

"""`synthq run` as a user runs it, against a hostile server in its own process (issue 24)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import child_env

from synthq.testing.hostile import HostileProcess, run_measured

pytestmark = pytest.mark.e2e

def test_run_against_a_3gb_error_body_stays_small_and_ends(tmp_path: Path) -> None:
    """A 500 with a 3 GB body took `synthq run` to 4.3 GB RSS. Now: peak RSS under
    300 MB, the sample fails as server_error after max_attempts calls, the run ends
    (the same run as scripts/check_hostile.py's)."""
    server = HostileProcess(tmp_path / "hostile.log", child_env(), "--error-status", "500",
                            "--error-bytes", "3e9")
    try:
        dataset = tmp_path / "p.jsonl"
        dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
        run = [sys.executable, "-m", "synthq.cli", "run", "-d", str(dataset),
               "-s", server.url, "-m", "hostile", "--max-tokens", "16",
               "--max-attempts", "2", "--backoff-base", "0.1", "--backoff-cap", "0.2", "--json"]
        env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_DATABASE_URL="",
                        SYNTHQ_BROKER_URL="")
        done, peak_mb = run_measured(run, env, timeout=180)
    finally:
        server.stop()
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1, done.stderr  # every sample failed: said, exit 1
    assert "every sample failed" in done.stderr
    assert summary["counts"]["failed"] == 1 and summary["failures"] == {"server_error": 1}
    assert summary["calls"] == {"server_error": 2}, summary["calls"]
    assert peak_mb <= 300, peak_mb

"""The CLI, the beat tick and the models never import torch (only a training run does)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO, child_env


@pytest.mark.processes
def test_cli_worker_and_readiness_do_not_import_torch() -> None:
    code = ("import sys, synthq.cli, synthq.store.models, worker.tasks, synthq.training.readiness, "
            "synthq.training.runs, synthq.cli.train; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

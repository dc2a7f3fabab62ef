"""scripts/vllm-venv.sh and scripts/peer-readers.sh never delete a folder they did not
make (issue 41: ``SYNTHQ_VLLM_VENV=/some/existing/venv`` ran ``rm -rf`` on it).

Each script runs for real, with a ``python3`` on PATH that only records its call and
fails: nothing is installed, and a test sees whether an install was started.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support import REPO

pytestmark = pytest.mark.processes

#: script → the variable naming its folder.
SCRIPTS = {
    "vllm-venv.sh": "SYNTHQ_VLLM_VENV",
    "peer-readers.sh": "SYNTHQ_PEER_READERS",
}


def run(script: str, folder: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str],
                                                             list[str]]:
    """Run ``script`` with its folder at ``folder``; its result and the python3 calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "python3-calls"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "python3"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 1\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           SCRIPTS[script]: str(folder), "HOME": str(tmp_path / "home")}
    result = subprocess.run(["bash", str(REPO / "scripts" / script)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_folder_it_did_not_make_is_refused_and_kept(script: str, tmp_path: Path) -> None:
    folder = tmp_path / "users-venv"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    result, calls = run(script, folder, tmp_path)
    assert result.returncode == 1, result
    assert (folder / "notes.txt").read_text() == "mine"
    assert calls == [], "an install was started"
    assert result.stderr.count("\n") == 1 and str(folder) in result.stderr, result.stderr
    assert "will not replace it" in result.stderr


def test_a_working_vllm_venv_is_used_as_it_is(tmp_path: Path) -> None:
    venv = tmp_path / "users-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\n[ "$*" = "-c import vllm" ]\n')  # `import vllm` works
    python.chmod(0o755)
    (venv / "notes.txt").write_text("mine")
    result, calls = run("vllm-venv.sh", venv, tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[-1] == str(venv)
    assert (venv / ".ready").exists() and (venv / "notes.txt").read_text() == "mine"
    assert calls == []


def test_readers_already_there_are_used_as_they_are(tmp_path: Path) -> None:
    folder = tmp_path / "readers"
    for info in ("speculators-0.9.0", "hs_connectors-0.9.0", "specforge-0.2.0", "loguru-0.7.3"):
        (folder / f"{info}.dist-info").mkdir(parents=True)
    result, calls = run("peer-readers.sh", folder, tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[-1] == str(folder)
    assert (folder / ".ready").exists() and calls == []


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_its_own_install_cut_short_is_made_again(script: str, tmp_path: Path) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / ".installing").write_text("an earlier run of the script")
    (folder / "half-installed").write_text("x")
    result, calls = run(script, folder, tmp_path)
    assert result.returncode != 0  # the python3 stub fails the install
    assert not (folder / "half-installed").exists()
    assert (folder / ".installing").exists() and not (folder / ".ready").exists()
    assert calls and calls[0].startswith("-m venv" if "vllm" in script else "-m pip install")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_new_folder_is_marked_while_it_is_filled(script: str, tmp_path: Path) -> None:
    folder = tmp_path / "new" / "venv"
    result, calls = run(script, folder, tmp_path)
    assert result.returncode != 0 and len(calls) == 1
    assert (folder / ".installing").exists()

"""Helpers for tests: processes, polling, counts. Imported by conftest and tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Simulator:
    """A ``synthq simulate`` subprocess on a free port."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"sim-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "synthq.cli", "simulate", "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator died: {self.log_path.read_text()}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("simulator did not start")
            time.sleep(0.1)

    def stats(self) -> dict[str, Any]:
        return self.http.get("/sim/stats").json()

    def reset(self) -> None:
        self.http.post("/sim/reset")

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Proc:
    """A background process whose output goes to a log file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        """SIGKILL the process (and its group): no cleanup runs."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.kill9()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for synthq subprocesses: the test's settings plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def wait_for(predicate: Callable[[], Any], timeout: float, message: str = "",
             interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s: {message}")
        time.sleep(interval)


def counts(job_id: int) -> dict[str, int]:
    from synthq.db import session_scope
    from synthq.status import state_counts

    with session_scope() as s:
        return state_counts(s, job_id)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, indent=1)




def wait_worker_live(n: int = 1, timeout: float = 30) -> None:
    """Wait until ``n`` generation workers have registered (``workers`` rows)."""
    from sqlalchemy import func, select

    from synthq.db import session_scope
    from synthq.models import Worker

    def live() -> bool:
        with session_scope() as s:
            return (s.scalar(select(func.count()).select_from(Worker)) or 0) >= n

    wait_for(live, timeout, "no worker registered")

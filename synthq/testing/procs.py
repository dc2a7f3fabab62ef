"""Subprocesses for tests, benchmarks and chaos runs: free ports and killable process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["REPO", "free_port", "dies_with_parent", "Proc", "ApiServer"]

#: The repository root (the working directory of every process started here).
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range.

    A server the tests kill and start again on its port (vLLM, PostgreSQL, Redis, the
    simulator) needs that port to stay free while it is down. A port the kernel handed
    out for ``bind(0)`` is in its ephemeral range, which is also where every outgoing
    connection takes its own port: one taken meanwhile (even by a client retrying the
    dead server, which can connect to itself) makes the restart fail with "Address
    already in use" (a fresh-clone run, 2026-12-06). Below the range no connection takes
    it; two processes that draw the same port at once are told apart by the bind."""
    import random

    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free port below the ephemeral range on 127.0.0.1")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux SIGKILL the child when the process starting it
    dies, so a test session killed mid-run (kill -9, a CI job cut off) leaves no
    workers behind to take the next session's messages; None elsewhere.

    Linux sends the signal when the *thread* that started the child ends, so it is
    set only for children the main thread starts.
    """
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


class Proc:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, *,
                 name: str | None = None) -> None:
        self.name = name or log_path.stem
        self.cmd = cmd
        self.log_path = log_path
        self._asked = False
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=dies_with_parent())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} ({self.log_path})\n{self.log()[-chars:]}"

    def wait_healthy(self, url: str, timeout: float, what: str, *,
                     request_timeout: float = 2.0) -> None:
        """Return once ``url`` answers 200; raise (with the log's end) if the process
        exits first or ``timeout`` seconds pass."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited: {self.log()[-2000:]}")
            try:
                if httpx.get(url, timeout=request_timeout).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {self.log()[-2000:]}")
            time.sleep(0.1)

    def kill9(self) -> None:
        """SIGKILL the process group: no cleanup runs."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def ask_stop(self) -> None:
        """SIGTERM the process group and return at once: several processes asked first
        shut down side by side (a Celery worker's warm shutdown takes seconds)."""
        if self.proc.poll() is None and not self._asked:
            self._asked = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group (once: :meth:`ask_stop` may have), then SIGKILL
        whatever lingers."""
        if self.proc.poll() is None:
            self.ask_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # The leader may be gone while group members (children) linger.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if not self._log.closed:
            self._log.close()


class ApiServer(Proc):
    """``synthq api`` on a free port (``env`` holds its settings, ``SYNTHQ_API_TOKEN``
    among them); returns once ``/health`` answers."""

    def __init__(self, log_path: Path, env: dict[str, str], timeout: float = 30.0) -> None:

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "synthq.cli", "api", "--port", str(self.port)],
                         env, log_path, name="api")
        self.wait_healthy(f"{self.url}/health", timeout, "synthq api")

"""Helpers for tests: processes, polling, counts. Imported by conftest and tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from synthq.testing.procs import Proc, dies_with_parent, free_port  # noqa: F401 - Proc: re-exported for tests

REPO = Path(__file__).resolve().parents[1]

# The test services and settings (conftest.py uses them; a test module imports them
# from here: `conftest` is a different module under tests/api). What the tests touch
# is these and nothing else: databases named PG_PREFIX + ... + pid on the server of
# PG_ADMIN_URL, and keys in the one Redis database of REDIS_URL (used as given).
PG_ADMIN_URL = os.environ.get("SYNTHQ_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
PG_PREFIX = os.environ.get("SYNTHQ_TEST_PG_PREFIX", "synthq_test_")


def _redis_for_worker(url: str, worker: str | None) -> str:
    """The Redis database of one pytest-xdist worker: ``gw0`` uses the URL's database,
    ``gwN`` the one N below it (each worker runs its own Celery queues, so two must
    never share a database)."""
    if not worker or worker == "gw0":
        return url
    index = int(worker.removeprefix("gw"))
    match = re.fullmatch(r"(.*/)(\d+)", url.split("?")[0])
    base = int(match.group(2)) if match else 0
    if base - index < 0:
        shown = re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)
        raise pytest.UsageError(
            f"SYNTHQ_TEST_REDIS={shown}: test worker {worker} needs database {base} - "
            f"{index}; give a database number of at least the workers' count - 1")
    head = match.group(1) if match else url.split("?")[0].rstrip("/") + "/"
    query = url[len(url.split("?")[0]):]
    return f"{head}{base - index}{query}"


#: The tests' Redis database (a pytest-xdist worker's: see _redis_for_worker).
REDIS_URL = _redis_for_worker(os.environ.get("SYNTHQ_TEST_REDIS", "redis://127.0.0.1:6379/15"),
                              os.environ.get("PYTEST_XDIST_WORKER"))
#: Set (to 1) to run on a Redis database that holds keys already: those keys are left
#: alone, and the tests delete only the keys they made.
REDIS_SHARED = os.environ.get("SYNTHQ_TEST_REDIS_SHARED", "") not in ("", "0")

#: Keys synthq's own queues use (Celery's lists, kombu's bindings and unacked hash).
_QUEUE_KEYS = re.compile(r"^(generate|control|tokenize|train|unacked(_index|_mutex)?"
                         r"|_kombu\..*)$")


def pg_database(tag: str = "") -> str:
    """This process's test database name: ``PG_PREFIX + tag + pid``."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,39}", PG_PREFIX):
        raise pytest.UsageError(
            f"SYNTHQ_TEST_PG_PREFIX={PG_PREFIX!r}: use lower-case letters, digits and _ "
            "(at most 40, not starting with a digit); the tests create and drop databases "
            "named PREFIX<pid>")
    return f"{PG_PREFIX}{tag}{os.getpid()}"


#: The key a test session writes into the empty database it takes (see RedisForTests).
CLAIM = b"synthq-tests:claimed-by"


class RedisForTests:
    """The tests' Redis database: checked once, then cleared of the tests' keys only.

    The database must be empty when the session starts (a non-empty one may be
    someone's: its keys are not the tests' to delete), unless REDIS_SHARED says to
    share it; then the keys found at the start are never deleted, and the tests'
    own keys are. Nothing is flushed: no FLUSHDB, no FLUSHALL.

    A session that takes an empty database writes :data:`CLAIM` into it (its pid,
    host and start) and deletes it when it ends. A session killed before its end
    (Ctrl-C twice, kill -9, a CI job cut off) leaves the claim beside its keys; the
    next session finds the claim, and since that database was empty when it was
    claimed, its keys are the tests' own: they are deleted, with one line. A claim
    whose session still runs on this host is refused instead.
    """

    def __init__(self, url: str = REDIS_URL) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_connect_timeout=5)
        self.kept: frozenset[bytes] = frozenset()

    def check(self, shared: bool = REDIS_SHARED) -> None:
        """Raise :class:`pytest.UsageError` (one line) when the tests may not use it."""
        import redis

        shown = _mask_password(self.url)
        try:
            keys = frozenset(self.client.scan_iter(count=1000))
        except redis.RedisError as exc:
            raise pytest.UsageError(f"SYNTHQ_TEST_REDIS={shown}: cannot reach it "
                                    f"({type(exc).__name__}: {exc})") from None
        if CLAIM in keys and not shared:
            keys = self._take_over(keys)
        if keys and not shared:
            some = ", ".join(sorted(k.decode(errors="replace") for k in keys)[:3])
            more = ", ..." if len(keys) > 3 else ""
            raise pytest.UsageError(
                f"SYNTHQ_TEST_REDIS={shown} holds {len(keys)} key{'s' * (len(keys) != 1)} "
                f"({some}{more}) that the tests "
                "did not make: point it at an empty database (redis://HOST:PORT/N), or set "
                "SYNTHQ_TEST_REDIS_SHARED=1 to keep those keys and delete only the tests' own")
        queues = sorted(k.decode(errors="replace") for k in keys
                        if _QUEUE_KEYS.match(k.decode(errors="replace")))
        if queues:
            raise pytest.UsageError(
                f"SYNTHQ_TEST_REDIS={shown} holds synthq's queue keys ({', '.join(queues[:3])}): "
                "a synthq deployment uses it, and the tests would take its messages; point it "
                "at an empty database")
        self.kept = keys
        if not shared:
            self.client.set(CLAIM, f"pid {os.getpid()} on {socket.gethostname()} "
                                   f"since {time.strftime('%Y-%m-%dT%H:%M:%S')}")

    def _take_over(self, keys: frozenset[bytes]) -> frozenset[bytes]:
        """Delete what a test session that did not end left in its database; what is left."""
        claim = (self.client.get(CLAIM) or b"").decode(errors="replace")
        found = re.fullmatch(r"pid (\d+) on (\S+) since \S+", claim)
        if found and found[2] == socket.gethostname() and _alive(int(found[1])):
            raise pytest.UsageError(
                f"SYNTHQ_TEST_REDIS={_mask_password(self.url)} is in use by another test "
                f"session ({claim}): wait for it, or point this one at another database")
        left = list(keys)
        for i in range(0, len(left), 500):
            self.client.unlink(*left[i:i + 500])
        print(f"SYNTHQ_TEST_REDIS={_mask_password(self.url)}: deleted {len(left) - 1} keys "
              f"a test session that did not end left ({claim})", file=sys.stderr)
        return frozenset(self.client.scan_iter(count=1000))

    def clear(self) -> int:
        """Delete every key the tests made (all but those found at the start); the count."""
        mine = [k for k in self.client.scan_iter(count=1000)
                if k not in self.kept and k != CLAIM]
        for i in range(0, len(mine), 500):
            self.client.unlink(*mine[i:i + 500])
        return len(mine)

    def release(self) -> None:
        """The session's end: the tests' keys and the claim deleted, the client closed."""
        self.clear()
        self.client.delete(CLAIM)
        self.close()

    def close(self) -> None:
        self.client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


_redis: RedisForTests | None = None


def release_redis_for_tests() -> None:
    """At the session's end: the tests' keys and their claim deleted (when it was used)."""
    global _redis
    if _redis is not None:
        _redis.release()
        _redis = None


def redis_for_tests() -> RedisForTests:
    """The session's :class:`RedisForTests`, checked on first use."""
    global _redis
    if _redis is None:
        candidate = RedisForTests()
        candidate.check()
        _redis = candidate
    return _redis


def _mask_password(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)

#: Short clocks so lease expiry and queue deadlines happen within a test.
TEST_ENV = {
    "SYNTHQ_LEASE_MARGIN": "2",
    "SYNTHQ_QUEUED_TIMEOUT": "4",
    "SYNTHQ_DISPATCH_INTERVAL": "0.5",
    "SYNTHQ_HEARTBEAT_INTERVAL": "0.5",
    "SYNTHQ_WORKER_TIMEOUT": "3",
}


def _reset_process_state() -> None:
    from synthq.queue import broker, jobview
    from synthq.serving.executor import reset_default_executor
    from synthq.spec.config import get_settings
    from synthq.store.db import dispose_engines

    reset_default_executor()
    get_settings.cache_clear()
    broker._client.cache_clear()  # the broker URL may differ in the next test
    _rebind_celery_app(get_settings().broker_url)
    dispose_engines()
    jobview._jobs.clear()  # job ids restart at 1 in every test


def _rebind_celery_app(url: str | None) -> None:
    """Point an imported ``worker.app`` at this test's broker. Its broker URL is read
    once, when the module is first imported: in a random order a test that imported it
    without Redis left it on the default database (0), and a later test's
    ``publish_train`` or ``send_task`` sent there, not to the database its worker reads
    (CI: a tick never in its queue; a training worker that never got its run)."""
    module = sys.modules.get("worker.app")
    if module is None:
        return
    app = module.app
    want = url or "redis://127.0.0.1:6379/0"
    if app.conf.broker_url == want:
        return
    app.conf.broker_url = want
    # Pools made for the old URL are dropped, not closed: kombu's shared producer pools
    # may still hold them ("Acquire on closed pool").
    app._pool = None
    app.amqp._producer_pool = None


class Simulator:
    """A simulator subprocess on a free port: ``synthq simulate ARGS`` (the CLI), or
    ``serve(SimConfig(CONFIG))`` for settings the CLI does not expose."""

    def __init__(self, args: list[str] | None = None, log_dir: Path | None = None, *,
                 config: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base_url}/v1"
        # Closed in stop(); without log_dir, removed then.
        if log_dir is None:
            fd, name = tempfile.mkstemp(prefix=f"synthq-sim-{self.port}-", suffix=".log")
            os.close(fd)
        self._temporary = log_dir is None
        log_path = Path(name) if log_dir is None else log_dir / f"sim-{self.port}.log"
        self._log = open(log_path, "w+b")  # noqa: SIM115
        self.proc: Forked | subprocess.Popen[bytes] | subprocess.Popen[str]
        if config is not None:
            code = ("from synthq.testing.simulator import SimConfig, serve; "
                    f"serve(SimConfig({config}), port={self.port})")
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         preexec_fn=dies_with_parent())
        else:  # `synthq simulate`, forked by the CLI's zygote (a tenth of a start's CPU)
            self.proc = cli_host().start(["simulate", "--port", str(self.port), *(args or [])],
                                         child_env(), REPO, log=log_path)
        self.http = httpx.Client(base_url=self.base_url, timeout=10)
        self._client: Any = None
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator died: {self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulator did not start: {self.log()}")
            time.sleep(0.05)

    @property
    def client(self) -> Any:
        """A sync openai client for this simulator (no retries)."""
        if self._client is None:
            import openai

            self._client = openai.OpenAI(base_url=self.url, api_key="x", max_retries=0)
        return self._client

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stats(self) -> dict[str, Any]:
        return self.http.get("/sim/stats").json()

    def reset(self) -> None:
        self.http.post("/sim/reset").raise_for_status()

    def wait_idle(self, timeout: float = 3.0) -> dict[str, Any]:
        """Wait until no request is active (e.g. after client disconnects)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["active"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self._temporary:
            Path(self._log.name).unlink(missing_ok=True)

    close = stop


def peer_readers() -> Path:
    """The folder of the peers' own reader packages (scripts/peer-readers.sh: speculators,
    hs-connectors, SpecForge, pinned, without their dependencies), put on ``sys.path``."""
    done = subprocess.run(["bash", "scripts/peer-readers.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"scripts/peer-readers.sh failed: {done.stderr[-2000:]}"
    folder = Path(done.stdout.strip().splitlines()[-1])
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


def run_cli(*args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m synthq.cli ARGS`` with the test's settings (or ``env``, the whole
    environment) in ``cwd``; asserts exit 0 if ``check``. A process of its own, forked
    by :class:`CliHost` from one that imported synthq already."""
    result = cli_host().run(list(args), env if env is not None else child_env(), cwd,
                            timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


#: Variables read as a process starts (the interpreter's, the locale's) or as the zygote's
#: preloaded modules are imported (Typer's, psycopg's; torch's, OpenMP's and
#: transformers', Hugging Face's cache and offline switches, which follow HOME and
#: XDG_CACHE_HOME): a command whose values differ from the zygote's is not forked from
#: it. Others are read by the command itself, from its own environment: SYNTHQ_*,
#: VLLM_*, TOKENIZERS_PARALLELISM (read when a tokenizer runs), TORCHINDUCTOR_* (when
#: torch.compile is imported; a test process that imported it has set
#: TORCHINDUCTOR_CACHE_DIR in its environment, and a match on it sent its commands to
#: plain subprocesses).
_AT_START = re.compile(r"^(PYTHON|LANG$|LC_|_?TYPER_|TERMINAL_WIDTH$|FORCE_COLOR$|PY_COLORS$"
                       r"|GITHUB_ACTIONS$|PSYCOPG_|TORCH_|PYTORCH_|OMP_|MKL_|KMP_|GOMP_"
                       r"|CUDA_|NCCL_|HF_|HUGGINGFACE_|TRANSFORMERS_|USE_TORCH$|USE_TF$"
                       r"|HOME$|XDG_CACHE_HOME$)")


class Forked:
    """A command the zygote forked, with what ``subprocess.Popen`` offers a test: its
    pid, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` (a signal goes
    through the zygote, which sends it only while the child is its own) and the files
    its stdout and stderr went to."""

    def __init__(self, host: CliHost, args: list[str], pid: int, out: Path, err: Path) -> None:
        self.host, self.args, self.pid, self.out, self.err = host, args, pid, out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            while self.pid not in self.host._ended and self.host._answer(0) is not None:
                pass
            self.returncode = self.host._ended.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if self.host._answer(deadline) is None and self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.host._send({"signal": int(sig), "pid": self.pid})

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def result(self) -> subprocess.CompletedProcess[str]:
        """Its exit code, stdout and stderr (once it has ended); the files removed."""
        assert self.returncode is not None
        out = self.out.read_text(errors="replace")
        err = out if self.err == self.out else self.err.read_text(errors="replace")
        self.out.unlink(missing_ok=True)
        self.err.unlink(missing_ok=True)
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)


#: Called with each command a test starts through :class:`CliHost` (conftest's fast-tier
#: guard: a process forked there is a process all the same).
PROCESS_GUARDS: list[Callable[[list[str]], None]] = []


class CliHost:
    """``python -m synthq.cli ARGS`` in a process of its own for a fraction of its start:
    forked by ``tests/cli_zygote.py`` (one per test process, started on first use),
    which imported what every command imports, once. The child is the command as a
    shell runs it (its own environment, working directory, stdout, stderr and exit
    code); see the zygote's docstring for what differs (the start-up only).

    A command whose environment differs from the zygote's in a variable read when a
    process starts (``PYTHONPATH`` among them) runs as a plain subprocess instead."""

    def __init__(self) -> None:
        env = {k: v for k, v in child_env().items() if not k.startswith("SYNTHQ_")}
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_zygote.py")],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, preexec_fn=dies_with_parent())
        self.folder = Path(tempfile.mkdtemp(prefix="synthq-cli-"))
        self._read = b""
        self._count = 0
        self._ended: dict[int, int] = {}  # pid -> exit code, of children not waited for yet

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, args: list[str], env: dict[str, str], cwd: Path, *,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """The command run to its end, as ``subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)`` runs it."""
        started = self.start(args, env, cwd)
        if isinstance(started, subprocess.Popen):
            try:
                out, err = started.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                started.kill()
                started.communicate()
                raise
            return subprocess.CompletedProcess(started.args, started.returncode, out, err)
        return self.wait(started, timeout)

    def start(self, args: list[str], env: dict[str, str], cwd: Path, *,
              log: Path | None = None) -> Forked | subprocess.Popen[str]:
        """The command started (:meth:`wait` for its end), its stdout and stderr to files
        of its own (or both to ``log``); a plain ``Popen`` (text, stdout and stderr piped,
        or to ``log``) when the zygote cannot run it: an environment whose variables read
        at a start (``PYTHON*``, the locale's, Typer's) differ from its own."""
        command = [sys.executable, "-m", "synthq.cli", *args]
        for guard in PROCESS_GUARDS:
            guard(command)
        if any(env.get(k) != self.env.get(k) for k in {*env, *self.env} if _AT_START.match(k)):
            if log is not None:
                with log.open("wb") as fh:
                    return subprocess.Popen(command, env=env, cwd=cwd, stdout=fh,
                                            stderr=subprocess.STDOUT, text=True,
                                            preexec_fn=dies_with_parent())
            return subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        self._count += 1
        out = log or self.folder / f"{self._count}.out"
        err = log or self.folder / f"{self._count}.err"
        self._send({"id": self._count, "args": args, "env": env, "cwd": str(cwd),
                    "out": str(out), "err": str(err)})
        deadline = time.monotonic() + 60
        while True:
            answer = self._answer(deadline)
            if answer is None:
                raise RuntimeError(f"tests/cli_zygote.py started nothing ({self.proc.poll()})")
            if answer.get("id") == self._count:
                return Forked(self, command, answer["pid"], out, err)

    def wait(self, run: Forked, timeout: float) -> subprocess.CompletedProcess[str]:
        """``run``'s end (killed at ``timeout``, TimeoutExpired raised, as subprocess.run
        does)."""
        try:
            run.wait(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
            result = run.result()
            raise subprocess.TimeoutExpired(run.args, timeout, result.stdout,
                                            result.stderr) from None
        return run.result()

    def _send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def _answer(self, deadline: float) -> dict[str, int] | None:
        """The zygote's next line (an end is also kept in ``_ended``); None at the deadline
        (0: only what has come already)."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._read:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"tests/cli_zygote.py exited ({self.proc.wait()})")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        answer = dict(json.loads(line))
        if "rc" in answer:
            self._ended[answer["pid"]] = answer["rc"]
        return answer

    def close(self) -> None:
        import shutil

        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_cli_host: CliHost | None = None


def cli_host() -> CliHost:
    """This test process's :class:`CliHost` (started again if it died)."""
    global _cli_host
    if _cli_host is None or not _cli_host.alive():
        _cli_host = CliHost()
    return _cli_host


def close_cli_host() -> None:
    global _cli_host
    if _cli_host is not None:
        _cli_host.close()
        _cli_host = None


@contextmanager
def fresh_pg_database(name: str) -> Iterator[str]:
    """A new, empty PostgreSQL database ``name`` (dropped first if a killed run left it);
    yields its URL and drops it after."""
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        from synthq.store.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_default_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` in ``cwd`` as a user with the embedded defaults runs it: no
    ``SYNTHQ_`` variable at all (what the CLI's sqlite3 fast path needs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, text=True,
                          capture_output=True, env={**env, "PYTHONPATH": str(REPO)},
                          timeout=60)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for synthq subprocesses: the test's settings plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    # One OpenMP thread per child: the suite runs two processes on two cores, beside
    # vLLM's engine, whose OpenMP thread holds a core. Beside two busy torch processes (one
    # pinned to a core, as vLLM's is), the training-worker test took 46 s with two threads
    # and 25 s with one; in a CI run it missed its 120 s.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def wait_for(predicate: Callable[[], Any], timeout: float,
             message: str | Callable[[], str] = "", interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail the test.

    ``message`` may be a function, called at the failure: a log read when the call is
    made is the log before the wait (empty, for a process just started)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            pytest.fail(f"timed out after {timeout}s: {text}")
        time.sleep(interval)


def counts(job_id: int) -> dict[str, int]:
    from synthq.store.counts import state_counts
    from synthq.store.db import session_scope

    with session_scope() as s:
        return state_counts(s, job_id)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, indent=1)




def wait_worker_live(n: int = 1, timeout: float = 30) -> None:
    """Wait until ``n`` generation workers have registered (``workers`` rows)."""
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Worker

    def live() -> bool:
        with session_scope() as s:
            return (s.scalar(select(func.count()).select_from(Worker)) or 0) >= n

    wait_for(live, timeout, "no worker registered")


def sqlite_rows(db: Path, query: str) -> list[tuple[Any, ...]]:
    """Rows of ``query`` on an embedded run's SQLite file, read-only; [] before it exists."""
    import sqlite3

    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(query).fetchall()
    except sqlite3.OperationalError:  # tables not created yet
        return []
    finally:
        conn.close()


def capture_rows(job_id: int, server: str) -> None:
    """Real ``captures`` rows for the job through synthq.queue.capture_states: its first four
    samples tokenized (done, with input_ids), then one capture done (4,096 bytes, 8
    tokens), one failed as ``capture_mismatch``, one waiting to retry after a timeout,
    one pending; the other done samples have none yet."""
    from datetime import timedelta

    import numpy as np
    from sqlalchemy import select, update

    from synthq.queue import capture_states as capture_states
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample

    now = utcnow()
    with session_scope() as s:
        ids = list(s.scalars(select(Sample.id).where(Sample.job_id == job_id)
                             .order_by(Sample.id)))
        for sid in ids[:4]:
            tokens = np.arange(8, dtype="<i4") + sid
            s.execute(update(Sample).where(Sample.id == sid).values(
                state="done", input_ids=tokens.tobytes(), num_tokens=8, tokenize_version=1,
                finished_at=now))
        capture_states.add_missing(s, job_id, now=now)
        done, failed, retried = capture_states.claim(
            s, job_id, server=server, limit=8, most=3, worker="test", token="t" * 32,
            lease=60, now=now)
        assert capture_states.done(s, done, now=now, path="ab/ab.safetensors", sha256="ab" * 32,
                                   nbytes=4096, num_tokens=8, layer_ids=[2, 4, 5, 8],
                                   dtype="float32", engine="vllm test", engine_model="m")
        assert capture_states.fail(s, failed, now=now, error_class="capture_mismatch",
                                   error_message="the engine's token ids are not the sample's")
        assert capture_states.retry(s, retried, now=now, error_class="timeout",
                                    next_attempt_at=now + timedelta(hours=1),
                                    error_message="the capture request timed out")
        for sid in ids[4:6]:  # done after the stage last ran: no capture row yet
            s.execute(update(Sample).where(Sample.id == sid).values(
                state="done", input_ids=np.arange(4, dtype="<i4").tobytes(), num_tokens=4,
                tokenize_version=1, finished_at=now))


def built_once(name: str, inputs: list[Path | str], build: Callable[[Path], None]) -> Path:
    """A folder that ``build(folder)`` fills, made once per machine and reused while its
    ``inputs`` (files whose bytes, or strings such as versions) are unchanged.

    Kept under ``$XDG_CACHE_HOME/synthq/tests`` (a fresh clone on the same machine reuses
    it); built in a temporary folder and renamed into place, so two test processes that
    build it at once, or a run killed mid-build, never leave a half folder behind."""
    import hashlib
    import shutil

    digest = hashlib.sha256()
    for part in inputs:
        digest.update(part.read_bytes() if isinstance(part, Path) else part.encode())
        digest.update(b"\0")
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "synthq" / "tests"
    done = root / f"{name}-{digest.hexdigest()[:16]}"
    if (done / ".built").is_file():
        return done
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(work)
        (work / ".built").touch()
        try:
            work.rename(done)
        except OSError:  # another process renamed its copy first: use that one
            if not (done / ".built").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done

"""Shared setup for the benchmarks in ``bench/``: real PostgreSQL, Redis and processes.

Every benchmark runs inside :class:`Bench`, a context manager that

* creates a fresh PostgreSQL database (``synthq_bench_<name>``) and migrates it
  with :func:`synthq.store.migrate.upgrade`;
* uses its own Redis database number, flushed at start and at the end;
* points ``SYNTHQ_DATABASE_URL`` / ``SYNTHQ_BROKER_URL`` / ``SYNTHQ_DATA_DIR``
  at them, in this process and in every subprocess it starts;
* starts the simulator (``python -m synthq.cli simulate``), Celery workers and
  beat as subprocesses in their own process groups, and always kills those
  groups, drops the database and flushes Redis on the way out.

Nothing here asserts on speed: the scripts print figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/x.py` puts bench/ first, not the repo
    sys.path.insert(0, str(REPO))

from synthq.testing.procs import Proc, free_port  # noqa: E402 - after the path fix

PG_ADMIN_URL = os.environ.get("SYNTHQ_BENCH_PG",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("SYNTHQ_BENCH_REDIS", "redis://127.0.0.1:6379")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

#: Log lines worth showing after a run (they may point at bugs, not at the benchmark).
_ALARM = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception|too many clients", re.I)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1, procs: Sequence[Proc] = ()) -> Any:
    """Poll ``predicate`` until it is truthy; raise (with log tails) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) while waiting for "
                                   f"{what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(p.tail() for p in procs)
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(interval)


# --------------------------------------------------------------------------
# /proc readings
# --------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """``pid`` and all its descendants (by walking /proc/*/stat ppid fields)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_seconds(pid: int, *, tree: bool = True) -> float:
    """utime + stime of ``pid`` (and its live descendants), in seconds."""
    total = 0
    for p in descendants(pid) if tree else [pid]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLK_TCK


def rss_kb(pid: int, *, tree: bool = True) -> int:
    """VmRSS of ``pid`` (plus its descendants), in KiB."""
    total = 0
    for p in descendants(pid) if tree else [pid]:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def pids_named(name: str) -> list[int]:
    """Every process whose command name is ``name`` (e.g. all ``postgres`` backends)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        out.append(int(entry))
            except OSError:
                continue
    return out


def service_cpu_seconds(*names: str) -> float:
    """CPU seconds used so far by every process named one of ``names`` (PostgreSQL
    backends come and go; sample before and after and take the difference)."""
    return sum(cpu_seconds(p, tree=False) for n in names for p in pids_named(n))


def thread_count(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


class Simulator(Proc):
    """``python -m synthq.cli simulate`` on a free port."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        super().__init__([sys.executable, "-m", "synthq.cli", "simulate", "--port",
                          str(self.port), *args], env, log_dir / "simulator.log",
                         name="simulator")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

        def healthy() -> bool:
            try:
                return self.http.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 30, "the simulator's /health", procs=[self])

    def stats(self) -> dict[str, Any]:
        return self.http.get("/sim/stats").json()

    def stop(self, timeout: float = 10.0) -> None:
        self.http.close()
        super().stop(timeout)


# --------------------------------------------------------------------------
# The bench context
# --------------------------------------------------------------------------


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Bench:
    """Fresh database + Redis db + process bookkeeping for one benchmark run.

    ``env`` entries are exported (``SYNTHQ_*`` settings) to this process and to
    the subprocesses. ``keep_logs`` keeps the temp dir with the process logs.
    """

    def __init__(self, name: str, *, redis_db: int, env: dict[str, str] | None = None,
                 keep_logs: bool = False) -> None:
        self.name = name
        self.db_name = f"synthq_bench_{name}_{os.getpid()}"  # two runs side by side
        self.redis_url = f"{REDIS_BASE}/{redis_db}"
        self.extra_env = dict(env or {})
        self.keep_logs = keep_logs
        self.tmp = Path(tempfile.mkdtemp(prefix=f"synthq-bench-{name}-"))
        self.procs: list[Proc] = []
        self.db_url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{self.db_name}"
        self._saved_env: dict[str, str | None] = {}

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> Bench:
        # `timeout`, `kill` and a closed terminal send SIGTERM/SIGHUP, whose default
        # action skips `finally`: turn them into SystemExit so the cleanup runs.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_exit)
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._teardown()

    def _admin(self):  # type: ignore[no-untyped-def]
        from sqlalchemy import create_engine

        return create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")

    def _setup(self) -> None:
        import redis
        from sqlalchemy import text

        from synthq.store.migrate import upgrade

        admin = self._admin()
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
                conn.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        finally:
            admin.dispose()
        upgrade(self.db_url)
        client = redis.Redis.from_url(self.redis_url)
        client.flushdb()
        client.close()
        env = {"SYNTHQ_DATABASE_URL": self.db_url, "SYNTHQ_BROKER_URL": self.redis_url,
               "SYNTHQ_DATA_DIR": str(self.tmp / "data"), **self.extra_env}
        for key, value in env.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        self._reset_process_state()

    def _teardown(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        self._reset_process_state()
        with contextlib.suppress(Exception):
            from sqlalchemy import text

            admin = self._admin()
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            admin.dispose()
        with contextlib.suppress(Exception):
            import redis

            client = redis.Redis.from_url(self.redis_url)
            client.flushdb()
            client.close()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.keep_logs:
            print(f"[bench] logs kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @staticmethod
    def _reset_process_state() -> None:
        from synthq.serving.executor import reset_default_executor
        from synthq.spec.config import get_settings
        from synthq.store.db import dispose_engines

        reset_default_executor()
        get_settings.cache_clear()
        dispose_engines()

    # -- processes ---------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def simulator(self, *args: str) -> Simulator:
        sim = Simulator(list(args), self.child_env(), self.tmp)
        self.procs.append(sim)
        return sim

    def worker(self, concurrency: int, name: str | None = None,
               extra: Sequence[str] = ()) -> Proc:
        """A real generation worker: celery, threads pool, generate + control queues."""
        name = name or f"w{sum(p.name.startswith('w') for p in self.procs)}"
        cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "worker",
               "-Q", "generate,control,tokenize", "-P", "threads", "-c", str(concurrency),
               "-n", f"{name}@%h", "--without-mingle", "--without-gossip", "-l", "INFO",
               *extra]
        proc = Proc(cmd, self.child_env(), self.tmp / f"{name}.log", name=name)
        self.procs.append(proc)
        return proc

    def beat(self) -> Proc:
        cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
               "--schedule", str(self.tmp / "beat-schedule")]
        proc = Proc(cmd, self.child_env(), self.tmp / "beat.log", name="beat")
        self.procs.append(proc)
        return proc

    def wait_ready(self, workers: Iterable[Proc], timeout: float = 60) -> None:
        """Wait for each worker's ``ready.`` log line (Celery logs it at INFO)."""
        def ready(w: Proc) -> Callable[[], bool]:
            return lambda: " ready." in w.log()

        for w in workers:
            wait_until(ready(w), timeout, f"{w.name} ready", procs=[w])

    def alarms(self, limit: int = 40) -> list[str]:
        """Suspicious lines (tracebacks, ERROR) from all process logs so far."""
        out: list[str] = []
        for p in self.procs:
            for line in p.log().splitlines():
                if _ALARM.search(line):
                    out.append(f"{p.name}: {line.strip()[:300]}")
        return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])

    def report_alarms(self) -> list[str]:
        found = self.alarms()
        if found:
            print(f"[bench] {len(found)} suspicious log line(s) (see the logs; "
                  "--keep-logs keeps them):", file=sys.stderr)
            for line in found:
                print("   " + line, file=sys.stderr)
        return found


# --------------------------------------------------------------------------
# Jobs and counts
# --------------------------------------------------------------------------


def create_job(spec: Any, prompts: Sequence[str]) -> Any:
    """Create ``spec``'s job and insert one user-message sample per prompt (the real path:
    :func:`synthq.jobs.enqueue.get_or_create_job` +
    :func:`synthq.jobs.samplecopy.insert_rows`), then
    ask for a tick now as `synthq enqueue` and the API do (:func:`synthq.app.service.start_now`)."""
    from synthq.app.service import start_now
    from synthq.data.dataset import Row
    from synthq.jobs.enqueue import EnqueueReport, get_or_create_job
    from synthq.jobs.samplecopy import insert_rows
    from synthq.store.db import session_scope

    with session_scope() as s:
        job, created, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    report = EnqueueReport(job_id=job_id, job_name=spec.name, created=created)
    rows = [Row(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
    insert_rows(job_id, settings, rows, report)
    start_now()
    return report


def prompts(n: int, tag: str = "bench") -> list[str]:
    return [f"{tag} question {i}: explain something briefly" for i in range(n)]


def counts(job_id: int) -> dict[str, int]:
    from synthq.store.counts import state_counts
    from synthq.store.db import session_scope

    with session_scope() as s:
        return state_counts(s, job_id)


def set_job_state(job_id: int, state: str) -> None:
    from sqlalchemy import update

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job

    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(state=state, updated_at=utcnow()))


def done_times(job_id: int) -> list[float]:
    """``finished_at`` (epoch seconds, sorted) of the job's done samples."""
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Sample

    with session_scope() as s:
        rows = s.scalars(select(Sample.finished_at).where(
            Sample.job_id == job_id, Sample.state == "done").order_by(Sample.finished_at))
        return [t.timestamp() for t in rows if t is not None]


def window_rate(times: Sequence[float], lo: float = 0.1, hi: float = 0.9) -> tuple[float, float]:
    """Completions per second between the ``lo`` and ``hi`` quantiles of ``times``.

    Returns ``(rate, window_seconds)``; skips the ramp-up and the tail.
    """
    if len(times) < 2:
        return 0.0, 0.0
    i, j = int(lo * (len(times) - 1)), int(hi * (len(times) - 1))
    span = times[j] - times[i]
    return ((j - i) / span if span > 0 else 0.0), span


def wait_done(job_id: int, total: int, timeout: float, procs: Sequence[Proc] = (),
              interval: float = 0.25, progress_every: float = 5.0,
              stall_after: float = 60.0, bench: Bench | None = None) -> dict[str, int]:
    """Poll SQL counts until ``total`` samples are in a final state; print progress.

    Raises if nothing finishes for ``stall_after`` seconds (a stuck run, e.g.
    samples left ``running`` by a task that raised), showing ``bench``'s log alarms.
    """
    last_print = time.monotonic()
    start = time.monotonic()
    last_finished, last_change = -1, time.monotonic()

    def finished() -> dict[str, int] | None:
        nonlocal last_print, last_finished, last_change
        c = counts(job_id)
        n_final = c["done"] + c["failed"] + c["skipped"]
        if n_final != last_finished:
            last_finished, last_change = n_final, time.monotonic()
        elif time.monotonic() - last_change > stall_after:
            alarms = "\n".join(bench.alarms(20)) if bench else ""
            raise RuntimeError(f"no sample finished for {stall_after:.0f}s: {c}\n{alarms}")
        if time.monotonic() - last_print >= progress_every:
            last_print = time.monotonic()
            print(f"[bench] t={time.monotonic() - start:5.1f}s  " +
                  " ".join(f"{k}={v}" for k, v in c.items() if v), file=sys.stderr)
        return c if n_final >= total else None

    return wait_until(finished, timeout, f"{total} samples finished", interval=interval,
                      procs=procs)


def summary(name: str, figures: dict[str, Any]) -> None:
    """The final one-line JSON summary every benchmark prints.

    ``cpus`` and ``loadavg_1m`` (at the end of the run) say how busy the machine
    was: on a small shared machine other processes move these figures.
    """
    print(json.dumps({"bench": name, **figures, "cpus": os.cpu_count(),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}, default=str))

"""Chaos scenarios: real PostgreSQL, Redis, Celery workers and beat, killed and restarted.

Each scenario runs on a :class:`Cluster` of its own: a private PostgreSQL
cluster (``initdb`` in a temporary directory, a free port; stopped and started
by the scenario), a private ``redis-server`` (no persistence: a restart comes
back empty), the simulator, and real ``celery worker`` / ``celery beat``
subprocesses pointed at them. A scenario returns a :class:`Result` with its
recovery time and its counts of lost and doubled samples; the chaos tests
(``tests/chaos``) assert on it and ``bench/chaos.py`` prints it.

* ``lost``: samples of the job not ``done`` at the end.
* ``doubled``: samples with more than one ``ok`` attempt (an answer paid for
  twice and stored once).
* ``extra_requests``: server requests beyond one per sample. A killed call is
  paid for again by design (``kill -9``, a cut call); a database outage or a
  broker wipe must cost none.

Needs PostgreSQL's server binaries (``initdb``, ``pg_ctl``; run as the
``postgres`` user when this process is root) and ``redis-server``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from synthq.testing.procs import REPO, Proc, dies_with_parent, free_port

if TYPE_CHECKING:
    from synthq.testing.halfopen import StrandingProxy

__all__ = ["PrivatePostgres", "PrivateRedis", "Cluster", "Result", "unavailable", "SCENARIOS",
           "database_outage", "dead_worker", "warm_shutdown", "hanging_server",
           "broker_wipe", "payloads", "overload", "broker_refuses_writes", "disk_full",
           "silent_worker", "postgres_half_open", "clock_skew", "faked", "LIBFAKETIME",
           "has_libfaketime", "PG_HALF_OPEN_LIMITS", "stranded_heartbeat",
           "STRANDED_HEARTBEAT_LIMITS", "can_mount_tmpfs", "REQUIRES"]



def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1, logs: Callable[[], str] | None = None) -> Any:
    """Poll ``predicate`` until truthy; raise TimeoutError (with log tails) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                               + (logs() if logs else ""))
        time.sleep(interval)


def _pg_bindir() -> Path | None:
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        for version in sorted(os.listdir(root), key=lambda v: int(v) if v.isdigit() else 0,
                              reverse=True):
            if (root / version / "bin" / "initdb").exists():
                return root / version / "bin"
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def unavailable() -> str | None:
    """Why the chaos scenarios cannot run here, or None."""
    if _pg_bindir() is None:
        return "PostgreSQL's initdb/pg_ctl are not installed"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user to run initdb as"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    return None


# -- services --------------------------------------------------------------------------


#: A stopped cluster with a migrated ``synthq`` database, made once per process and
#: copied for each :class:`PrivatePostgres` (a copy takes a tenth of initdb's seconds).
_template: Path | None = None


def _data_root() -> str | None:
    """Where the clusters' data folders go: ``/dev/shm`` (memory) when it has a GiB free,
    else the temporary directory (None). A copy of the template is 1,300 files: 0.2 s
    in memory, 1.5-3 s on the shared 2-core machine's disk, for every chaos test."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1 << 30:
            return str(shm)
    except OSError:
        pass
    return None


def _template_cluster(bindir: Path, as_root: bool) -> Path:
    global _template
    if _template is None:
        pg = PrivatePostgres(bindir=bindir, template=False)
        try:
            from synthq.store.migrate import upgrade

            upgrade(pg.url)
            pg.stop()
        except BaseException:
            pg.close()
            raise
        _template = pg.data
        atexit.register(shutil.rmtree, pg.data, True)
    return _template


class PrivatePostgres:
    """A PostgreSQL cluster of its own (temporary directory, free port), stoppable, its
    ``synthq`` database migrated to the head (copied from the process's template)."""

    def __init__(self, *, bindir: Path | None = None, template: bool = True) -> None:
        bindir = bindir or _pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL's initdb is not installed")
        self.bindir = bindir
        self._as_root = os.geteuid() == 0
        self.port = free_port()
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/synthq"
        if template:
            source = _template_cluster(bindir, self._as_root)
            self.data = Path(tempfile.mkdtemp(prefix="synthq-pg-", dir=_data_root()))
            # cp -a keeps the owner (postgres) and the data folder's 0700.
            subprocess.run(["cp", "-a", f"{source}/.", str(self.data)], check=True,
                           capture_output=True, timeout=120)
            if self._as_root:
                shutil.chown(self.data, "postgres", "postgres")
            self.start()
            return
        self.data = Path(tempfile.mkdtemp(prefix="synthq-pg-", dir=_data_root()))
        if self._as_root:
            shutil.chown(self.data, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-N")
        self.start()
        from sqlalchemy import create_engine, text

        admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text("CREATE DATABASE synthq"))
        finally:
            admin.dispose()

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        cmd = [str(self.bindir / tool), *args]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=check, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.data / "log"),
                  "-o", f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 "
                  "-c fsync=off -c max_connections=200", "start")

    def stop(self) -> None:
        """A fast shutdown: connections are cut, the port closes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.data, ignore_errors=True)


class PrivateRedis:
    """``redis-server`` on a free port without persistence: :meth:`kill` then
    :meth:`start` gives an empty broker on the same URL."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=dies_with_parent())

        def up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_until(up, 20, "redis-server to answer PING")

    def kill(self) -> None:
        """SIGKILL: every message is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)

    def refuse_writes(self, refuse: bool = True) -> None:
        """``maxmemory`` reached under ``noeviction``: every write that may grow the data
        (and every command inside MULTI) answers OOM; reads, pops and deletes work."""
        client = self.client()
        try:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", "1" if refuse else "0")
        finally:
            client.close()

    close = kill


class Simulator(Proc):
    def __init__(self, args: Sequence[str], env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        super().__init__([sys.executable, "-m", "synthq.cli", "simulate", "--port", str(self.port),
                          *args], env, log_dir / f"sim-{self.port}.log")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited: {self.log()}")
            try:
                return self.http.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 30, "the simulator's /health")

    def stats(self) -> dict[str, Any]:
        return dict(self.http.get("/sim/stats").json())

    def stop(self, timeout: float = 10.0) -> None:
        self.http.close()
        super().stop(timeout)


#: Quick clocks for everything a scenario does not measure (each overrides what it does).
QUICK_ENV = {
    "SYNTHQ_DISPATCH_INTERVAL": "0.5",
    "SYNTHQ_HEARTBEAT_INTERVAL": "0.5",
}


class Cluster:
    """PostgreSQL, Redis and processes of one scenario; this process's settings point at
    them until :meth:`close` (they are restored then)."""

    def __init__(self, env: dict[str, str] | None = None, *, tmp: Path | None = None) -> None:
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="synthq-chaos-"))
        self._own_tmp = tmp is None
        self.procs: list[Proc] = []
        #: Proxies the processes connect through: closed after the processes stopped.
        self.proxies: list[StrandingProxy] = []
        self._saved: dict[str, str | None] = {}
        self.pg: PrivatePostgres | None = None
        self.redis: PrivateRedis | None = None
        try:
            self.pg = PrivatePostgres()
            from synthq.store.migrate import upgrade

            upgrade(self.pg.url)
            self.redis = PrivateRedis(self.tmp)
            self.setenv(SYNTHQ_DATABASE_URL=self.pg.url, SYNTHQ_BROKER_URL=self.redis.url,
                        SYNTHQ_DATA_DIR=str(self.tmp / "data"), **QUICK_ENV, **(env or {}))
        except BaseException:
            self.close()
            raise

    # -- settings -------------------------------------------------------------------

    def setenv(self, **values: str) -> None:
        """Export settings to this process and the processes started from now on."""
        for key, value in values.items():
            self._saved.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        reset_process_state()

    # -- processes ------------------------------------------------------------------

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra)
        return env

    def simulator(self, *args: str) -> Simulator:
        sim = Simulator(args, self.child_env(), self.tmp)
        self.procs.append(sim)
        return sim

    def worker(self, concurrency: int, name: str | None = None, extra: Sequence[str] = (),
               **env: str) -> Proc:
        name = name or f"w{sum(p.name.startswith('w') for p in self.procs)}"
        cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "worker",
               "-Q", "generate,control,tokenize", "-P", "threads", "-c", str(concurrency),
               "-n", f"{name}@%h", "--without-mingle", "--without-gossip", "-l", "INFO",
               *extra]
        proc = Proc(cmd, self.child_env(**env), self.tmp / f"{name}.log", name=name)
        self.procs.append(proc)
        return proc

    def beat(self, **env: str) -> Proc:
        cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
               "--schedule", str(self.tmp / "beat-schedule")]
        proc = Proc(cmd, self.child_env(**env), self.tmp / "beat.log", name="beat")
        self.procs.append(proc)
        return proc

    def logs(self, chars: int = 3000) -> str:
        return "\n".join([holders(), *(f"--- {p.name}\n{p.log()[-chars:]}"
                                        for p in self.procs)])

    def wait_workers(self, n: int = 1, timeout: float = 60) -> None:
        """Wait until ``n`` generation workers have a ``workers`` row."""
        from sqlalchemy import func, select

        from synthq.store.db import session_scope
        from synthq.store.models import Worker

        def live() -> bool:
            with session_scope() as s:
                return (s.scalar(select(func.count()).select_from(Worker)) or 0) >= n

        wait_until(live, timeout, f"{n} worker(s) registered", interval=0.2, logs=self.logs)

    def stranding_proxy(self, port: int) -> StrandingProxy:
        """A :class:`~synthq.testing.halfopen.StrandingProxy` to ``127.0.0.1:port`` that
        stays open until :meth:`close` has stopped the processes that connect through it
        (a proxy closed first refused a worker's last writes, and it retried them until
        its stop timeout, 10 s)."""
        from synthq.testing.halfopen import StrandingProxy

        proxy = StrandingProxy("127.0.0.1", port)
        self.proxies.append(proxy)
        return proxy

    def stop_processes(self) -> None:
        """SIGKILL every process group at once: the cluster is thrown away after them
        (PostgreSQL stopped ``immediate``, Redis killed), so a warm shutdown buys nothing
        and cost 2-3 s a test under load (a worker's drain, beat's). A scenario that tests
        a graceful stop sends its own SIGTERM (:func:`warm_shutdown`)."""
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.kill9()
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()  # reaps the group and closes the log
            # libfaketime's shared memory and semaphore of a faked process (clock_skew's),
            # which its exit would have removed.
            for name in (f"faketime_shm_{p.pid}", f"sem.faketime_sem_{p.pid}"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")
        self.procs.clear()

    def close(self) -> None:
        self.stop_processes()
        for proxy in reversed(self.proxies):
            with contextlib.suppress(Exception):
                proxy.close()
        self.proxies.clear()
        reset_process_state()
        if self.redis is not None:
            self.redis.close()
        if self.pg is not None:
            self.pg.close()
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()
        reset_process_state()
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def reset_process_state() -> None:
    from synthq.queue import jobview
    from synthq.serving.executor import reset_default_executor
    from synthq.spec.config import get_settings
    from synthq.store.db import dispose_engines

    reset_default_executor()
    get_settings.cache_clear()
    dispose_engines()
    jobview._jobs.clear()


# -- jobs and figures --------------------------------------------------------------------


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} question number {i}: explain something" for i in range(n)]


def create_job(prompt_texts: Sequence[str], servers: Sequence[str], **fields: Any) -> int:
    """A job with one user-message sample per prompt; returns its id."""
    from synthq.data.dataset import Row
    from synthq.jobs.enqueue import EnqueueReport, JobSpec, get_or_create_job
    from synthq.jobs.samplecopy import insert_rows
    from synthq.store.db import session_scope

    fields.setdefault("name", "chaos")
    fields.setdefault("model", "sim-model")
    fields.setdefault("max_tokens", 64)
    fields.setdefault("backoff_base", 0.1)
    fields.setdefault("backoff_cap", 0.5)
    spec = JobSpec(servers=list(servers), **fields)
    with session_scope() as s:
        job, created, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    rows = [Row(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompt_texts)]
    insert_rows(job_id, settings, rows, EnqueueReport(job_id=job_id, job_name=spec.name,
                                                      created=created))
    return int(job_id)


def counts(job_id: int) -> dict[str, int]:
    from synthq.store.counts import state_counts
    from synthq.store.db import session_scope

    with session_scope() as s:
        return dict(state_counts(s, job_id))


def holders() -> str:
    """Who holds the samples in flight, and the workers' rows: what a stuck run's
    timeout shows beside the logs (a test's failure names the culprit)."""
    from sqlalchemy import func, select

    from synthq.queue.dispatch import server_is_down
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample, Worker

    try:
        with session_scope() as s:
            now = utcnow()
            held = s.execute(
                select(Sample.state, Sample.worker, func.count(),
                       func.min(Sample.expires_at), func.min(Sample.updated_at))
                .where(Sample.state.in_(("queued", "running")))
                .group_by(Sample.state, Sample.worker)).all()
            rows = s.execute(select(Worker.name, Worker.capacity, Worker.inflight,
                                    Worker.heartbeat_at)).all()
            states = dict(s.execute(select(Sample.state, func.count())
                                    .group_by(Sample.state)).all())
            servers = {url for (url,) in s.execute(select(Sample.server).distinct())
                       if url}
            down = sorted(url for url in servers if server_is_down(s, url))
    except Exception as exc:  # noqa: BLE001 - a diagnostic never hides the failure
        return f"--- holders: unreadable ({exc})"
    lines = [f"--- now: samples per state {states}; servers judged down {down}",
             "--- holders (state, worker, samples, first lease end, oldest update)"]
    lines += [f"{st} {w} {n} lease {lease} updated {(now - up).total_seconds():.1f} s ago"
              for st, w, n, lease, up in held]
    lines += [f"worker {n}: capacity {c}, inflight {i}, heartbeat "
              f"{(now - hb).total_seconds():.1f} s ago" for n, c, i, hb in rows]
    return "\n".join(lines)


def ok_calls_per_sample(job_id: int) -> dict[int, int]:
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    with session_scope() as s:
        return {int(i): int(n) for i, n in s.execute(
            select(Attempt.sample_id, func.count()).join(Sample, Sample.id == Attempt.sample_id)
            .where(Sample.job_id == job_id, Attempt.outcome == "ok")
            .group_by(Attempt.sample_id))}


def oldest_queued(job_id: int, since: Any = None) -> float:
    """Seconds the longest-queued sample has waited (counted from ``since`` if later)."""
    from sqlalchemy import func, select

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample

    with session_scope() as s:
        first = s.scalar(select(func.min(Sample.queued_at)).where(
            Sample.job_id == job_id, Sample.state == "queued"))
    if first is None:
        return 0.0
    if since is not None:
        first = max(first, since)
    return float((utcnow() - first).total_seconds())


@dataclass
class Result:
    """One scenario's figures."""

    scenario: str
    #: The scenario's recovery time, in seconds (what it measures: ``recovery``).
    recovery_s: float
    recovery: str
    samples: int
    lost: int
    doubled: int
    extra_requests: int
    took_s: float
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        extra = "  ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        return (f"{self.scenario}: recovery {self.recovery_s:.1f} s ({self.recovery}); "
                f"samples {self.samples}, lost {self.lost}, doubled {self.doubled}, "
                f"extra requests {self.extra_requests}; took {self.took_s:.1f} s  {extra}")


def _fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _result(scenario: str, job_id: int, n: int, requests: int, started: float,
            recovery_s: float, recovery: str, **figures: Any) -> Result:
    c = counts(job_id)
    return Result(scenario=scenario, recovery_s=recovery_s, recovery=recovery, samples=n,
                  lost=n - c["done"],
                  doubled=sum(1 for v in ok_calls_per_sample(job_id).values() if v > 1),
                  extra_requests=requests - n, took_s=time.monotonic() - started,
                  figures=figures)


def _poll_done(cluster: Cluster, job_id: int, n: int, timeout: float,
               every: Callable[[], None] | None = None) -> None:
    def done() -> bool:
        if every is not None:
            every()
        return counts(job_id)["done"] >= n

    wait_until(done, timeout, f"{n} samples done ({counts(job_id)})", interval=0.25,
               logs=cluster.logs)


# -- the scenarios -------------------------------------------------------------------------


def database_outage(cluster: Cluster, *, outage: float = 30.0, n: int = 100,
                    limit: int = 16) -> Result:
    """Target 1: PostgreSQL stopped for ``outage`` seconds mid-run (1 s calls, limit 16).

    Recovery: from PostgreSQL's return until work resumed, i.e. more samples
    done than the answers the worker held in memory through the outage.
    """
    from synthq.store.db import dispose_engines

    assert cluster.pg is not None
    started = time.monotonic()
    worker = cluster.worker(concurrency=limit)
    cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "1.0", "--capacity", "64")
    job_id = create_job(prompts(n, "outage"), [sim.url], inflight_limit=limit)
    wait_until(lambda: counts(job_id)["done"] >= 20, 90, "20 samples done", logs=cluster.logs)
    dispose_engines()
    cluster.pg.stop()
    time.sleep(outage)
    cluster.pg.start()
    back = time.monotonic()
    before = counts(job_id)["done"]
    first = wait_until(lambda: counts(job_id)["done"] > before and time.monotonic(), 60,
                       "a commit after the outage", interval=0.1, logs=cluster.logs)
    wait_until(lambda: counts(job_id)["done"] > before + limit, 60, "work to resume",
               interval=0.1, logs=cluster.logs)
    resumed = time.monotonic() - back
    _poll_done(cluster, job_id, n, 120)
    return _result("database_outage", job_id, n, sim.stats()["requests"], started, resumed,
                   "database back -> done beyond the answers held in memory", outage_s=outage,
                   done_at_outage=before, first_commit_s=first - back,
                   writer_retried="retrying" in worker.log())


def dead_worker(cluster: Cluster, *, n: int = 96, limit: int = 64, batch: int = 8) -> Result:
    """Target 2: ``kill -9`` of the only worker with 32 samples streaming and 32 queued in
    messages it had taken; a new worker starts at once.

    The stall timeout is 300 s (leases of 330 s), so only the missing heartbeat
    (``SYNTHQ_WORKER_TIMEOUT``) and the queued deadline (``SYNTHQ_QUEUED_TIMEOUT``)
    can bring them back within 30 s. The victim takes 8 messages of 8 samples
    (``--prefetch-multiplier 2`` on 4 threads): 4 run, 4 wait in it.
    Recovery: from the kill until none of its samples is running or queued.
    """
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    started = time.monotonic()
    # The victim's free slots (64 against the 32 its threads run) would otherwise claim
    # its own prefetched samples from SQL after a few idle seconds (the half-open broker
    # path), leaving none queued at the kill on a loaded machine.
    cluster.setenv(SYNTHQ_BATCH_SIZE=str(batch), SYNTHQ_WORKER_CAPACITY=str(limit),
                   SYNTHQ_ADOPT_AFTER="600")
    victim = cluster.worker(concurrency=4, name="victim", extra=["--prefetch-multiplier", "2"])
    cluster.beat()  # it starts meanwhile; the job comes once the victim is live
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0", "--tokens-per-second", "5",
                            "--response-tokens", "20", "--capacity", "128")
    cluster.wait_workers(1)
    job_id = create_job(prompts(n, "dead"), [sim.url], inflight_limit=limit,
                        stall_timeout=300.0)

    def loaded() -> bool:
        c = counts(job_id)
        return c["running"] == limit // 2 and c["queued"] == limit // 2

    wait_until(loaded, 60, "32 running and 32 queued on the victim", logs=cluster.logs)
    wait_until(lambda: sim.stats()["active"] == limit // 2, 20, "32 streams", logs=cluster.logs)
    time.sleep(1.0)
    with session_scope() as s:
        # What the victim holds: each sample's state and claim token at the kill.
        held = {int(i): (st, tok) for i, st, tok in s.execute(
            select(Sample.id, Sample.state, Sample.claim).where(
                Sample.job_id == job_id, Sample.state.in_(("queued", "running"))))}
    victim.kill9()
    killed = time.monotonic()
    cluster.worker(concurrency=8, name="rescuer")
    back: dict[str, float] = {}

    def reclaimed() -> bool:
        with session_scope() as s:
            now = {int(i): (st, tok) for i, st, tok in s.execute(
                select(Sample.id, Sample.state, Sample.claim).where(
                    Sample.id.in_(list(held))))}
        for kind in ("running", "queued"):
            left = [i for i, (st, tok) in held.items() if st == kind and now[i] == (st, tok)]
            if not left and kind not in back:
                back[kind] = time.monotonic() - killed
        return len(back) == 2

    wait_until(reclaimed, 90, "the dead worker's samples back to pending", interval=0.2,
               logs=cluster.logs)
    _poll_done(cluster, job_id, n, 120)
    with session_scope() as s:
        lost_calls = len(s.scalars(select(Attempt.id).where(Attempt.outcome == "lost")).all())
    stats = sim.stats()
    return _result("dead_worker", job_id, n, stats["requests"], started, max(back.values()),
                   "kill -9 -> its running and queued samples back to pending",
                   running_back_s=back["running"], queued_back_s=back["queued"],
                   running_at_kill=sum(1 for st, _ in held.values() if st == "running"),
                   queued_at_kill=sum(1 for st, _ in held.values() if st == "queued"),
                   lost_attempts=lost_calls, max_requests_per_prompt=max(
                       stats["prompts"].values()))


def warm_shutdown(cluster: Cluster, *, grace: float = 3.0, n: int = 120, limit: int = 32,
                  hanging: int = 15) -> Result:
    """Target 3: SIGTERM to one of two workers while every slot is busy and ``hanging``
    of its calls hang (their first request only).

    The SIGTERM goes when worker ``a`` has just claimed a hanging call (its first
    request, no attempt row yet): a call older than the stall timeout minus the grace
    would end ``stalled`` before the grace did, and a worker whose hanging calls all went
    elsewhere would have nothing to cut (a CI run sent it too late, after a fixed count
    of done samples: ``interrupted_calls=0``). The hanging prompts are spread over the
    whole job and over odd and even batches, so ``a`` claims one whatever the order.

    The queued deadline is 300 s here, so a sample left queued without a message
    would show (it is not the thing rescuing it). Recovery: SIGTERM until the
    worker exited (target: the grace period, ``SYNTHQ_SHUTDOWN_GRACE``).
    """
    started = time.monotonic()
    cluster.setenv(SYNTHQ_SHUTDOWN_GRACE=str(grace), SYNTHQ_QUEUED_TIMEOUT="300",
                   SYNTHQ_BATCH_SIZE="4")
    texts = prompts(n, "term")
    spots = [i * 8 + 4 * (i % 2) for i in range(hanging)]  # batches 0, 3, 4, 7, 8, ...
    assert spots[-1] < n, (hanging, n)
    for i, spot in enumerate(spots):
        texts[spot] += f" [[sim:hang*1]] {i}"
    a = cluster.worker(concurrency=16, name="a")
    cluster.worker(concurrency=16, name="b")
    cluster.beat()  # it starts meanwhile; the job comes once both workers are live
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "1.0", "--capacity", "128")
    cluster.wait_workers(2)
    job_id = create_job(texts, [sim.url], inflight_limit=limit, stall_timeout=8.0)
    wait_until(lambda: counts(job_id)["done"] >= 8
               and _claims_a_first_hang(job_id, a.proc.pid, spots),
               90, "worker a holding a hanging call under way", interval=0.05,
               logs=cluster.logs)
    term = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    a.proc.wait(grace + 60)
    exit_s = time.monotonic() - term
    oldest = 0.0

    def watch() -> None:
        nonlocal oldest
        oldest = max(oldest, oldest_queued(job_id))

    _poll_done(cluster, job_id, n, 120, every=watch)
    done_s = time.monotonic() - term
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt

    with session_scope() as s:
        interrupted = s.scalar(select(func.count()).select_from(Attempt)
                               .where(Attempt.outcome == "interrupted")) or 0
    return _result("warm_shutdown", job_id, n, sim.stats()["requests"], started, exit_s,
                   "SIGTERM -> worker exited", grace_s=grace, exit_code=a.proc.returncode,
                   interrupted_calls=interrupted, oldest_queued_s=oldest,
                   job_done_after_term_s=done_s)


def _claims_a_first_hang(job_id: int, pid: int, spots: Sequence[int]) -> bool:
    """Whether the worker of process ``pid`` holds one of the hanging samples on its first
    request (running, no attempt row yet)."""
    from sqlalchemy import exists, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    with session_scope() as s:
        return s.scalar(select(exists().where(
            Sample.job_id == job_id, Sample.state == "running",
            Sample.dataset_index.in_(list(spots)), Sample.worker.like(f"%:{pid}:%"),
            ~exists().where(Attempt.sample_id == Sample.id)))) or False


def hanging_server(cluster: Cluster, *, n: int = 60, limit: int = 8) -> Result:
    """Target 4: a server whose ``/health`` answers but whose calls all hang, beside a good
    one (stall timeout 1 s). Recovery: the job's duration (the issue saw 618 s)."""
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt

    started = time.monotonic()
    cluster.worker(concurrency=32)
    cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    good = cluster.simulator("--latency", "0.05", "--capacity", "64")
    bad = cluster.simulator("--hang-rate", "1.0", "--capacity", "64")
    job_id = create_job(prompts(n, "hang"), [good.url, bad.url], inflight_limit=limit,
                        stall_timeout=1.0, total_timeout=5.0, max_attempts=10)
    cluster.wait_workers(1)
    t0 = time.monotonic()
    _poll_done(cluster, job_id, n, 120)
    took = time.monotonic() - t0
    with session_scope() as s:
        by_server = dict(s.execute(select(Attempt.server, func.count())
                                   .group_by(Attempt.server)).all())
        rows = s.execute(select(Attempt.sample_id, Attempt.server).order_by(Attempt.id)).all()
    seq: dict[int, list[str]] = {}
    for sample_id, server in rows:
        seq.setdefault(sample_id, []).append(server)
    retried = [v for v in seq.values() if len(v) > 1 and v[0] == bad.url]
    again = sum(1 for v in retried if v[1] == bad.url)
    return _result("hanging_server", job_id, n, good.stats()["requests"], started, took,
                   "job duration with one hanging server of two",
                   calls_to_hanging=by_server.get(bad.url, 0),
                   calls_to_good=by_server.get(good.url, 0),
                   retried_from_hanging=len(retried), retried_on_hanging_again=again)


def broker_wipe(cluster: Cluster, *, n: int = 300, limit: int = 32, down: float = 3.0) -> Result:
    """The broker wipe: Redis killed (SIGKILL) mid-run and restarted empty after ``down``
    seconds, with the product's 30 s queued deadline.

    Recovery: from the restart until no sample queued before it is still queued
    (every stranded sample moving again); the oldest queued age after the
    restart is the target's figure (< 60 s).
    """
    from sqlalchemy import select

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample

    assert cluster.redis is not None
    started = time.monotonic()
    cluster.setenv(SYNTHQ_QUEUED_TIMEOUT="30")
    worker = cluster.worker(concurrency=limit)
    beat = cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0.5", "--capacity", "64")
    job_id = create_job(prompts(n, "wipe"), [sim.url], inflight_limit=limit)
    wait_until(lambda: counts(job_id)["done"] >= 30, 90, "30 samples done", logs=cluster.logs)
    cluster.redis.kill()
    time.sleep(down)
    cluster.redis.start()
    restarted, restarted_at = time.monotonic(), utcnow()
    with session_scope() as s:
        stranded = set(s.scalars(select(Sample.id).where(
            Sample.job_id == job_id, Sample.state == "queued",
            Sample.queued_at < restarted_at)))
    before = counts(job_id)["done"]
    marks: dict[str, float] = {}
    oldest = 0.0

    def watch() -> None:
        nonlocal oldest
        oldest = max(oldest, oldest_queued(job_id, since=restarted_at))
        if "moving" not in marks:
            with session_scope() as s:
                left = s.scalar(select(Sample.id).where(
                    Sample.job_id == job_id, Sample.state == "queued",
                    Sample.queued_at < restarted_at).limit(1))
            if left is None:
                marks["moving"] = time.monotonic() - restarted
        if "first_done" not in marks and counts(job_id)["done"] > before:
            marks["first_done"] = time.monotonic() - restarted

    _poll_done(cluster, job_id, n, 180, every=watch)
    watch()
    return _result("broker_wipe", job_id, n, sim.stats()["requests"], started,
                   marks.get("moving", 0.0),
                   "Redis back empty -> every sample queued before it moving again",
                   stranded_queued=len(stranded), first_done_s=marks.get("first_done", 0.0),
                   oldest_queued_after_restart_s=oldest,
                   finished_after_restart_s=time.monotonic() - restarted,
                   worker_alive=worker.proc.poll() is None, beat_alive=beat.proc.poll() is None)


def payloads(cluster: Cluster, *, n_plain: int = 20) -> Result:
    """Target 5 through a worker: NUL, a lone surrogate and invalid UTF-8 are stored (U+FFFD)
    and counted on the sample; an HTML body and a stream without ``[DONE]`` (twice each,
    then a good answer) are retried as ``server_error``, and the server is never down;
    an answer over ``max_response_bytes`` fails as ``response_too_large``.

    Recovery: the job's duration."""
    from sqlalchemy import select

    from synthq.queue.dispatch import server_is_down
    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    started = time.monotonic()
    cluster.worker(concurrency=8)
    cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0", "--capacity", "64")
    faults = {"nul": 2, "surrogate": 2, "badutf8": 2}
    retried = {"html": 3, "nodone": 3}
    texts = prompts(n_plain, "plain")
    texts += [f"bad {f} {i} [[sim:{f}]]" for f, k in faults.items() for i in range(k)]
    texts += [f"junk {f} {i} [[sim:{f}*2]]" for f, k in retried.items() for i in range(k)]
    job_id = create_job(texts, [sim.url], inflight_limit=8, max_attempts=4)
    big_id = create_job(["a long answer please"], [sim.url], name="big", inflight_limit=8,
                        max_response_bytes=1000)
    down_seen = 0

    def watch() -> None:
        nonlocal down_seen
        with session_scope() as s:
            down_seen += bool(server_is_down(s, sim.url))

    t0 = time.monotonic()
    _poll_done(cluster, job_id, len(texts), 90, every=watch)
    wait_until(lambda: counts(big_id)["failed"] == 1, 30, "the big answer failed",
               logs=cluster.logs)
    took = time.monotonic() - t0
    with session_scope() as s:
        samples = {smp.id: smp for smp in s.scalars(select(Sample))}
        attempts = s.execute(select(Attempt.sample_id, Attempt.outcome)
                             .order_by(Attempt.id)).all()
        for smp in samples.values():
            s.expunge(smp)
    by_sample: dict[int, list[str]] = {}
    for sample_id, outcome in attempts:
        by_sample.setdefault(sample_id, []).append(str(outcome))
    kinds = {"nul": "nul", "surrogate": "surrogate", "badutf8": "invalid_utf8"}
    def last_user(smp: Sample) -> str:
        return str((smp.prompt or [{}])[-1].get("content", ""))

    repaired = {f: sum(1 for smp in samples.values()
                       if f"[[sim:{f}]]" in last_user(smp) and smp.state == "done"
                       and int((smp.repairs or {}).get(kinds[f], 0)) >= 1
                       and "\ufffd" in (smp.response_content or "")) for f in faults}
    retry_paths = {f: sorted({",".join(by_sample.get(smp.id, [])) for smp in samples.values()
                              if f"[[sim:{f}*2]]" in last_user(smp)})
                   for f in retried}
    big = next(smp for smp in samples.values() if smp.job_id == big_id)
    big_calls = len(by_sample.get(big.id, []))
    return _result("payloads", job_id, len(texts), sim.stats()["requests"] - big_calls,
                   started, took, "job duration", repaired=repaired, retry_paths=retry_paths,
                   server_down_seen=down_seen,
                   connection_outcomes=sum(1 for _, o in attempts if o == "connection"),
                   too_large=(str(big.state), big.error_class, big_calls))


def overload(cluster: Cluster, *, seconds: float = 30.0, retry_after: float = 5.0,
             n: int = 100, backoff_base: float = 2.0) -> Result:
    """Issue 18 A: the server answers every chat call 503 + ``Retry-After`` for
    ``seconds`` while ``/health`` says 200 (a vLLM with a bounded queue, a gateway),
    with the product's default job settings (5 attempts, backoff from ``backoff_base``
    = 2 s, limit 64). The default 30 s is the 4 backoffs' ceilings, 2 + 4 + 8 + 16 s:
    as long as 5 attempts lasted when an overload answer spent one.

    Recovery: from the end of the overload until every sample is done. Before the
    fix, 5xx ignored Retry-After and the whole job failed within the overload.
    """
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Sample

    started = time.monotonic()
    cluster.worker(concurrency=64)
    cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0.2", "--capacity", "64")
    cluster.wait_workers(1)
    # The overload starts once the worker is up: it meets all of it, however long its
    # (or beat's) start took.
    sim.http.post("/sim/overload", json={"seconds": seconds, "status": 503,
                                         "retry_after": retry_after}).raise_for_status()
    overload_ends = time.monotonic() + seconds
    job_id = create_job(prompts(n, "overload"), [sim.url], backoff_base=backoff_base,
                        backoff_cap=300.0, max_attempts=5, inflight_limit=64)

    def settled() -> bool:
        c = counts(job_id)
        return c["done"] + c["failed"] >= n

    wait_until(settled, seconds + 120, "every sample settled", interval=0.25, logs=cluster.logs)
    recovered = max(0.0, time.monotonic() - overload_ends)
    stats = sim.stats()
    with session_scope() as s:
        charged = s.scalar(select(func.max(Sample.attempts)).where(Sample.job_id == job_id))
    c = counts(job_id)
    return _result("overload", job_id, n, stats["requests"], started, recovered,
                   "overload over -> every sample done", overload_s=seconds,
                   retry_after_s=retry_after, backoff_base_s=backoff_base, failed=c["failed"],
                   overload_answers=stats["faults"].get("overload", 0),
                   max_attempts_charged=charged or 0)


def broker_refuses_writes(cluster: Cluster, *, refuse: float | None = 20.0, n: int = 300,
                          limit: int = 32) -> Result:
    """Issue 18 B: Redis reaches ``maxmemory`` under ``noeviction`` for ``refuse`` seconds
    mid-run: acknowledgements (ZREM/HDEL in MULTI), publishes and the unacked index all
    answer OOM. Before the fix Celery logged "Unrecoverable error" and the worker exited.

    ``refuse=None``: Redis refuses writes until the worker and beat have each met a
    refused write (Redis' OOM answer in their logs) and the worker has finished more
    samples than its slots since the refusal began, i.e. it worked through the refusal;
    or until the worker exited (before the fix: at once).

    Recovery: from Redis accepting writes again until every sample is done; the
    worker must be the same process throughout.
    """
    assert cluster.redis is not None
    started = time.monotonic()
    worker = cluster.worker(concurrency=limit)
    beat = cluster.beat()
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "1.0", "--capacity", "64")
    job_id = create_job(prompts(n, "oom"), [sim.url], inflight_limit=limit)
    wait_until(lambda: counts(job_id)["done"] >= 30, 90, "30 samples done", logs=cluster.logs)
    pid = worker.proc.pid
    cluster.redis.refuse_writes(True)
    refused_at = time.monotonic()
    at_refusal = counts(job_id)["done"]
    if refuse is None:
        oom = "used memory > 'maxmemory'"  # Redis' answer, as each process logs it

        def met() -> bool:
            return worker.proc.poll() is not None or (
                oom in worker.log() and oom in beat.log()
                and counts(job_id)["done"] > at_refusal + limit)

        wait_until(met, 90, "the worker and beat to meet the refusal and work through it",
                   interval=0.2, logs=cluster.logs)
    else:
        time.sleep(refuse)
    alive_through = worker.proc.poll() is None
    cluster.redis.refuse_writes(False)
    back = time.monotonic()
    done_during = counts(job_id)["done"] - at_refusal
    _poll_done(cluster, job_id, n, 120)
    return _result("broker_refuses_writes", job_id, n, sim.stats()["requests"], started,
                   time.monotonic() - back, "Redis accepts writes again -> every sample done",
                   refused_s=back - refused_at, done_while_refused=done_during,
                   worker_alive=alive_through and worker.proc.poll() is None
                   and worker.proc.pid == pid,
                   beat_alive=beat.proc.poll() is None,
                   unrecoverable="Unrecoverable error" in worker.log())


def silent_worker(cluster: Cluster, *, n: int = 16, stopped: float = 8.0) -> Result:
    """Issue 18 E: a worker is SIGSTOPped with its calls hanging, past its
    ``SYNTHQ_WORKER_TIMEOUT`` (3 s here), then SIGCONTed; a second worker (started
    beside it, 2 slots) runs the sweep, which reclaims the stopped worker's samples and
    logs each cut call ``lost``. The woken worker's calls then stall (5 s, passed while
    it was stopped) and their results find the lease gone: before the fix each was
    logged ``lost`` again (2 rows per call).

    Recovery: from SIGCONT until every sample is done.
    """
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample, Worker

    started = time.monotonic()
    # One sample a message: the other worker's 2 threads take a few, the victim the rest.
    cluster.setenv(SYNTHQ_WORKER_TIMEOUT="3", SYNTHQ_BATCH_SIZE="1")
    cluster.worker(concurrency=2, name="other")
    victim = cluster.worker(concurrency=n, name="victim")
    cluster.beat()  # it starts meanwhile; the job comes once both workers are live
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0", "--capacity", "64")
    cluster.wait_workers(2)
    with session_scope() as s:
        name = s.scalar(select(Worker.name).order_by(Worker.capacity.desc()).limit(1))
    # Each prompt's first call hangs (until the caller gives up); the next one answers.
    job_id = create_job([f"{p} [[sim:hang*1]]" for p in prompts(n, "silent")], [sim.url],
                        inflight_limit=n, stall_timeout=5.0)

    def on_victim() -> set[int]:
        with session_scope() as s:
            return set(s.scalars(select(Sample.id).where(
                Sample.job_id == job_id, Sample.state == "running", Sample.worker == name)))

    wait_until(lambda: len(on_victim()) >= n - 4 and sim.stats()["active"] >= n - 4, 60,
               "the calls hanging on the victim", interval=0.05, logs=cluster.logs)
    victim.proc.send_signal(signal.SIGSTOP)
    running = on_victim()
    time.sleep(stopped)
    victim.proc.send_signal(signal.SIGCONT)
    woke = time.monotonic()
    _poll_done(cluster, job_id, n, 90)
    recovered = time.monotonic() - woke
    # The woken worker's calls stall at once (their 5 s passed); each result is then lost.
    wait_until(lambda: sim.stats()["active"] == 0, 30, "the woken worker's calls ended",
               logs=cluster.logs)
    time.sleep(1.5)
    with session_scope() as s:
        lost_rows = s.scalar(select(func.count()).select_from(Attempt).where(
            Attempt.sample_id.in_(running), Attempt.outcome == "lost")) or 0
    return _result("silent_worker", job_id, n, sim.stats()["requests"], started, recovered,
                   "SIGCONT -> every sample done", stopped_s=stopped,
                   cut_calls=len(running), lost_rows=lost_rows,
                   worker_alive=victim.proc.poll() is None)


# -- issue 24: half-open PostgreSQL, a skewed clock -----------------------------------------

#: Small database limits for :func:`postgres_half_open`: a stranded answer is given up
#: after 3 + 2 s, a stranded transaction is ended by the server after 3 s.
PG_HALF_OPEN_LIMITS = {"SYNTHQ_DB_STATEMENT_TIMEOUT": "3", "SYNTHQ_DB_ANSWER_MARGIN": "2",
                       "SYNTHQ_DB_LOCK_TIMEOUT": "2",
                       "SYNTHQ_DB_IDLE_IN_TRANSACTION_TIMEOUT": "3"}


def _hold_dispatch_lock(url: str) -> Any:
    """A session like a worker's (the service limits) that takes the dispatch lock and
    stays in its transaction: once stranded it is a dead session holding the lock."""
    import psycopg

    from synthq.queue.dispatch import _LOCK_KEY
    from synthq.store.db import pg_connect_args

    conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"),
                           **pg_connect_args(service=True))  # type: ignore[arg-type]
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
    return conn


def postgres_half_open(cluster: Cluster, *, n: int = 80, limit: int = 8) -> Result:
    """Issue 24 item 12: every connection of the worker and beat to PostgreSQL stranded
    mid-run by a TCP proxy (:mod:`synthq.testing.halfopen`: no byte forwarded, nothing
    closed, new connections pass), one of them holding the dispatch lock in an open
    transaction. Before the fix the job froze for good.

    Recovery: from the strand until more samples were done than the calls in flight
    (target < 60 s). ``requests - n`` and ``doubled`` may reach the calls in flight.
    """

    assert cluster.pg is not None
    started = time.monotonic()
    cluster.setenv(**PG_HALF_OPEN_LIMITS)
    proxy = cluster.stranding_proxy(cluster.pg.port)
    via = {"SYNTHQ_DATABASE_URL": proxy.url_for(cluster.pg.url)}
    cluster.worker(concurrency=limit, **via)
    cluster.beat(**via)
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0.3", "--capacity", "64")
    job_id = create_job(prompts(n, "halfopen"), [sim.url], inflight_limit=limit)
    wait_until(lambda: counts(job_id)["done"] >= 15, 90, "15 samples done",
               logs=cluster.logs)
    holder = _hold_dispatch_lock(via["SYNTHQ_DATABASE_URL"])
    stranded = proxy.strand()
    at = time.monotonic()
    before = counts(job_id)["done"]
    moved = wait_until(lambda: counts(job_id)["done"] > before + limit and time.monotonic(),
                       60, "the job to move again after the strand", interval=0.2,
                       logs=cluster.logs)
    wait_until(lambda: counts(job_id)["done"] >= n, 120, "every sample done",
               interval=0.25, logs=cluster.logs)
    requests = sim.stats()["requests"]
    del holder  # its socket is stranded; the proxy's close ends it
    return _result("postgres_half_open", job_id, n, requests, started, moved - at,
                   "strand -> more done than the calls in flight", stranded=stranded,
                   limit=limit)


#: A stranded connection's answer is given up after 3 + 2 s, longer than the workers'
#: timeout (3 s): the proportions of the defaults (20 + 5 s against 15 s), quicker.
STRANDED_HEARTBEAT_LIMITS = {**PG_HALF_OPEN_LIMITS, "SYNTHQ_WORKER_TIMEOUT": "3"}


def _heartbeat_ports() -> set[int]:
    """The client ports of the workers' heartbeat sessions (``application_name``
    ``synthq-heartbeat``, synthq.queue.heartbeat), as PostgreSQL sees them."""
    from sqlalchemy import text

    from synthq.store.db import session_scope

    with session_scope() as s:
        return {int(p) for (p,) in s.execute(text(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = "
            "'synthq-heartbeat' AND client_port IS NOT NULL"))}


def stranded_heartbeat(cluster: Cluster, *, n: int = 300, limit: int = 16, workers: int = 2,
                       heartbeat_only: bool = False,
                       env: dict[str, str] | None = None) -> Result:
    """Issue 30 item 5: ``workers`` workers and beat, ``--inflight limit``, ``n`` samples;
    a TCP proxy strands every PostgreSQL connection open at one moment (with
    ``heartbeat_only``, only the workers' heartbeat sessions); new connections pass.
    Before the fix a worker's heartbeat waited behind its stranded writer for the whole
    answer deadline, longer than the workers' timeout: the sweep gave away the samples of
    a worker that kept working, and 160 of 300 answers were paid twice.

    ``env``: the database limits (default :data:`STRANDED_HEARTBEAT_LIMITS`). Figures:
    ``doubled`` (samples with two answered calls; goal <= ``limit``, 0 with
    ``heartbeat_only``), ``swept`` (calls the sweep logged lost), ``stranded``."""
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Attempt, Sample

    assert cluster.pg is not None
    started = time.monotonic()
    cluster.setenv(**(STRANDED_HEARTBEAT_LIMITS if env is None else env))
    proxy = cluster.stranding_proxy(cluster.pg.port)
    via = {"SYNTHQ_DATABASE_URL": proxy.url_for(cluster.pg.url)}
    for _ in range(workers):
        cluster.worker(concurrency=limit, **via)
    cluster.beat(**via)  # it starts meanwhile; the job comes once the workers are live
    # The simulator starts while the Celery processes import (their start is the longer).
    sim = cluster.simulator("--latency", "0.3", "--capacity", "64")
    cluster.wait_workers(workers)
    job_id = create_job(prompts(n, "stranded"), [sim.url], inflight_limit=limit)
    wait_until(lambda: counts(job_id)["done"] >= n // 5, 90, f"{n // 5} samples done",
               logs=cluster.logs)
    ports = _heartbeat_ports() if heartbeat_only else None
    stranded = proxy.strand(ports)
    at = time.monotonic()
    before = counts(job_id)["done"]
    moved = wait_until(lambda: counts(job_id)["done"] > before + limit and time.monotonic(),
                       60, "the job to move again after the strand", interval=0.2,
                       logs=cluster.logs)
    wait_until(lambda: counts(job_id)["done"] >= n, 180, "every sample done",
               interval=0.25, logs=cluster.logs)
    requests = sim.stats()["requests"]
    with session_scope() as s:
        swept = s.scalar(select(func.count()).select_from(Attempt)
                         .join(Sample, Sample.id == Attempt.sample_id)
                         .where(Sample.job_id == job_id, Attempt.outcome == "lost",
                                Attempt.error_message.like("the worker stopped reporting%"))) or 0
    return _result("stranded_heartbeat" + ("_only" if heartbeat_only else ""), job_id, n,
                   requests, started, moved - at,
                   "strand -> more done than the calls in flight", stranded=stranded,
                   limit=limit, swept=int(swept))


#: libfaketime's multi-threaded library (Debian's ``faketime`` package), or None.
LIBFAKETIME = next((p for p in (Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                Path("/usr/lib/faketime/libfaketimeMT.so.1")) if p.exists()),
                   None)


def faked(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock moved by ``offset``
    (``-120s``; monotonic time stays true: durations are measured right)."""
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1"}


def has_libfaketime() -> str | None:
    """Why the skewed-clock scenario cannot run here, or None."""
    return None if LIBFAKETIME else "libfaketime is not installed (apt-get install faketime)"


def clock_skew(cluster: Cluster, *, offset: str = "-120s", n: int = 96,
               limit: int = 16) -> Result:
    """Issue 24 item 14: a real worker whose wall clock is ``offset`` off (libfaketime)
    beside a worker and beat on the true time; every 4th prompt fails its first call, so
    retries are due too. Before the fix its heartbeats looked dead at once and its leases
    expired as it took them: 57 answers paid twice, 22 in flight against a limit of 16.

    Figures: ``skew_s`` (what a faked process reads, minus the true time),
    ``planned_errors``, ``max_active`` (the server's peak in flight; must be <= ``limit``),
    ``prompt_max_calls``, and what ``synthq status --json`` says of the workers
    (``status_skews``, ``status_warnings``). Recovery: the job's duration.
    """
    started = time.monotonic()
    cluster.worker(concurrency=limit // 2, name="skewed", **faked(offset))
    cluster.worker(concurrency=limit // 2, name="true")
    cluster.beat()  # it starts meanwhile; the job comes once both workers are live
    # The clock check and the simulator run while the Celery processes import.
    check = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                           env=cluster.child_env(**faked(offset)), capture_output=True,
                           text=True, check=True)
    skew = float(check.stdout) - time.time()
    sim = cluster.simulator("--latency", "0.4", "--capacity", "64")
    texts = [p + (" [[sim:error*1]]" if i % 4 == 0 else "")
             for i, p in enumerate(prompts(n, "skew"))]
    cluster.wait_workers(2)
    job_id = create_job(texts, [sim.url], inflight_limit=limit)
    _poll_done(cluster, job_id, n, 120)
    took = time.monotonic() - started
    stats = sim.stats()
    status = subprocess.run([sys.executable, "-m", "synthq.cli", "status", str(job_id),
                             "--json"], env=cluster.child_env(), capture_output=True,
                            text=True, timeout=60)
    try:
        data = json.loads(status.stdout)
    except ValueError:
        data = {"workers": [], "warnings": [f"status failed: {status.stderr[-300:]}"]}
    planned = sum(stats["faults"].values())
    # The planned errors are paid calls by design: only the rest counts as extra.
    result = _result("clock_skew", job_id, n, stats["requests"] - planned, started, took,
                     "the job's duration", offset=offset, skew_s=round(skew, 1),
                     planned_errors=planned, max_active=stats["max_active"], limit=limit,
                     prompt_max_calls=max(stats["prompts"].values()))
    result.figures["status_skews"] = {w["name"]: w.get("clock_skew_s")
                                      for w in data.get("workers", [])}
    result.figures["status_warnings"] = list(data.get("warnings", []))
    return result


def can_mount_tmpfs() -> str | None:
    """Why a size-limited tmpfs cannot be mounted here (the disk-full scenario), or None."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a size-limited tmpfs needs root"
    probe = Path(tempfile.mkdtemp(prefix="synthq-mount-"))
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                              capture_output=True, timeout=20)
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.decode(errors='replace').strip()}"
        subprocess.run(["umount", str(probe)], capture_output=True, timeout=20)
        return None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def disk_full(cluster: Cluster, *, n: int = 600, size_mb: int = 12, limit: int = 16) -> Result:
    """Issue 18 C: ``synthq run`` (embedded SQLite) on a volume that fills mid-run.

    A size-limited tmpfs holds the data directory; once 50 samples are done a
    filler file takes every free byte. ``synthq run`` must stop within 60 s with
    one line naming the volume ("disk full at PATH: ...") and no traceback; after
    the filler is removed the same command must finish every sample, the server
    asked at most once per sample plus the calls that were in flight.
    Recovery: from the volume filling until the run exited. Needs root (mount).
    """
    import sqlite3

    started = time.monotonic()
    vol = cluster.tmp / "vol"
    vol.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(vol)],
                   check=True, capture_output=True, timeout=20)
    try:
        sim = cluster.simulator("--latency", "0.2", "--response-tokens", "300",
                                "--capacity", "64")
        dataset = cluster.tmp / "prompts.jsonl"
        import json

        dataset.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                                   for i, text in enumerate(prompts(n, "full"))))
        env = cluster.child_env(SYNTHQ_DATA_DIR=str(vol / "data"), SYNTHQ_DATABASE_URL="",
                                SYNTHQ_BROKER_URL="")
        cmd = [sys.executable, "-m", "synthq.cli", "run", "-d", str(dataset), "-s", sim.url,
               "-m", "sim-model", "--max-tokens", "400", "--inflight", str(limit), "--json"]
        db = vol / "data" / "synthq.db"

        def done() -> int:
            try:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                try:
                    return int(conn.execute(
                        "SELECT count(*) FROM samples WHERE state = 'done'").fetchone()[0])
                finally:
                    conn.close()
            except sqlite3.Error:
                return 0

        first = Proc(cmd, env, cluster.tmp / "run1.log", name="run1")
        cluster.procs.append(first)
        wait_until(lambda: done() >= 50 or first.proc.poll() is not None, 120,
                   "50 samples done", logs=cluster.logs)
        filler = vol / "filler"
        # The run's own writes may have filled the volume already (a WAL that grew
        # under load): then even creating the filler fails, and the volume is full.
        with contextlib.suppress(OSError), open(filler, "wb") as fh:
            block = b"\0" * (64 << 10)
            while True:
                fh.write(block)
                fh.flush()
        filled = time.monotonic()
        code = first.proc.wait(120)
        stopped_s = time.monotonic() - filled
        out1 = first.log()
        at_stop = done()
        filler.unlink(missing_ok=True)
        requests_before = sim.stats()["requests"]
        second = Proc(cmd, env, cluster.tmp / "run2.log", name="run2")
        cluster.procs.append(second)
        code2 = second.proc.wait(180)
        out2 = second.log()
        final = done()
        requests = sim.stats()["requests"]
        last_line = out1.strip().splitlines()[-1] if out1.strip() else ""
        return Result(scenario="disk_full", recovery_s=stopped_s,
                      recovery="volume full -> `synthq run` exited", samples=n,
                      lost=n - final, doubled=0, extra_requests=requests - n,
                      took_s=time.monotonic() - started,
                      figures=dict(exit_code=code, rerun_exit_code=code2,
                                   done_at_stop=at_stop, traceback="Traceback" in out1 + out2,
                                   message=last_line[:300],
                                   lines_after_fill=len([x for x in out1.splitlines()
                                                         if x.strip()]),
                                   requests_first_run=requests_before, inflight_limit=limit))
    finally:
        for p in list(cluster.procs):
            if p.name.startswith("run"):
                with contextlib.suppress(Exception):
                    p.stop()
        subprocess.run(["umount", "-l", str(vol)], capture_output=True, timeout=20)


#: Name -> scenario, in the order the bench runs them.
SCENARIOS: dict[str, Callable[..., Result]] = {
    "database_outage": database_outage,
    "dead_worker": dead_worker,
    "warm_shutdown": warm_shutdown,
    "hanging_server": hanging_server,
    "broker_wipe": broker_wipe,
    "payloads": payloads,
    "overload": overload,
    "broker_refuses_writes": broker_refuses_writes,
    "silent_worker": silent_worker,
    "disk_full": disk_full,
}


#: Scenarios that need more than PostgreSQL and Redis: name -> why not here (or None).
REQUIRES: dict[str, Callable[[], str | None]] = {"disk_full": can_mount_tmpfs}


@contextlib.contextmanager
def cluster(env: dict[str, str] | None = None, tmp: Path | None = None) -> Iterator[Cluster]:
    c = Cluster(env, tmp=tmp)
    try:
        yield c
    finally:
        c.close()

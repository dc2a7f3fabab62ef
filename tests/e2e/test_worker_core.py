"""The second worker design under failure: batches, the batch writer, worker heartbeats.

Real Celery workers and beat over real Redis and PostgreSQL, the simulator over
HTTP; kill tests kill real processes. The test settings (conftest.TEST_ENV)
make a worker count as dead 3 s after its last heartbeat.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from support import Proc, child_env, counts, free_port, wait_for, wait_worker_live

from synthq.db import session_scope, utcnow
from synthq.models import Attempt, Sample

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} question number {i}: explain something" for i in range(n)]


def ok_calls_per_sample(job_id: int) -> list[int]:
    with session_scope() as s:
        return [n for _, n in s.execute(
            select(Attempt.sample_id, func.count()).join(Sample, Sample.id == Attempt.sample_id)
            .where(Sample.job_id == job_id, Attempt.outcome == "ok")
            .group_by(Attempt.sample_id))]


def test_kill9_with_a_full_batch_mid_stream(workers: Any, simulator: Callable[..., Any],
                                            job_factory: Callable[..., Any]) -> None:
    """32 samples streaming in one worker; kill -9; a new worker finishes them, each done once.

    The stall timeout is 30 s, so the leases would hold the samples for 32 s:
    they come back because the dead worker stops heart-beating (3 s here).
    """
    sim = simulator("--latency", "0", "--tokens-per-second", "8", "--response-tokens", "40",
                    "--capacity", "64")
    n = 40
    report = job_factory(prompts(n, "batch"), servers=[sim.url], inflight_limit=32,
                         stall_timeout=30.0)
    victim = workers.worker(concurrency=32, name="victim")
    workers.beat()
    wait_for(lambda: counts(report.job_id)["running"] == 32 and sim.stats()["active"] == 32, 30,
             workers.logs())
    time.sleep(1.0)  # mid-stream: 5 s answers
    victim.kill9()
    killed_at = time.monotonic()
    assert counts(report.job_id)["running"] == 32
    workers.worker(concurrency=32, name="rescuer")
    wait_for(lambda: counts(report.job_id)["running"] < 32, 20,
             f"the dead worker's samples were not reclaimed\n{workers.logs()}")
    reclaimed_after = time.monotonic() - killed_at
    wait_for(lambda: counts(report.job_id)["done"] == n, 60, workers.logs())
    assert reclaimed_after < 15, reclaimed_after  # not the 32 s lease
    assert ok_calls_per_sample(report.job_id) == [1] * n
    with session_scope() as s:
        lost = s.scalar(select(func.count()).select_from(Attempt)
                        .where(Attempt.outcome == "lost")) or 0
    assert lost == 32  # the killed calls are on record
    assert max(sim.stats()["prompts"].values()) <= 2


def test_worker_killed_before_its_commit_is_retried(workers: Any, simulator: Callable[..., Any],
                                                    job_factory: Callable[..., Any],
                                                    pg: str) -> None:
    """Answers in hand but not yet committed when the worker dies: redone, never done
    without their row."""
    sim = simulator("--latency", "0.2", "--capacity", "16")
    n = 4
    report = job_factory(prompts(n, "commit"), servers=[sim.url], inflight_limit=8)
    victim = workers.worker(concurrency=8, name="victim")
    wait_worker_live()
    workers.beat()
    wait_for(lambda: counts(report.job_id)["running"] == n, 30, workers.logs())
    # Hold the rows: the writer's compare-and-set now waits on our lock.
    engine = create_engine(pg)
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(text("SELECT id FROM samples WHERE job_id = :j FOR UPDATE"),
                 {"j": report.job_id})
    wait_for(lambda: sim.stats()["completed"] >= n, 20, "calls did not finish")
    time.sleep(0.3)  # the outcomes are queued in the writer, blocked on the lock
    victim.kill9()
    tx.rollback()
    conn.close()
    engine.dispose()
    c = counts(report.job_id)
    assert c["done"] == 0 and c["running"] == n, c
    workers.worker(concurrency=8, name="rescuer")
    wait_for(lambda: counts(report.job_id)["done"] == n, 40, workers.logs())
    assert ok_calls_per_sample(report.job_id) == [1] * n
    assert all(v == 2 for v in sim.stats()["prompts"].values())
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Sample).where(
            Sample.state == "done", Sample.response_content.is_(None))) == 0


def test_flushall_no_sample_queued_a_minute(workers: Any, simulator: Callable[..., Any],
                                           job_factory: Callable[..., Any], redis_url: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After a broker wipe every queued sample moves again within the default 30 s deadline."""
    monkeypatch.setenv("SYNTHQ_QUEUED_TIMEOUT", "30")  # the product default
    sim = simulator("--latency", "0.5", "--capacity", "64")
    n = 200
    report = job_factory(prompts(n, "wipe"), servers=[sim.url], inflight_limit=32)
    workers.worker(concurrency=32)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] >= 20, 60, workers.logs())
    db = redis_url.rsplit("/", 1)[-1]
    # Pause the worker's consumption long enough that messages sit in Redis, then wipe.
    subprocess.run(["redis-cli", "-n", db, "FLUSHALL"], check=True, capture_output=True)
    wiped = utcnow()
    oldest = 0.0

    def finished() -> bool:
        nonlocal oldest
        with session_scope() as s:
            first = s.scalar(select(func.min(Sample.queued_at)).where(
                Sample.job_id == report.job_id, Sample.state == "queued"))
        if first is not None:
            oldest = max(oldest, (utcnow() - max(first, wiped)).total_seconds())
        return counts(report.job_id)["done"] == n

    wait_for(finished, 120, f"{counts(report.job_id)}\n{workers.logs()}", interval=0.5)
    assert oldest < 60, oldest
    assert ok_calls_per_sample(report.job_id) == [1] * n


def test_hanging_server_gets_one_probe_and_the_good_one_works(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    """A server that answers /health but never answers a generation: after 3 stalls it
    gets one request at a time, and the job finishes on the good server."""
    good = simulator("--latency", "0.05", "--capacity", "64")
    hanging = simulator("--hang-rate", "1.0", "--capacity", "64")
    n = 60
    report = job_factory(prompts(n, "hang"), servers=[good.url, hanging.url], inflight_limit=8,
                         stall_timeout=1.0, total_timeout=5.0, max_attempts=10)
    workers.worker(concurrency=32)
    workers.beat()
    started = time.monotonic()
    wait_for(lambda: counts(report.job_id)["done"] == n, 60,
             f"{counts(report.job_id)}\n{workers.logs()}")
    took = time.monotonic() - started
    with session_scope() as s:
        by_server = dict(s.execute(select(Attempt.server, func.count())
                                   .group_by(Attempt.server)).all())
    # The first batch (its limit, 8) stalls; then one probe at a time.
    hang_calls = by_server.get(hanging.url, 0)
    assert hang_calls <= 8 + took / 1.0 + 2, (hang_calls, took)
    assert by_server[good.url] >= n
    assert took < 40, took


@pytest.fixture
def private_pg(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """A PostgreSQL cluster of this test's own, so it can be stopped and started:
    ``(url, stop, start)``."""
    bindir = Path("/usr/lib/postgresql") / sorted(os.listdir("/usr/lib/postgresql"))[-1] / "bin"
    if os.geteuid() != 0 or not (bindir / "initdb").exists():
        pytest.skip("needs root and PostgreSQL's initdb to run a private cluster")
    data = Path(tempfile.mkdtemp(prefix="synthq-pg-"))
    shutil.chown(data, "postgres", "postgres")
    port = free_port()

    def as_postgres(*cmd: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=True,
                       capture_output=True, timeout=60)

    as_postgres(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")

    def start() -> None:
        as_postgres(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(data / "log"),
                    "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start")

    def stop() -> None:
        as_postgres(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-m", "fast", "stop")

    start()
    admin = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
                          isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("CREATE DATABASE synthq"))
    admin.dispose()
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/synthq", stop, start
    finally:
        subprocess.run(["runuser", "-u", "postgres", "--", str(bindir / "pg_ctl"), "-D",
                        str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def test_batch_writer_rides_out_a_postgres_restart(
        private_pg: tuple[str, Callable[[], None], Callable[[], None]], redis_url: str,
        simulator: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PostgreSQL stopped for 30 s mid-run: answers that arrive meanwhile are committed
    when it returns (not dropped and paid for again), work resumes within 15 s, and the
    job finishes."""
    from synthq.config import get_settings
    from synthq.db import dispose_engines
    from synthq.migrate import upgrade

    url, stop, start = private_pg
    upgrade(url)
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", url)
    get_settings.cache_clear()
    dispose_engines()
    from synthq.dataset import Row
    from synthq.enqueue import EnqueueReport, JobSpec, get_or_create_job, insert_rows

    sim = simulator("--latency", "1.0", "--capacity", "64")
    n = 120
    spec = JobSpec(name="outage", model="sim-model", servers=[sim.url], inflight_limit=16,
                   max_tokens=64)
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    insert_rows(job_id, settings, [Row(i, [{"role": "user", "content": p}])
                                   for i, p in enumerate(prompts(n, "outage"))],
                EnqueueReport(job_id=job_id, job_name="outage", created=True))
    env = child_env()
    procs = [Proc([sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q",
                   "generate,control,tokenize", "-P", "threads", "-c", "16", "-n", "w@%h",
                   "--without-mingle", "--without-gossip", "-l", "INFO"], env,
                  tmp_path / "worker.log"),
             Proc([sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
                   "--schedule", str(tmp_path / "beat-schedule")], env, tmp_path / "beat.log")]
    logs = lambda: "\n".join(p.log()[-3000:] for p in procs)  # noqa: E731
    try:
        wait_for(lambda: counts(job_id)["done"] >= 20, 60, logs())
        dispose_engines()
        stop()
        time.sleep(30)
        start()
        back = time.monotonic()
        before = counts(job_id)["done"]
        wait_for(lambda: counts(job_id)["done"] > before + 16, 30, logs(), interval=0.2)
        resumed_after = time.monotonic() - back
        wait_for(lambda: counts(job_id)["done"] == n, 120, logs(), interval=0.5)
    finally:
        for p in procs:
            p.stop()
        dispose_engines()
    assert ok_calls_per_sample(job_id) == [1] * n
    # Answers that arrived during the outage were written, not regenerated.
    assert sim.stats()["requests"] == n, sim.stats()
    assert "retrying" in procs[0].log()  # the writer did ride the outage out
    assert resumed_after < 15, resumed_after
    print(f"outage 30 s: work resumed {resumed_after:.1f} s after the database returned")


def test_sigterm_with_a_hanging_server_exits_within_the_grace(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm shutdown: calls get SYNTHQ_SHUTDOWN_GRACE seconds, then are cut and their
    samples go back to pending at once (not held until a lease expires)."""
    monkeypatch.setenv("SYNTHQ_SHUTDOWN_GRACE", "2")
    sim = simulator("--hang-rate", "1.0", "--capacity", "64")
    n = 6
    report = job_factory(prompts(n, "term"), servers=[sim.url], inflight_limit=8,
                         stall_timeout=120.0)
    w = workers.worker(concurrency=8)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["running"] == n, 30, workers.logs())
    started = time.monotonic()
    w.proc.send_signal(15)  # SIGTERM to the worker process
    w.proc.wait(30)
    took = time.monotonic() - started
    assert took < 10, took
    c = counts(report.job_id)
    # The stopping worker's capacity went to 0 first: nothing was queued for it again.
    assert c["running"] == 0 and c["queued"] == 0 and c["pending"] == n, c
    with session_scope() as s:
        classes = set(s.scalars(select(Sample.error_class)
                                .where(Sample.job_id == report.job_id)))
    assert classes == {"interrupted"}, classes

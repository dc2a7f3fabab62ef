"""Heartbeats that cannot strand a working worker (issue 30, item 5), against real
PostgreSQL, the simulator over HTTP and the executor in this process.

The heartbeat used to be a write of the batch writer: a stranded writer connection
silenced it for the whole answer deadline, the sweep counted a working worker dead,
and every answer it then brought was thrown away and paid for again. The scenario
with real processes is ``tests/chaos/test_half_open.py::test_stranded_heartbeat``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from synthq.queue import states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, Sample, Worker

pytestmark = pytest.mark.integration


def _queue_one(job_id: int, server: str) -> tuple[int, str]:
    now = utcnow()
    with session_scope() as s:
        smp = s.scalar(select(Sample.id).where(Sample.job_id == job_id))
        assert smp is not None
        states.queue(s, [smp], server=server, token="q1", now=now,
                     deadline=now + timedelta(seconds=60))
    return smp, "q1"


def _sweep_as_dead() -> list[Any]:
    """The beat's sweep a minute on: every worker counts dead (no heartbeat since)."""
    with session_scope() as s:
        return states.expire(s, now=utcnow() + timedelta(seconds=60), worker_timeout=15.0)


def _row(smp: int) -> tuple[Any, ...]:
    with session_scope() as s:
        r = s.execute(select(Sample.state, Sample.response_content, Sample.claim)
                      .where(Sample.id == smp)).one()
        outcomes = sorted(s.scalars(select(Attempt.outcome).where(Attempt.sample_id == smp)))
    return (*r, outcomes)


@pytest.fixture
def executor(pg: str) -> Iterator[Any]:
    from synthq.serving.executor import Executor

    ex = Executor(capacity=4)
    yield ex
    ex.close(timeout=5)


@pytest.mark.parametrize("meanwhile", ["pending", "claimed_elsewhere", "done_elsewhere"])
def test_a_late_answer_is_kept_once(executor: Any, simulator: Callable[..., Any],
                                    job_factory: Callable[..., Any], meanwhile: str) -> None:
    """The sweep gives a sample away during its call (its worker looked dead). The answer
    that then arrives is kept when no later attempt has finished, by compare-and-set:
    the sample is done with it, the sweep's ``lost`` row of that call is gone, and a
    later holder's result is refused. A later attempt that finished first keeps its own.
    Before, every such answer was thrown away (``lost``) and paid for again."""
    from synthq.serving.call import Outcome

    sim = simulator("--latency", "1.0")
    report = job_factory(["late answer"], servers=[sim.url])
    smp, token = _queue_one(report.job_id, sim.url)
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(
        executor.run_batch([(smp, token, report.job_id)])))
    runner.start()
    deadline = time.monotonic() + 10
    while sim.stats()["active"] < 1:  # the call is under way
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.02)
    assert _sweep_as_dead() == [(smp, "pending")]
    now = utcnow()
    if meanwhile != "pending":
        with session_scope() as s:  # another worker takes it again
            states.queue(s, [smp], server=sim.url, token="q2", now=now,
                         deadline=now + timedelta(seconds=60))
            [other] = states.claim_batch(s, [(smp, "q2")], new_token="c2", worker="w2",
                                         lease_until=now + timedelta(seconds=300), now=now)
        if meanwhile == "done_elsewhere":
            with session_scope() as s:
                assert states.complete(s, smp, "c2", now=now, response_content="theirs")
    runner.join(15)
    state, content, _, outcomes = _row(smp)
    if meanwhile == "done_elsewhere":
        assert result[smp] == Outcome.NOT_WRITTEN
        assert (state, content) == ("done", "theirs")
        return
    assert result[smp] == Outcome.DONE, result
    assert state == "done" and content and content != "theirs"
    assert outcomes == ["ok"], outcomes  # one call, answered; no lost row left
    if meanwhile == "claimed_elsewhere":  # the later holder cannot write a second result
        with session_scope() as s:
            assert not states.complete(s, smp, other.token, now=utcnow(),
                                       response_content="second")
        assert _row(smp)[1] == content


def test_a_late_answer_for_a_turn_already_answered_is_not_kept(
        executor: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    """keep_late takes a sample back only at the call's own turn with no answer stored."""
    sim = simulator("--latency", "0")
    report = job_factory(["turns"], servers=[sim.url])
    smp, token = _queue_one(report.job_id, sim.url)
    now = utcnow()
    with session_scope() as s:
        [c] = states.claim_batch(s, [(smp, token)], new_token="c1", worker="w1",
                                 lease_until=now + timedelta(seconds=300), now=now)
    _sweep_as_dead()
    late = dict(worker="w1", server=sim.url, started_at=now,
                lease_until=now + timedelta(seconds=300), now=utcnow())
    with session_scope() as s:
        assert not states.keep_late(s, smp, "c1", turn=1, **late)  # another turn
    with session_scope() as s:
        assert states.keep_late(s, smp, "c1", turn=0, **late)
        assert states.store_response(s, smp, "c1", now=utcnow(), response_content="first")
    _sweep_as_dead()
    with session_scope() as s:  # an answer is stored now: a second late one is refused
        assert not states.keep_late(s, smp, "c9", turn=0, **late)


def _beats(name: str) -> Any:
    with session_scope() as s:
        return s.scalar(select(Worker.heartbeat_at).where(Worker.name == name))


@pytest.fixture
def proxied(pg: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """This process's service connections go through a StrandingProxy (small limits:
    a stranded answer is given up after 3 + 2 s, a heartbeat's after 0.5 s)."""
    from support import _reset_process_state

    from synthq.store.db import dispose_engines, service_process
    from synthq.testing.halfopen import StrandingProxy

    port = int(pg.rsplit(":", 1)[1].split("/", 1)[0])
    with StrandingProxy("127.0.0.1", port) as proxy:
        monkeypatch.setenv("SYNTHQ_DATABASE_URL", proxy.url_for(pg))
        for key, value in {"SYNTHQ_DB_STATEMENT_TIMEOUT": "3", "SYNTHQ_DB_ANSWER_MARGIN": "2",
                           "SYNTHQ_HEARTBEAT_INTERVAL": "0.2", "SYNTHQ_WORKER_TIMEOUT": "2.5",
                           "SYNTHQ_HEARTBEAT_TIMEOUT": "0.5"}.items():
            monkeypatch.setenv(key, value)
        _reset_process_state()
        service_process(True)
        try:
            yield proxy
        finally:
            service_process(False)
            dispose_engines()


def test_the_heartbeat_outlives_a_stranded_writer(proxied: Any) -> None:
    """Every connection of the worker stranded, its writer's with them: the heartbeat is
    written again within its own short deadline (0.5 s) on a fresh connection, well
    inside the workers' timeout (2.5 s), though the writer waits 5 s for its answer.
    Before, the heartbeat was a write of the writer and waited those 5 s: the sweep
    counted the worker dead."""
    from synthq.serving.executor import Executor

    ex = Executor(capacity=4)
    try:
        ex.writer.submit(lambda s, now: None).result(10)  # the writer holds a connection
        first = _beats(ex.name)
        stranded = proxied.strand()
        assert stranded >= 2
        # The writer is stuck on its stranded connection from here ...
        stuck = ex.writer.submit(lambda s, now: s.execute(select(func.now())).scalar())
        time.sleep(1.5)
        assert not stuck.done()
        # ... and the heartbeat went on, on a connection of its own.
        assert _beats(ex.name) > first
        assert ex.heartbeat.fresh()
        stuck.result(15)  # then the writer gives its connection up and writes again
    finally:
        ex.close(timeout=10)


def test_a_worker_whose_heartbeat_is_late_starts_no_call(
        proxied: Any, monkeypatch: pytest.MonkeyPatch, simulator: Callable[..., Any],
        job_factory: Callable[..., Any]) -> None:
    """Only the heartbeat's connection stranded, with a deadline longer than the worker's
    own limit (half of its timeout): once its last heartbeat is that old, the worker
    hands a batch back instead of calling, and its refill claims nothing; when the
    heartbeat is written again it calls again."""
    from synthq.serving.call import Outcome
    from synthq.serving.executor import Executor
    from synthq.spec.config import get_settings
    from synthq.testing.chaos import _heartbeat_ports

    monkeypatch.setenv("SYNTHQ_HEARTBEAT_TIMEOUT", "3")
    get_settings.cache_clear()
    sim = simulator("--latency", "0")
    report = job_factory(["a", "b"], servers=[sim.url])
    ex = Executor(capacity=4)
    try:
        assert proxied.strand(_heartbeat_ports()) == 1
        time.sleep(ex.heartbeat.limit + 0.3)  # 1.25 s: the heartbeat hangs for 3 s
        assert not ex.heartbeat.fresh() and ex.local_claim() is None
        smp, token = _queue_one(report.job_id, sim.url)
        assert ex.run_batch([(smp, token, report.job_id)]) == {smp: Outcome.STALE}
        assert sim.stats()["requests"] == 0
        assert _row(smp)[0] == "pending"  # handed back, not left queued
        deadline = time.monotonic() + 10
        while not ex.heartbeat.fresh():  # dropped after 3 s; the next beat connects again
            assert time.monotonic() < deadline, "the heartbeat never came back"
            time.sleep(0.1)
        assert ex.local_claim() is not None
    finally:
        ex.close(timeout=10)


def test_a_dropped_connection_takes_its_server_session_and_locks_along(
        proxied: Any, pg: str, simulator: Callable[..., Any],
        job_factory: Callable[..., Any]) -> None:
    """A writer's transaction locked a sample, then sent a pipelined statement (an
    ``executemany``: the batch's attempt rows) whose Sync the strand held back. To the
    server that session is ``active`` (reading from its client), under no timeout, and
    keeps its row locks for good; the writer's retries of the same writes then ended in
    ``LockNotAvailable`` for minutes (2 of 10 chaos runs). Dropping the connection as
    half-open now ends its server session too: the lock is free at once."""
    import psycopg

    from synthq.store import db as dbmod

    sim = simulator("--latency", "0.1")
    report = job_factory(["locked"], servers=[sim.url])
    with session_scope() as s:
        smp = s.scalar(select(Sample.id).where(Sample.job_id == report.job_id))
    direct = pg.replace("postgresql+psycopg://", "postgresql://")
    raw = dbmod.get_engine().raw_connection()
    conn = raw.driver_connection
    assert conn is not None
    pid = conn.pgconn.backend_pid
    conn.execute("UPDATE samples SET updated_at = now() WHERE id = %s", [smp])
    with psycopg.connect(direct, autocommit=True) as watch:
        with pytest.raises(psycopg.OperationalError, match="half-open"), conn.pipeline() as p:
            conn.execute("SELECT pg_sleep(0)")
            deadline = time.monotonic() + 5
            while watch.execute("SELECT query FROM pg_stat_activity WHERE pid = %s",
                                [pid]).fetchone() != ("SELECT pg_sleep(0)",):
                assert time.monotonic() < deadline, "the pipelined statement never arrived"
                time.sleep(0.05)
            assert proxied.strand() >= 1
            # To the server it is a statement under way, waiting for its client: no
            # statement, lock or idle-in-transaction timeout ends it.
            assert watch.execute("SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s",
                                 [pid]).fetchone() == ("active", "ClientRead")
            p.sync()  # the Sync never arrives: the answer deadline (5 s) drops it
        # The row is free (before: locked by the stranded session, "active" for good).
        watch.execute("SET lock_timeout = '2s'")
        watch.execute("SELECT id FROM samples WHERE id = %s FOR UPDATE", [smp])
        assert watch.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                             [pid]).fetchone() == (0,)
    raw.invalidate()


def test_close_lets_the_loops_tasks_end_before_it_stops_the_loop(executor: Any) -> None:
    """A task one turn from its end when the process closes (a batch whose calls have all
    ended) ends, instead of being left pending on a stopped loop: at exit asyncio printed
    "Task was destroyed but it is pending!" after a full disk's one line (the chaos test
    test_disk_full_stops_synthq_run_and_the_rerun_finishes read it as the run's last)."""
    import asyncio

    almost = asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2, "ended"), executor.loop)
    executor.close(timeout=5)
    assert almost.done() and almost.result() == "ended"

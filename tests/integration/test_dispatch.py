"""Dispatcher, sweep and state transitions on real PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update
from support import counts

from synthq.queue import states
from synthq.queue.dispatch import Dispatched, dispatch
from synthq.queue.states import JobState
from synthq.queue.sweep import sweep
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration


def queued_on(server: str) -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Sample).where(
            Sample.server == server, Sample.state.in_(["queued", "running"]))) or 0


def test_concurrent_dispatchers_respect_the_limit(job_factory: Callable[..., Any]) -> None:
    server = "http://10.255.0.1:8000/v1"  # never called: nothing is processed here
    report = job_factory([f"p{i}" for i in range(500)], servers=[server], inflight_limit=16)
    taken: list[Dispatched] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def publish(batch: Any) -> None:
        with lock:
            taken.extend(batch)

    def run() -> None:
        barrier.wait()
        for _ in range(5):
            dispatch(publish)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 16
    assert len({d.sample_id for d in taken}) == 16
    assert queued_on(server) == 16
    assert counts(report.job_id)["pending"] == 500 - 16


def test_two_jobs_share_a_server_limit(job_factory: Callable[..., Any]) -> None:
    server = "http://10.255.0.2:8000/v1"
    job_factory(["a1", "a2", "a3", "a4"], servers=[server], inflight_limit=3)
    job_factory(["b1", "b2", "b3", "b4"], servers=[server], inflight_limit=5)
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    dispatch(batch.extend)
    assert len(batch) == 3  # the stricter limit holds for both jobs together


def test_samples_spread_over_servers(job_factory: Callable[..., Any]) -> None:
    a, b = "http://10.255.0.3:8000/v1", "http://10.255.0.4:8000/v1"
    job_factory([f"p{i}" for i in range(50)], servers=[a, b], inflight_limit=10)
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert sorted({d.server for d in batch}) == [a, b]
    assert queued_on(a) == 10 and queued_on(b) == 10


def test_paused_job_is_not_dispatched_and_its_messages_are_released(
        job_factory: Callable[..., Any]) -> None:
    from synthq.serving.executor import process_sample

    report = job_factory(["x", "y"], servers=["http://10.255.0.5:8000/v1"])
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert len(batch) == 2
    with session_scope() as s:
        s.execute(update(Job).values(state=JobState.PAUSED))
    more: list[Dispatched] = []
    dispatch(more.extend)
    assert more == []
    # A message that arrives for a paused job gives its slot back without a call.
    assert process_sample(batch[0].sample_id, batch[0].token).value == "stale"
    assert counts(report.job_id)["pending"] == 1


def test_claim_is_compare_and_set(sample_factory: Callable[..., int]) -> None:
    now = utcnow()
    sid = sample_factory("queued", claim="tok", server="http://s/v1",
                         expires_at=now + timedelta(seconds=60))
    with session_scope() as s:
        assert states.claim(s, sid, "wrong", new_token="n1", lease_until=now, worker="w",
                            now=now) is None
        assert states.claim(s, sid, "tok", new_token="n1", lease_until=now, worker="w",
                            now=now) is not None
    with session_scope() as s:  # a duplicate delivery of the same message
        assert states.claim(s, sid, "tok", new_token="n2", lease_until=now, worker="w",
                            now=now) is None
        assert not states.complete(s, sid, "tok", now=now, response_content="late")
        assert states.complete(s, sid, "n1", now=now, response_content="first")
        assert not states.complete(s, sid, "n1", now=now, response_content="again")
        assert not states.retry(s, sid, "n1", now=now, next_attempt_at=now,
                                error_class="timeout", error_message="x")
    with session_scope() as s:
        smp = s.get_one(Sample, sid)
        assert (smp.state, smp.response_content, smp.attempts) == ("done", "first", 1)


def test_sweep_returns_expired_leases_and_fails_exhausted(
        sample_factory: Callable[..., int], job_factory: Callable[..., Any]) -> None:
    job_id = job_factory([], max_attempts=3).job_id
    past = utcnow() - timedelta(seconds=1)
    future = utcnow() + timedelta(seconds=60)
    lost_queued = sample_factory("queued", job_id=job_id, claim="a", expires_at=past)
    lost_running = sample_factory("running", job_id=job_id, claim="b", attempts=1,
                                  expires_at=past)
    exhausted = sample_factory("running", job_id=job_id, claim="c", attempts=3,
                               expires_at=past)
    alive = sample_factory("running", job_id=job_id, claim="d", attempts=1,
                           expires_at=future)
    # `requeue --max-attempts` bounds a sample by its own setting, not the job's.
    raised = sample_factory("running", job_id=job_id, claim="e", attempts=3,
                            expires_at=past, overrides={"max_attempts": 5})
    lowered = sample_factory("running", job_id=job_id, claim="f", attempts=2,
                             expires_at=past, overrides={"max_attempts": 2})
    assert sweep() == 5
    with session_scope() as s:
        got = {i: (s.get_one(Sample, i).state, s.get_one(Sample, i).claim)
               for i in (lost_queued, lost_running, exhausted, alive, raised, lowered)}
    assert got == {lost_queued: ("pending", None), lost_running: ("pending", None),
                   exhausted: ("failed", None), alive: ("running", "d"),
                   raised: ("pending", None), lowered: ("failed", None)}


def test_requeue_failed_by_class(sample_factory: Callable[..., int],
                                 job_factory: Callable[..., Any]) -> None:
    job_id = job_factory([]).job_id
    t = sample_factory("failed", job_id=job_id, error_class="timeout", attempts=5)
    c = sample_factory("failed", job_id=job_id, error_class="context_length", attempts=1)
    with session_scope() as s:
        assert states.requeue(s, job_id, classes=["timeout"], now=utcnow()) == 1
    with session_scope() as s:
        assert s.get_one(Sample, t).state == "pending" and s.get_one(Sample, t).attempts == 0
        assert s.get_one(Sample, c).state == "failed"


def test_down_server_gets_one_probe_at_a_time(job_factory: Callable[..., Any]) -> None:
    from synthq.store.models import Attempt

    up, down = "http://10.255.0.6:8000/v1", "http://10.255.0.7:8000/v1"
    job_factory([f"p{i}" for i in range(40)], servers=[up, down], inflight_limit=8)
    now = utcnow() - timedelta(seconds=10)  # the last probe is long past
    with session_scope() as s:
        sid = s.scalar(select(Sample.id).limit(1))
        for outcome in ["ok", "connection", "connection", "connection"]:
            s.add(Attempt(sample_id=sid, server=down, started_at=now, ended_at=now,
                          outcome=outcome))
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert queued_on(up) == 8 and queued_on(down) == 1
    dispatch(batch.extend)
    assert queued_on(down) == 1  # one probe at a time
    with session_scope() as s:  # the probe succeeds: full limit again
        s.add(Attempt(sample_id=sid, server=down, started_at=now, ended_at=now, outcome="ok"))
    dispatch(batch.extend)
    assert queued_on(down) == 8


def test_a_down_servers_probe_never_takes_a_sample_that_just_failed_there(
        job_factory: Callable[..., Any]) -> None:
    """The other server at its limit and no fresh sample left: the down server's probe
    does not take the retry that last failed on it (a chaos run saw it go back to the
    hanging server); it takes one that failed elsewhere, and the retry waits for room on
    the other server."""
    from synthq.store.models import Attempt

    up, down = "http://10.255.0.16:8000/v1", "http://10.255.0.17:8000/v1"
    report = job_factory(["a", "b", "c", "d"], servers=[up, down], inflight_limit=2)
    now = utcnow() - timedelta(seconds=10)  # the last probe is long past
    with session_scope() as s:
        a, b, c, d = s.scalars(select(Sample.id).where(Sample.job_id == report.job_id)
                               .order_by(Sample.id)).all()
        for outcome in ["connection", "connection", "connection"]:  # down
            s.add(Attempt(sample_id=a, server=down, started_at=now, ended_at=now,
                          outcome=outcome))
        # a and b failed on the down server (due again, a first); c and d hold the up
        # server's two slots
        s.execute(update(Sample).where(Sample.id.in_([a, b])).values(
            attempts=1, last_server=down, next_attempt_at=now))
        s.execute(update(Sample).where(Sample.id.in_([c, d])).values(
            state="running", server=up, attempts=1))
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert batch == [] and queued_on(down) == 0  # no probe with a retry from there
    with session_scope() as s:  # b failed on the up server since: it may probe
        s.execute(update(Sample).where(Sample.id == b).values(last_server=up))
    dispatch(batch.extend)
    assert [d.sample_id for d in batch] == [b] and queued_on(down) == 1


def test_bulk_insert_keeps_dataset_order_and_dedupes(job_factory: Callable[..., Any]) -> None:
    prompts = [f"p{i}" for i in range(12_000)] + ["p5", "p7"]  # two repeats
    report = job_factory(prompts)
    assert (report.inserted, report.duplicates) == (12_000, 2)
    with session_scope() as s:
        order = s.scalars(select(Sample.dataset_index).order_by(Sample.id)).all()
    assert list(order) == list(range(12_000))
    again = job_factory(prompts, name=report.job_name)
    assert (again.inserted, again.duplicates) == (0, 12_002)


def test_unhealthy_server_gets_nothing_until_its_probe_passes(
        job_factory: Callable[..., Any], simulator: Callable[..., Any]) -> None:
    from support import free_port

    from synthq.serving import health

    sim = simulator("--latency", "0")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    job_factory([f"p{i}" for i in range(30)], servers=[dead, sim.url], inflight_limit=5)
    assert health.probe_due([dead, sim.url]) == {dead: False, sim.url: True}
    assert health.probe_due([dead, sim.url]) == {}  # probed moments ago: not due
    batch: list[Dispatched] = []
    dispatch(batch.extend)
    assert queued_on(dead) == 0 and queued_on(sim.url) == 5
    with session_scope() as s:  # the dead server comes back (its probe passes)
        from synthq.store.models import Server

        s.execute(update(Server).where(Server.url == dead).values(healthy=True))
    dispatch(batch.extend)
    assert queued_on(dead) == 5


def test_health_url() -> None:
    from synthq.serving.health import health_url

    assert health_url("http://vllm:8000/v1") == "http://vllm:8000/health"
    assert health_url("http://vllm:8000/v1/") == "http://vllm:8000/health"
    assert health_url("https://h/proxy") == "https://h/proxy/health"


def test_a_local_refill_claims_its_own_share_within_the_limit(
        job_factory: Callable[..., Any]) -> None:
    """dispatch(local=...): the worker's free slots are claimed for it in the dispatch's
    transaction (running, under its name), the rest published; the limit still holds."""
    from synthq.queue.dispatch import LocalClaim

    servers = ["http://10.255.0.7:8000/v1", "http://10.255.0.8:8000/v1"]
    report = job_factory([f"p{i}" for i in range(100)], servers=servers, inflight_limit=6)
    started: list[states.Claimed] = []
    published: list[Dispatched] = []
    local = LocalClaim("me", 5, lambda s, job_id: 60.0, started.extend)
    assert dispatch(published.extend, local=local, capacity=100) == 12
    assert len(started) == 5 and len(published) == 7
    assert {c.server for c in started} == set(servers)  # spread over both servers
    assert not {c.sample_id for c in started} & {d.sample_id for d in published}
    with session_scope() as s:
        rows = s.execute(select(Sample.state, Sample.worker, Sample.attempts, Sample.claim)
                         .where(Sample.id.in_([c.sample_id for c in started]))).all()
    assert all(r[0] == "running" and r[1] == "me" and r[2] == 1 for r in rows)
    assert {r[3] for r in rows} == {started[0].token}
    # Full: nothing more is queued or claimed until a slot frees.
    assert dispatch(published.extend, local=LocalClaim("me", 5, lambda s, j: 60.0, started.extend),
                    capacity=100) == 0
    assert [queued_on(u) for u in servers] == [6, 6]
    assert counts(report.job_id)["running"] == 5


def test_only_the_live_workers_free_slots_are_queued(job_factory: Callable[..., Any],
                                                    redis_url: str) -> None:
    """Without an explicit capacity, a dispatch queues at most the live workers'
    capacity minus what is already queued or running; a silent worker counts for none.
    (A broker is configured: ``redis_url``; in embedded mode the runner passes its own.)"""
    from synthq.queue import workers

    server = "http://10.255.0.9:8000/v1"
    job_factory([f"p{i}" for i in range(50)], servers=[server], inflight_limit=40)
    published: list[Dispatched] = []
    now = utcnow()
    with session_scope() as s:
        workers.heartbeat(s, "h:1:live", capacity=7, inflight=0, now=now)
        workers.heartbeat(s, "h:2:gone", capacity=100, inflight=0, now=now - timedelta(hours=1))
    assert dispatch(published.extend) == 7
    assert dispatch(published.extend) == 0  # all 7 slots held by queued samples
    with session_scope() as s:
        workers.heartbeat(s, "h:3:new", capacity=3, inflight=0, now=utcnow())
    assert dispatch(published.extend) == 3
    assert queued_on(server) == 10


def test_a_refills_one_statement_reads_each_servers_latest_calls_as_the_per_server_read(
        job_factory: Callable[..., Any]) -> None:
    """The load statement's LATERAL part (PostgreSQL) gives each server's latest
    TRIP_AFTER calls newest first, exactly as the per-server read does: the down check
    and the probe's timing read them."""
    import random

    from synthq.queue.dispatch import _latest_calls, _load
    from synthq.store.models import Attempt

    urls = [f"http://10.255.1.{i}:8000/v1" for i in range(4)]
    report = job_factory(["p0"], servers=urls[:1], inflight_limit=4)
    with session_scope() as s:
        sample_id = s.scalar(select(Sample.id).where(Sample.job_id == report.job_id))
    rng = random.Random(7)
    t0 = utcnow() - timedelta(minutes=5)
    rows = []
    for i in range(40):  # servers 0-2 get calls in shuffled order; server 3 none
        url = urls[rng.randrange(3)]
        rows.append(dict(sample_id=sample_id, server=url, worker="w",
                         started_at=t0 + timedelta(seconds=i),
                         ended_at=t0 + timedelta(seconds=i + rng.random()),
                         outcome=rng.choice(["ok", "connection", "timeout", "server_error"]),
                         error_message=rng.choice([None, "HTTP 503 (Retry-After 7 s)"])))
    with session_scope() as s:
        s.execute(insert(Attempt), rows)
    with session_scope() as s:
        merged = _load(s, urls, capacity_since=None).latest
        assert merged == {url: _latest_calls(s, url) for url in urls}
        assert [len(merged[u]) for u in urls] == [3, 3, 3, 0]
        assert all(a[2] > b[2] for u in urls[:3] for a, b in zip(merged[u], merged[u][1:],
                                                                strict=False))

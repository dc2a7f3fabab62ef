"""Half-open connections (issue 24, items 12-13): a TCP proxy of the test's own
(:mod:`synthq.testing.halfopen`) between the processes and PostgreSQL or Redis strands every
connection open at one moment (no byte forwarded, nothing closed) while new ones
pass. Before the fix the job froze for good: each thread waited forever on a socket
whose peer still acknowledged every packet, and a dead session "idle in transaction"
held the dispatch lock.

The limits are the settings' (``SYNTHQ_DB_*``), small here so the test is quick.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from synthq.testing import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

def test_postgres_half_open(cluster: chaos.Cluster) -> None:
    """Every connection of the worker and beat to PostgreSQL stranded mid-run, one of
    them holding the dispatch lock in an open transaction: the job moves again within
    60 s and finishes, nothing lost, no answer paid twice beyond the calls in flight
    (:func:`synthq.testing.chaos.postgres_half_open`, also run by scripts/check_hostile.py)."""
    r = chaos.postgres_half_open(cluster)
    print(f"\n{r.line()}")
    assert r.figures["stranded"] >= 2  # the worker's and beat's, and the lock holder's
    assert r.lost == 0
    assert r.recovery_s < 60
    assert r.doubled <= r.figures["limit"] and r.extra_requests <= r.figures["limit"]


@pytest.mark.parametrize("strand", ["every_connection", "heartbeat_only"])
def test_stranded_heartbeat(cluster: chaos.Cluster, strand: str) -> None:
    """Issue 30 item 5: two workers, beat, ``--inflight 16``, 300 samples; every PostgreSQL
    connection stranded at one moment (or only the workers' heartbeat sessions), for
    longer than the workers' timeout. Before the fix the heartbeat waited behind the
    stranded writer, the sweep counted a working worker dead and up to 55 prompts (160 at
    the default limits) were generated twice; now at most the calls in flight, and none
    when only the heartbeat's connection is stranded
    (:func:`synthq.testing.chaos.stranded_heartbeat`)."""
    only = strand == "heartbeat_only"
    r = chaos.stranded_heartbeat(cluster, heartbeat_only=only)
    print(f"\n{r.line()}")
    limit = r.figures["limit"]
    assert r.lost == 0
    if only:
        assert r.figures["stranded"] == 2  # one heartbeat session per worker
        assert r.extra_requests == 0 and r.doubled == 0 and r.figures["swept"] == 0
    else:
        assert r.figures["stranded"] >= 4
        assert r.extra_requests <= limit and r.doubled <= limit
        # No working worker was counted dead (before: 9-55 of its calls swept as lost in 5
        # of 6 runs).
        assert r.figures["swept"] == 0


#: Small broker limits: a command waits 2 s for its answer, a silent BRPOP connection
#: is dropped after about 1 + 2 s; a message lost with its connection comes back after 5 s.
REDIS_LIMITS = {"SYNTHQ_BROKER_SOCKET_TIMEOUT": "2", "SYNTHQ_BROKER_HEALTH_CHECK_INTERVAL": "2",
                "SYNTHQ_QUEUED_TIMEOUT": "5"}


def test_redis_half_open(cluster: chaos.Cluster) -> None:
    """Every connection of the worker and beat to Redis stranded mid-run (the consumer's
    BRPOP, the publishers'): before the fix all work stopped silently while heartbeats
    looked healthy. The job moves again within 60 s and finishes, nothing paid twice."""
    assert cluster.redis is not None
    n, limit = 80, 8
    cluster.setenv(**REDIS_LIMITS)
    proxy = cluster.stranding_proxy(cluster.redis.port)
    via = {"SYNTHQ_BROKER_URL": proxy.url_for(cluster.redis.url)}
    sim = cluster.simulator("--latency", "0.3", "--capacity", "64")
    job_id = chaos.create_job(chaos.prompts(n, "redis"), [sim.url], inflight_limit=limit)
    cluster.worker(concurrency=limit, **via)
    cluster.beat(**via)
    chaos.wait_until(lambda: chaos.counts(job_id)["done"] >= 15, 90, "15 samples done",
                     logs=cluster.logs)
    stranded = proxy.strand()
    at = time.monotonic()
    before = chaos.counts(job_id)["done"]
    moved = chaos.wait_until(
        lambda: chaos.counts(job_id)["done"] > before + limit and time.monotonic(), 60,
        "the job to move again after the strand", interval=0.2, logs=cluster.logs)
    chaos.wait_until(lambda: chaos.counts(job_id)["done"] >= n, 120, "every sample done",
                     interval=0.25, logs=cluster.logs)
    requests = sim.stats()["requests"]
    doubled = sum(1 for v in chaos.ok_calls_per_sample(job_id).values() if v > 1)
    print(f"\nredis half-open: {stranded} connections stranded; moved again after "
          f"{moved - at:.1f} s; requests {requests} for {n} samples; doubled {doubled}")
    assert stranded >= 2
    assert chaos.counts(job_id)["done"] == n
    assert moved - at < 60
    assert doubled == 0 and requests == n


def test_undelivered_messages_are_claimed_from_sql(workers: Any, simulator: Callable[..., Any],
                                                   job_factory: Callable[..., Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples queued in SQL whose messages never reach the broker (lost with a stranded
    publisher connection), beside a worker with free slots and no beat: the worker's
    idle refill claims them from SQL (``adopt_stale``) long before the queued deadline
    (300 s here), each answered once."""
    from support import counts, wait_for, wait_worker_live

    from synthq.queue.dispatch import Dispatched, dispatch

    monkeypatch.setenv("SYNTHQ_QUEUED_TIMEOUT", "300")
    sim = simulator("--latency", "0.1")
    report = job_factory([f"undelivered {i}" for i in range(6)], servers=[sim.url])
    workers.worker(concurrency=8)
    wait_worker_live()
    lost: list[Dispatched] = []
    dispatch(lost.extend, job_ids=[report.job_id])  # queued in SQL, never published
    assert len(lost) == 6
    started = time.monotonic()
    wait_for(lambda: counts(report.job_id)["done"] == 6, 30, workers.logs())
    took = time.monotonic() - started
    print(f"\nundelivered messages: 6 samples claimed from SQL and done in {took:.1f} s")
    assert sim.stats()["requests"] == 6
    assert "no message came" in workers.logs()

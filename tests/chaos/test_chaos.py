"""The chaos suite (issue 10): each scenario kills or restarts a real process.

Every test runs on its own PostgreSQL and Redis (``conftest.py``), real
Celery workers and beat, and the simulator; the scenarios are in
:mod:`synthq.testing.chaos` (``bench/chaos.py`` runs the same ones and prints
their figures, at the product's defaults). Where a test waits out a clock of the
product (the worker timeout, the queued deadline, a job's backoff), the clock is set
shorter through its setting, in the defaults' proportions, and the test's outage and
bounds are written in it; everything else is short too. Each test prints its
recovery figure (``pytest -s`` shows it).
"""

from __future__ import annotations

import pytest

from synthq.testing import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def report(result: chaos.Result) -> None:
    print("\n" + result.line())


#: The worker timeout and the queued deadline of the tests that wait them out: a third of
#: the product's defaults (15 s and 30 s), in the same proportion, set through their
#: settings (``SYNTHQ_WORKER_TIMEOUT``, ``SYNTHQ_QUEUED_TIMEOUT``); the bounds below are
#: written in them. ``bench/chaos.py`` runs the same scenarios at the defaults.
WORKER_TIMEOUT = 5.0
QUEUED_TIMEOUT = 2 * WORKER_TIMEOUT


def short_clocks(cluster: chaos.Cluster) -> None:
    cluster.setenv(SYNTHQ_WORKER_TIMEOUT=f"{WORKER_TIMEOUT:g}",
                   SYNTHQ_QUEUED_TIMEOUT=f"{QUEUED_TIMEOUT:g}")


def test_private_services_stop_and_come_back(private_pg: chaos.PrivatePostgres,
                                             private_redis: chaos.PrivateRedis) -> None:
    """The fixtures themselves: PostgreSQL stops and starts with its data; Redis comes
    back empty."""
    from sqlalchemy import create_engine, text

    engine = create_engine(private_pg.url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x int)"))
        conn.execute(text("INSERT INTO t VALUES (1)"))
    engine.dispose()
    private_pg.stop()
    private_pg.start()
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM t")) == 1
    engine.dispose()
    client = private_redis.client()
    client.rpush("generate", b"x")
    client.close()
    private_redis.kill()
    private_redis.start()
    client = private_redis.client()
    assert client.llen("generate") == 0
    client.close()


def test_database_outage_past_the_worker_and_queued_timeouts(cluster: chaos.Cluster) -> None:
    """Target 1. PostgreSQL stopped mid-run for as long as the queued deadline, twice the
    worker timeout (30 s at the defaults; :data:`QUEUED_TIMEOUT` here): every heartbeat is
    past the timeout and every queued sample past its deadline when it returns. Answers
    that arrive meanwhile are committed when it returns (not dropped and paid for again),
    work resumes within 15 s of its return, and nothing is generated twice."""
    short_clocks(cluster)
    r = chaos.database_outage(cluster, outage=QUEUED_TIMEOUT, n=100)
    report(r)
    assert r.lost == 0 and r.doubled == 0, r
    assert r.extra_requests == 0, r  # answers held through the outage were written
    assert r.figures["writer_retried"], cluster.logs()  # the writer did ride it out
    # Issue 10's target, not a clock of the settings above: the writer retries at most
    # 5 s apart (synthq.serving.writer), a failed heartbeat 0.2 s apart.
    assert r.recovery_s < 15, r


def test_dead_worker_kill9(cluster: chaos.Cluster) -> None:
    """Target 2. kill -9 of the only worker with 32 samples streaming and 32 queued in
    messages it had taken, leases of 330 s: its running samples come back when its
    heartbeat stops (the worker timeout: default 15 s, :data:`WORKER_TIMEOUT` here), its
    queued ones at their deadline (default 30 s, :data:`QUEUED_TIMEOUT` here), both
    within the queued deadline; a new worker finishes every sample, each answer stored
    once."""
    short_clocks(cluster)
    r = chaos.dead_worker(cluster)
    report(r)
    assert r.figures["running_at_kill"] == 32 and r.figures["queued_at_kill"] == 32, r
    assert r.lost == 0 and r.doubled == 0, r
    # The heartbeat, not the 330 s lease (10 s for the sweep's tick and the machine).
    assert r.figures["running_back_s"] < WORKER_TIMEOUT + 10, r
    # The deadline (not the lease) counts from the queueing, a moment before the kill; the
    # sweep's tick and the machine add the rest, as for the running ones (a run at load 10
    # had them back 2.6 s after the deadline).
    assert r.figures["queued_back_s"] < QUEUED_TIMEOUT + 10, r
    assert r.figures["lost_attempts"] == 32  # the killed calls are on record
    assert r.extra_requests == 32 and r.figures["max_requests_per_prompt"] == 2, r


def test_warm_shutdown_with_hanging_calls(cluster: chaos.Cluster) -> None:
    """Target 3. SIGTERM to one of two busy workers, some of its calls hanging: it exits
    within the grace period (3 s here), its cut calls go back to pending as
    ``interrupted``, and with a 300 s queued deadline nothing stays queued: the job
    finishes on the other worker."""
    r = chaos.warm_shutdown(cluster, grace=3.0)
    report(r)
    assert r.figures["exit_code"] == 0, cluster.logs()
    assert r.recovery_s < 3.0 + 5, r  # the grace, plus Celery's own shutdown
    assert r.figures["interrupted_calls"] >= 1, r  # its hanging calls were cut
    assert r.lost == 0 and r.doubled == 0, r
    assert r.figures["oldest_queued_s"] < 20, r  # nothing waited on a deadline of 300 s
    assert r.figures["job_done_after_term_s"] < 60, r


def test_hanging_server_beside_a_good_one(cluster: chaos.Cluster) -> None:
    """Target 4. A server that answers /health but hangs every call: after the first
    stalls it gets one probe at a time, retried samples go to the good server, and the
    job takes seconds (the issue measured 618 s)."""
    r = chaos.hanging_server(cluster)
    report(r)
    assert r.lost == 0 and r.doubled == 0, r
    # The first batch (the limit, 8) stalls; then one probe every PROBE_INTERVAL (2 s).
    assert r.figures["calls_to_hanging"] <= 8 + r.recovery_s / 2.0 + 2, r
    assert r.figures["retried_on_hanging_again"] == 0, r  # a retry prefers the other one
    assert r.recovery_s < 40, r


def test_broker_wipe_redis_killed_and_restarted_empty(cluster: chaos.Cluster) -> None:
    """Redis killed mid-run and restarted empty (3 s later), the default 30 s queued
    deadline: the worker and beat reconnect, every sample whose message died moves again,
    none stays queued 60 s after the restart, every sample is done once."""
    r = chaos.broker_wipe(cluster)
    report(r)
    assert r.figures["worker_alive"] and r.figures["beat_alive"], cluster.logs()
    # Samples queued while Redis was down are handed back when their publish fails, so
    # few (often none) are stranded; any that are move again by the queued deadline.
    assert r.lost == 0 and r.doubled == 0 and r.extra_requests == 0, r
    assert r.figures["oldest_queued_after_restart_s"] < 60, r
    assert r.recovery_s < 60, r


def test_payloads_through_a_worker(cluster: chaos.Cluster) -> None:
    """Target 5. NUL, lone surrogates and invalid UTF-8 are stored as U+FFFD and counted;
    an HTML body and a stream without [DONE] are retried as server_error and never mark
    the server down; an answer over max_response_bytes fails as response_too_large."""
    r = chaos.payloads(cluster)
    report(r)
    assert r.lost == 0 and r.doubled == 0, r
    assert r.figures["repaired"] == {"nul": 2, "surrogate": 2, "badutf8": 2}, r
    assert r.figures["retry_paths"] == {"html": ["server_error,server_error,ok"],
                                        "nodone": ["server_error,server_error,ok"]}, r
    assert r.figures["server_down_seen"] == 0 and r.figures["connection_outcomes"] == 0, r
    assert r.figures["too_large"] == ("failed", "response_too_large", 1), r


def test_overload_503_retry_after_outlasting_the_backoff(cluster: chaos.Cluster) -> None:
    """Issue 18 A. 100 samples, default job settings but a backoff base of 1 s (default
    2 s), every call answered 503 + Retry-After: 5 while /health is 200, for as long as
    the 5 attempts' backoffs last at most (1 + 2 + 4 + 8 bases: 30 s at the default
    base, 15 s here): every sample ends done (before, at the defaults, all 100 failed
    server_error within 27 s); the server got about one probe per Retry-After, not its
    whole limit again and again."""
    from synthq.spec.jobspec import BY_NAME

    base = 1.0
    attempts = BY_NAME["max_attempts"].default
    r = chaos.overload(cluster, seconds=base * (2 ** (attempts - 1) - 1), backoff_base=base)
    report(r)
    assert r.figures["failed"] == 0 and r.lost == 0 and r.doubled == 0, r
    # The first wave (the limit, 64), then one probe per Retry-After (5 s) while it lasts.
    assert r.figures["overload_answers"] <= (
        64 + r.figures["overload_s"] / r.figures["retry_after_s"] + 3), r
    assert r.figures["max_attempts_charged"] <= 2, r
    assert r.recovery_s < 15, r


def test_broker_refuses_writes_while_the_worker_works(cluster: chaos.Cluster) -> None:
    """Issue 18 B. Redis at maxmemory under noeviction (the ack's ZREM answers OOM) until
    the worker and beat have each met a refused write and the worker has done more
    samples than its slots meanwhile (bench/chaos.py: 20 s): the worker survives (before:
    "Unrecoverable error", exit), keeps what it holds safe (SQL is the truth), and the
    job (150 samples) finishes once Redis accepts writes again, on the same worker
    process, each answer paid once."""
    r = chaos.broker_refuses_writes(cluster, refuse=None, n=150)
    report(r)
    assert r.figures["worker_alive"] and not r.figures["unrecoverable"], r
    assert r.figures["beat_alive"], r
    assert r.lost == 0 and r.doubled == 0, r
    assert r.recovery_s < 60, r


def test_disk_full_stops_synthq_run_and_the_rerun_finishes(cluster: chaos.Cluster) -> None:
    """Issue 18 C. `synthq run` on a SQLite volume that fills mid-run stops within 60 s
    (seconds, in fact) with one line naming the volume and no traceback (before: a
    crash in sweep(), 90 s of retries, a traceback); with space freed, the same command
    finishes every sample, asking the server at most once per sample plus the calls
    that were in flight."""
    reason = chaos.can_mount_tmpfs()
    if reason:
        pytest.skip(reason)
    # 200 samples (bench/chaos.py: 600): the volume fills once 50 are done, with the run
    # under way; the rerun finishes the rest. The count proves nothing more.
    r = chaos.disk_full(cluster, n=200)
    report(r)
    assert r.figures["exit_code"] != 0 and not r.figures["traceback"], cluster.logs()
    assert r.figures["message"].startswith("error: disk full at "), r
    assert "free space and run the same command again" in r.figures["message"], r
    assert r.recovery_s < 60, r
    assert r.figures["rerun_exit_code"] == 0 and r.lost == 0, cluster.logs()
    assert r.extra_requests <= r.figures["inflight_limit"], r


def test_silent_worker_cut_calls_are_lost_once(cluster: chaos.Cluster) -> None:
    """Issue 18 E. A worker SIGSTOPped past its worker timeout (3 s here) with its calls
    hanging, then SIGCONTed: the sweep (on a second worker) reclaims its samples and
    logs each cut call lost; the woken worker, finding its leases gone, logged each
    again (2 rows per call). Now one row per cut call, and the job finishes."""
    r = chaos.silent_worker(cluster)
    report(r)
    assert r.lost == 0 and r.doubled == 0 and r.figures["worker_alive"], r
    assert r.figures["cut_calls"] >= 12, r
    assert r.figures["lost_rows"] == r.figures["cut_calls"], r

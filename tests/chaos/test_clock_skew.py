"""A worker whose clock is 120 s off (issue 24, item 14), under libfaketime.

A real Celery worker runs with its wall clock 120 s behind (or ahead) beside a
worker and beat on the true time. Before the fix its heartbeats looked dead at once
and its leases expired as it took them: the sweep reclaimed its samples while it kept
working (answers paid twice, more calls in flight than the limit); ahead, its
retries were due in everyone's future. Every time synthq writes is the database's
now (:mod:`synthq.core.clock`), and ``synthq status`` names the skewed worker.

Needs Debian's ``faketime`` package (``.ci/run`` installs it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import Proc, child_env, counts, wait_for, wait_worker_live

from synthq.testing import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


needs_faketime = pytest.mark.skipif(chaos.has_libfaketime() is not None,
                                    reason="libfaketime is not installed (apt-get install "
                                    "faketime)")


@needs_faketime
@pytest.mark.parametrize("offset", ["-120s", "+120s"])
def test_worker_clock_120s_off(cluster: chaos.Cluster, offset: str) -> None:
    """0 answers paid twice, the in-flight limit exact, every sample done, and status
    warns about the skewed worker (:func:`synthq.testing.chaos.clock_skew`, also run by
    scripts/check_hostile.py)."""
    # 48 samples (scripts/check_hostile.py: 96), 12 of them retried: the skewed worker's
    # heartbeat and leases looked dead from its first claim before the fix, so the count
    # adds nothing but time.
    r = chaos.clock_skew(cluster, offset=offset, n=48)
    f = r.figures
    print(f"\n{r.line()}")
    assert abs(abs(f["skew_s"]) - 120) < 5, f  # faketime works
    assert r.lost == 0
    assert r.extra_requests == 0 and r.doubled == 0, r  # no answer paid twice
    assert f["prompt_max_calls"] <= 2, f
    assert f["max_active"] <= f["limit"], f
    skews = f["status_skews"]
    assert any(abs(abs(v) - 120) < 5 for v in skews.values() if v is not None), skews
    ahead = "ahead of" if offset.startswith("+") else "behind"
    assert any("clock is 120 s " + ahead in w for w in f["status_warnings"]), f


# -- issue 41, items 8 and 9: no expiry or first stamp on the worker's own clock ------------

def _skewed_worker(tmp_path: Path, offset: str, name: str) -> Proc:
    """A real generation worker (Celery, threads) whose wall clock is ``offset`` off."""
    cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "worker", "-Q",
           "generate,control,tokenize", "-P", "threads", "-c", "4", "-n", f"{name}@%h",
           "--without-mingle", "--without-gossip", "-l", "INFO"]
    return Proc(cmd, child_env(**chaos.faked(offset)), tmp_path / f"{name}.log")


@needs_faketime
def test_worker_120s_ahead_runs_the_ticks(pg: str, redis_url: str, tmp_path: Path,
                                          job_factory: Callable[..., Any],
                                          simulator: Callable[..., Any]) -> None:
    """The only worker's clock is 120 s ahead: the enqueue kick's tick and beat's ticks
    dispatch all the same. Before: Celery checked each tick's 5 s ``expires`` against the
    worker's clock and discarded every one ("Discarding revoked task"): 0 of 4 dispatched."""
    from synthq.queue.broker import kick_dispatch

    sim = simulator("--latency", "0.05")
    worker = _skewed_worker(tmp_path, "+120s", "ahead")
    beat = None
    try:
        wait_worker_live(1, timeout=120)
        # The enqueue kick, sent on the true clock, with no beat running.
        kicked = job_factory(["kick one", "kick two"], servers=[sim.url]).job_id
        kick_dispatch()
        wait_for(lambda: counts(kicked).get("done", 0) == 2, 60,
                 lambda: f"the kick's tick did not dispatch: {counts(kicked)}\n"
                         f"{worker.log()[-3000:]}")
        # Beat's ticks (no kick for this job).
        ticked = job_factory(["beat one", "beat two"], servers=[sim.url]).job_id
        beat = Proc([sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
                     "--schedule", str(tmp_path / "beat-schedule")], child_env(),
                    tmp_path / "beat.log")
        wait_for(lambda: counts(ticked).get("done", 0) == 2, 60,
                 lambda: f"beat's ticks did not dispatch: {counts(ticked)}\n"
                         f"{worker.log()[-3000:]}\n{beat.log()[-2000:] if beat else ''}")
        assert "Discarding revoked task" not in worker.log()
    finally:
        if beat is not None:
            beat.stop()
        worker.stop()


@needs_faketime
def test_first_heartbeat_of_a_worker_600s_ahead_is_not_in_the_future(
        pg: str, redis_url: str, tmp_path: Path) -> None:
    """A worker 600 s ahead: its first heartbeat (the row's ``started_at``, written once)
    is the database's time. Before: the machine's, 600 s in the future, so a worker that
    died before its second beat looked alive for 10 minutes."""
    from sqlalchemy import func, select

    from synthq.store.db import session_scope
    from synthq.store.models import Worker

    worker = _skewed_worker(tmp_path, "+600s", "far")
    try:
        wait_worker_live(1, timeout=120)
        with session_scope() as s:
            started, skew = s.execute(select(Worker.started_at, Worker.clock_skew)).one()
            now = s.scalar(select(func.clock_timestamp()))
        ahead = (started - now).total_seconds()
        assert ahead <= 1.0, f"the first heartbeat is {ahead:.0f} s in the future"
        assert skew is not None and abs(skew - 600) < 5, skew  # faketime works
    finally:
        worker.stop()

"""A worker whose clock is 120 s off (issue 24, item 14), under libfaketime.

A real Celery worker runs with its wall clock 120 s behind (or ahead) beside a
worker and beat on the true time. Before the fix its heartbeats looked dead at once
and its leases expired as it took them: the sweep reclaimed its samples while it kept
working (answers paid twice, more calls in flight than the limit); ahead, its
retries were due in everyone's future. Every time synthq writes is the database's
now (:mod:`synthq.clock`), and ``synthq status`` names the skewed worker.

Needs Debian's ``faketime`` package (``.ci/run`` installs it).
"""

from __future__ import annotations

import pytest

from synthq.testing import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]



@pytest.mark.skipif(chaos.has_libfaketime() is not None, reason="libfaketime is not installed "
                    "(apt-get install faketime)")
@pytest.mark.parametrize("offset", ["-120s", "+120s"])
def test_worker_clock_120s_off(cluster: chaos.Cluster, offset: str) -> None:
    """0 answers paid twice, the in-flight limit exact, every sample done, and status
    warns about the skewed worker (:func:`synthq.testing.chaos.clock_skew`, also run by
    scripts/check_hostile.py)."""
    r = chaos.clock_skew(cluster, offset=offset)
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

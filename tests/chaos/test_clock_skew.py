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

import json
import sys
from pathlib import Path

import pytest

from synthq.testing import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

LIBFAKETIME = next((p for p in (Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
                                Path("/usr/lib/faketime/libfaketimeMT.so.1")) if p.exists()),
                   None)


def faked(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock moved by ``offset``
    (monotonic time stays true: durations are measured right)."""
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1"}


@pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed "
                    "(apt-get install faketime)")
@pytest.mark.parametrize("offset", ["-120s", "+120s"])
def test_worker_clock_120s_off(cluster: chaos.Cluster, offset: str) -> None:
    """0 answers paid twice, the in-flight limit exact, every sample done, and status
    warns about the skewed worker."""
    import subprocess

    n, limit = 96, 16
    sim = cluster.simulator("--latency", "0.4", "--capacity", "64")
    check = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                           env=cluster.child_env(**faked(offset)), capture_output=True,
                           text=True, check=True)
    import time

    assert abs(abs(float(check.stdout) - time.time()) - 120) < 5, check  # faketime works
    # Retries too: every 4th prompt fails its first call, its retry is due 0.1-0.5 s later.
    texts = [p + (" [[sim:error*1]]" if i % 4 == 0 else "")
             for i, p in enumerate(chaos.prompts(n, "skew"))]
    job_id = chaos.create_job(texts, [sim.url], inflight_limit=limit)
    cluster.worker(concurrency=8, name="skewed", **faked(offset))
    cluster.worker(concurrency=8, name="true")
    cluster.wait_workers(2)
    cluster.beat()
    chaos.wait_until(lambda: chaos.counts(job_id)["done"] >= n, 120, "every sample done",
                     interval=0.25, logs=cluster.logs)
    stats = sim.stats()
    faults = sum(stats["faults"].values())
    status = subprocess.run([sys.executable, "-m", "synthq.cli", "status", str(job_id),
                             "--json"], env=cluster.child_env(), capture_output=True,
                            text=True, timeout=60)
    print(f"\nworker clock {offset}: requests {stats['requests']} for {n} samples "
          f"({faults} planned errors), max in flight {stats['max_active']} (limit {limit})")
    assert stats["requests"] == n + faults, stats  # no answer paid twice
    assert max(stats["prompts"].values()) <= 2, stats
    assert stats["max_active"] <= limit, stats
    data = json.loads(status.stdout)
    skews = {w["name"]: w["clock_skew_s"] for w in data["workers"]}
    assert any(abs(abs(v) - 120) < 5 for v in skews.values() if v is not None), skews
    ahead = "ahead of" if offset.startswith("+") else "behind"
    assert any("clock is 120 s " + ahead in w for w in data["warnings"]), data["warnings"]

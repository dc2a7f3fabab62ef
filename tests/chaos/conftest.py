"""Fixtures for the chaos suite: every test gets its own PostgreSQL and Redis processes.

* ``private_pg``: a PostgreSQL cluster of the test's own (``initdb`` in a temporary
  directory, a free port), with ``stop()`` / ``start()``.
* ``private_redis``: ``redis-server`` on a free port without persistence, with
  ``kill()`` (SIGKILL) and ``start()`` (back empty on the same URL).
* ``cluster``: both, migrated, this process's settings pointed at them, and a
  factory for the simulator and real ``celery worker`` / ``celery beat``
  processes (:class:`synthq.testing.chaos.Cluster`).

The scenarios themselves live in :mod:`synthq.testing.chaos`, shared with
``bench/chaos.py``; the tests assert on the figures they return.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from synthq.testing import chaos


def _skip_unless_possible() -> None:
    reason = chaos.unavailable()
    if reason:
        pytest.skip(f"chaos tests need their own PostgreSQL and Redis: {reason}")


@pytest.fixture
def private_pg() -> Iterator[chaos.PrivatePostgres]:
    """A PostgreSQL cluster of this test's own, so it can be stopped and started."""
    _skip_unless_possible()
    pg = chaos.PrivatePostgres()
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[chaos.PrivateRedis]:
    """A Redis of this test's own: ``kill()`` loses every message, ``start()`` is empty."""
    _skip_unless_possible()
    redis = chaos.PrivateRedis(tmp_path)
    try:
        yield redis
    finally:
        redis.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[chaos.Cluster]:
    """Private PostgreSQL (migrated) + private Redis + process factory; settings point at
    them for the test and are restored after it."""
    _skip_unless_possible()
    with chaos.cluster(tmp=tmp_path) as c:
        yield c

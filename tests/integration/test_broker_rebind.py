"""Each test's messages go to its own Redis database, whatever test imported
``worker.app`` first (its broker URL is read once, at import). In a random order a test
without Redis imported it first, on the default database 0, and later tests published
there: a training worker on the test's database never got its run, and beat's tick was
never in the queue the test read (two CI failures)."""

from __future__ import annotations

import pytest
from support import _reset_process_state

pytestmark = [pytest.mark.integration]


def test_a_stale_import_is_pointed_at_this_tests_broker(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    from worker.app import app
    from worker.tasks import publish_train

    # As if an earlier test had imported the app with no broker set.
    monkeypatch.setattr(app.conf, "broker_url", "redis://127.0.0.1:6379/0")
    _reset_process_state()  # what the redis_url fixture does for every test
    assert app.conf.broker_url == redis_url
    client = redis.Redis.from_url(redis_url)
    try:
        publish_train([4242])
        assert client.llen("train") == 1
    finally:
        client.delete("train")
        client.close()

"""Messages to the workers, sent without importing the worker package.

The queues and their routes live here; ``worker/app.py`` takes them from this
module (dependencies point one way: ``worker`` imports ``synthq``). Commands
that hand work to the workers (``synthq retokenize``, ``synthq train``) send
by task name through a client-only Celery app: no task code is imported.

Every message goes through Redis' default exchange straight to the named
list, so publishing does not depend on kombu's binding keys: after a
``FLUSHALL`` (or a Redis restart without persistence) messages still arrive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

__all__ = ["GENERATE_ROUTE", "CONTROL_ROUTE", "TOKENIZE_ROUTE", "TRAIN_ROUTE", "CAPTURE_ROUTE",
           "send", "kick_dispatch", "transport_options", "redis_options", "ping",
           "TICK_TASK", "tick_ttl", "mark_tick", "take_tick"]

GENERATE_ROUTE = {"queue": "generate", "exchange": "", "routing_key": "generate"}
CONTROL_ROUTE = {"queue": "control", "exchange": "", "routing_key": "control"}
TOKENIZE_ROUTE = {"queue": "tokenize", "exchange": "", "routing_key": "tokenize"}
TRAIN_ROUTE = {"queue": "train", "exchange": "", "routing_key": "train"}
CAPTURE_ROUTE = {"queue": "capture", "exchange": "", "routing_key": "capture"}


def transport_options() -> dict[str, Any]:
    """kombu's Redis transport options for every synthq broker connection: socket and
    connect timeouts, TCP keepalives, redis-py's health check (and kombu's own check of
    the BRPOP connection), a timed-out command retried once on a fresh connection. A
    Redis that stops answering without closing the connection (a failover, a NAT or a
    proxy that lost its upstream) then costs seconds, not the whole run."""
    from synthq.spec.config import get_settings

    s = get_settings()
    return {"socket_timeout": s.broker_socket_timeout,
            "socket_connect_timeout": s.broker_connect_timeout,
            "socket_keepalive": True,
            "health_check_interval": s.broker_health_check_interval,
            "retry_on_timeout": True}


def redis_options() -> dict[str, Any]:
    """The same limits for Celery's Redis result backend (``redis_*`` settings), should
    one be configured: synthq itself ignores results."""
    t = transport_options()
    return {"redis_socket_timeout": t["socket_timeout"],
            "redis_socket_connect_timeout": t["socket_connect_timeout"],
            "redis_socket_keepalive": True, "redis_retry_on_timeout": True,
            "redis_backend_health_check_interval": t["health_check_interval"]}


def ping(url: str, timeout: float = 2.0) -> None:
    """Raise unless the Redis at ``url`` answers PING within ``timeout`` seconds
    (``redis.RedisError``, ``OSError``, or ``ValueError`` for a malformed URL)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    finally:
        client.close()


@lru_cache(maxsize=1)
def _client() -> Any:
    from celery import Celery

    from synthq.spec.config import get_settings

    app = Celery("synthq-client", broker=get_settings().broker_url)
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True,
                    task_send_sent_event=True, broker_transport_options=transport_options(),
                    **redis_options())
    return app


def send(task: str, args: Iterable[Sequence[Any]], route: dict[str, str]) -> int:
    """Send one ``task`` message per argument tuple over one connection; returns the count."""
    app = _client()
    n = 0
    with app.producer_or_acquire() as producer:
        for a in args:
            app.send_task(task, args=list(a), producer=producer, **route)
            n += 1
    return n


#: The scheduler tick's task name (beat sends it every ``dispatch_interval``).
TICK_TASK = "synthq.dispatch"

#: The Redis key that keeps one tick message worth running: ``TICK_KEY + its task id``.
TICK_KEY = "synthq:tick:"


def tick_ttl() -> float:
    """Seconds a tick message is worth running after it is sent: five ticks, at least 5 s.
    A tick nobody ran in time is useless (the next one does the same work), and a backlog
    (beat sending while no worker consumes) must not be run tick after tick."""
    from synthq.spec.config import get_settings

    return max(5.0, get_settings().dispatch_interval * 5)


@lru_cache(maxsize=4)
def _redis(url: str) -> Any:
    import redis

    t = transport_options()
    return redis.Redis.from_url(url, socket_timeout=t["socket_timeout"],
                                socket_connect_timeout=t["socket_connect_timeout"],
                                socket_keepalive=True,
                                health_check_interval=t["health_check_interval"])


def mark_tick(task_id: str) -> None:
    """Before tick ``task_id`` is sent: a key that Redis itself deletes after
    :func:`tick_ttl` seconds (issue 41). Raises what redis-py raises.

    This is the tick's expiry, timed by one clock, Redis'. Celery's own ``expires`` is
    a time of the sender's clock that the receiving worker checks against its own: a
    worker whose clock ran 120 s ahead discarded every tick ("Discarding revoked
    task"), and nothing was dispatched or swept."""
    from synthq.spec.config import get_settings

    _redis(get_settings().broker_url).set(TICK_KEY + task_id, b"1",
                                          px=int(tick_ttl() * 1000))


def take_tick(task_id: str | None) -> bool:
    """Whether a received tick is still worth running: its key was there (deleted now,
    so a redelivered copy is not run again). True for a call outside Celery (no id) and
    when Redis cannot say: a tick too many is harmless (it takes the dispatcher's lock)."""
    if not task_id:
        return True
    from synthq.spec.config import get_settings

    try:
        return bool(_redis(get_settings().broker_url).delete(TICK_KEY + task_id))
    except Exception:  # noqa: BLE001 - redis' errors, or a broker URL it cannot read
        return True


def kick_dispatch() -> None:
    """Ask the workers for one scheduler tick now (``synthq.dispatch``, as beat sends it
    every ``dispatch_interval``): samples just enqueued start at once instead of at
    beat's next tick (up to a second later, a tenth of a 2,000-sample job's run here).

    The tick takes the dispatcher's lock, so one beside beat's does no harm, and it
    expires as beat's do (:func:`mark_tick`): a tick nobody ran in time is useless.
    Raises as ``send`` does (the caller decides whether an unreachable broker matters).
    """
    from uuid import uuid4

    app = _client()
    task_id = str(uuid4())
    mark_tick(task_id)
    app.send_task(TICK_TASK, task_id=task_id, retry=False, **CONTROL_ROUTE)

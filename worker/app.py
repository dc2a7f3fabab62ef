"""The Celery application (Redis broker).

Start the generation worker with::

    celery -A worker.app worker -Q generate,control,tokenize -P threads -c 128 -E
    celery -A worker.app beat
    celery -A worker.app worker -Q train -P solo     # drafter training (GPU)

(``synthq worker`` and ``synthq beat`` wrap exactly these.)
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from synthq.queue.broker import (
    CAPTURE_ROUTE,
    CONTROL_ROUTE,
    GENERATE_ROUTE,
    TICK_TASK,
    TOKENIZE_ROUTE,
    TRAIN_ROUTE,
    mark_tick,
    redis_options,
    transport_options,
)
from synthq.spec.config import get_settings

__all__ = ["app", "GENERATE_ROUTE", "CONTROL_ROUTE", "TOKENIZE_ROUTE", "TRAIN_ROUTE"]

settings = get_settings()


def _survive_broker_loss() -> None:
    """Keep the worker alive when Redis goes away while it holds unacknowledged messages.

    With ``acks_late`` a busy worker always holds some. After a lost
    connection kombu 5.7 still restores (on close) or acknowledges (when a
    batch ends after the reconnect) those messages through their old channel,
    whose transport is gone: the client it builds for that raises
    AttributeError, which neither kombu nor Celery catch ("Unrecoverable
    error"): the worker exited on every Redis restart. Raising the broker's
    connection error instead lets both treat it as the lost connection it is.
    The message stays in Redis' unacked hash (if Redis kept it) and is
    redelivered after the visibility timeout, harmlessly (the claim token is
    stale); SQL is the truth, and the queued deadline resends what is due.
    """
    create = kombu_redis.Channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if getattr(self.connection, "client", None) is None:
            raise kombu_redis.redis.exceptions.ConnectionError(
                "the broker connection of this channel is closed")
        return create(self, asynchronous=asynchronous)

    kombu_redis.Channel._create_client = _create_client  # type: ignore[method-assign]


_survive_broker_loss()


def _refused(exc: BaseException) -> bool:
    """Redis is up but refuses writes: ``maxmemory`` under ``noeviction`` (every command
    inside MULTI answers OOM, the ack's ZREM included), a read-only replica, or a
    failed snapshot with ``stop-writes-on-bgsave-error`` (MISCONF)."""
    from redis import exceptions

    return isinstance(exc, exceptions.OutOfMemoryError | exceptions.ReadOnlyError) or (
        isinstance(exc, exceptions.ResponseError) and "MISCONF" in str(exc))


#: Whether this process last saw the broker refuse a write (one log line per episode).
_refusing = {"now": False}


def _note_refused(what: str, exc: BaseException) -> None:
    if not _refusing["now"]:
        _refusing["now"] = True
        logging.getLogger("worker").warning(
            "the broker refuses writes (%s: %s); carrying on: the work held is safe in SQL, "
            "its messages are redelivered harmlessly later", what,
            str(exc).splitlines()[0][:200])


def _note_accepted() -> None:
    if _refusing["now"]:
        _refusing["now"] = False
        logging.getLogger("worker").warning("the broker accepts writes again")


def _survive_broker_refusing_writes() -> None:
    """Keep the worker alive when Redis refuses writes (issue 18).

    With ``maxmemory`` reached under ``noeviction`` the acknowledgement's ZREM
    (in MULTI) answers OOM; kombu raised it, Celery logged "Unrecoverable
    error" and the worker exited for good. The broker is only a carrier of
    hints (SQL is the truth), so a refused write of its bookkeeping is noted
    once and passed over, and the process's own count of unacknowledged
    messages still moves (or it would stop consuming at its prefetch limit):

    * a refused ack leaves the message in Redis' unacked hash: redelivered after
      the visibility timeout, harmlessly (its claim token is stale);
    * a refused entry in the unacked index (on delivery) means the message is
      not redelivered if this worker dies: the queued deadline brings it back;
    * a refused restore (at shutdown, or of expired unacked messages) waits for
      the next one.

    Publishing fails too while Redis refuses; the dispatcher then hands the
    samples back to pending, and sends them once Redis accepts writes again.
    """
    qos = kombu_redis.QoS
    ack, reject, append = qos.ack, qos.reject, qos.append
    restore_by_tag, restore_visible = qos.restore_by_tag, qos.restore_visible

    def safe_ack(self: Any, delivery_tag: Any) -> None:
        try:
            ack(self, delivery_tag)
        except Exception as exc:
            if not _refused(exc):
                raise
            _note_refused("acknowledgement", exc)
            virtual.QoS.ack(self, delivery_tag)
        else:
            _note_accepted()

    def safe_reject(self: Any, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            reject(self, delivery_tag, requeue=requeue)
        except Exception as exc:
            if not _refused(exc):
                raise
            _note_refused("rejection", exc)
            virtual.QoS.ack(self, delivery_tag)

    def safe_append(self: Any, message: Any, delivery_tag: Any) -> None:
        try:
            append(self, message, delivery_tag)
        except Exception as exc:
            if not _refused(exc):
                raise
            _note_refused("unacked index", exc)
            virtual.QoS.append(self, message, delivery_tag)

    def safe_restore_by_tag(self: Any, tag: Any, client: Any = None,
                            leftmost: bool = False) -> None:
        try:
            restore_by_tag(self, tag, client=client, leftmost=leftmost)
        except Exception as exc:
            if not _refused(exc):
                raise
            _note_refused("restore", exc)

    def safe_restore_visible(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            restore_visible(self, *args, **kwargs)
        except Exception as exc:
            if not _refused(exc):
                raise
            _note_refused("restore of expired messages", exc)

    qos.ack = safe_ack  # type: ignore[method-assign]
    qos.reject = safe_reject  # type: ignore[method-assign]
    qos.append = safe_append  # type: ignore[method-assign]
    qos.restore_by_tag = safe_restore_by_tag  # type: ignore[method-assign]
    qos.restore_visible = safe_restore_visible  # type: ignore[method-assign]


_survive_broker_refusing_writes()

app = Celery("synthq", broker=settings.broker_url or "redis://127.0.0.1:6379/0",
             include=["worker.tasks"])
app.conf.update(
    # A message is acknowledged after its task returns; if the worker dies the
    # message is redelivered, and the claim token makes the redelivery harmless.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Redelivery of unacknowledged messages: above the longest call (the
    # default total timeout is 30 min). Rows, not messages, carry retries.
    # Timeouts and keepalives: a half-open Redis must not freeze a worker or beat.
    broker_transport_options={"visibility_timeout": settings.visibility_timeout,
                              **transport_options()},
    **redis_options(),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    # Flower shows tasks only with events on, and "sent" only with this.
    worker_send_task_events=True,
    task_send_sent_event=True,
    task_routes={"synthq.generate": GENERATE_ROUTE, "synthq.dispatch": CONTROL_ROUTE,
                 "synthq.retokenize": TOKENIZE_ROUTE, "synthq.train": TRAIN_ROUTE,
                 "synthq.capture": CAPTURE_ROUTE},
    task_default_queue="control",
    beat_schedule={
        "dispatch": {
            "task": "synthq.dispatch",
            "schedule": settings.dispatch_interval,
            # A tick nobody ran in time is useless: the next one does the same work. Its
            # expiry is a Redis key (_mark_tick), not Celery's `expires`, which the worker
            # checks against its own clock.
            "options": {**CONTROL_ROUTE},
        },
    },
    worker_hijack_root_logger=False,
)


@signals.after_setup_logger.connect
def _setup_logs(logger: Any = None, **_: Any) -> None:
    """Passwords masked in every line; the idle dispatch tick and httpx quiet."""
    from worker.logs import setup

    setup(logger)


@signals.before_task_publish.connect
def _mark_tick(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """A tick sent from this process (beat's) is worth running for ``tick_ttl`` seconds,
    timed by Redis (synthq.queue.broker.mark_tick); the worker runs it only while its key is
    there. No clock of a worker or of beat's machine decides it (issue 41)."""
    if sender != TICK_TASK or not headers or not headers.get("id"):
        return
    try:
        mark_tick(str(headers["id"]))
    except Exception as exc:  # noqa: BLE001 - the send fails too, or the next tick runs
        logging.getLogger("worker").warning(
            "could not mark the scheduler tick %s (%s); a worker skips it, the next one "
            "runs", headers["id"], str(exc).splitlines()[0][:200] if str(exc) else
            type(exc).__name__)


@signals.beat_init.connect
def _quiet_beat(**_: Any) -> None:
    """Beat sends only the dispatch tick: no task-sent event for it (Flower's list is
    for generation and tokenization). Beat is a service process (the dispatch lock)."""
    from synthq.store.db import service_process

    app.conf.task_send_sent_event = False
    service_process()


@signals.celeryd_init.connect
def _service_worker(options: dict[str, Any] | None = None, **_: Any) -> None:
    """A generation worker's sessions get the statement, lock and idle-transaction limits
    and the answer deadline (``db_statement_timeout``); a training worker's do not (its
    export and checkpoints may hold long statements)."""
    from synthq.store.db import service_process

    queues = (options or {}).get("queues") or []
    if isinstance(queues, str):
        queues = queues.split(",")
    if set(queues) != {"train"}:
        service_process()


#: The training worker's own readiness check (synthq.training.readiness.Watch), or None.
_readiness: dict[str, Any] = {"watch": None}


@signals.worker_ready.connect
def _watch_training_runs(sender: Any = None, **_: Any) -> None:
    """A training worker runs the readiness check itself (issue 41): beat's tick runs only
    in a consumer of ``control``, and with only training workers and beat running, an
    orphaned run stayed ``running`` under its dead holder for good."""
    queues = {q.name for q in sender.task_consumer.queues} if sender is not None else set()
    if "train" not in queues or _readiness["watch"] is not None:
        return
    from synthq.training.readiness import Watch
    from worker.tasks import publish_train

    watch = _readiness["watch"] = Watch(publish_train)
    watch.start()
    logging.getLogger("worker").info(
        "training worker: checks for orphaned and ready training runs every %.0f s",
        watch.interval)


@signals.worker_shutdown.connect
def _stop_watching_training_runs(**_: Any) -> None:
    watch, _readiness["watch"] = _readiness["watch"], None
    if watch is not None:
        watch.stop()

"""The Celery application (Redis broker).

Start the generation worker with::

    celery -A worker.app worker -Q generate,control,tokenize -P threads -c 128 -E
    celery -A worker.app beat
    celery -A worker.app worker -Q train -P solo     # drafter training (GPU)

(``synthq worker`` and ``synthq beat`` wrap exactly these.)
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals
from kombu.transport import redis as kombu_redis

from synthq.broker import CONTROL_ROUTE, GENERATE_ROUTE, TOKENIZE_ROUTE, TRAIN_ROUTE
from synthq.config import get_settings

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
    broker_transport_options={"visibility_timeout": settings.visibility_timeout},
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    # Flower shows tasks only with events on, and "sent" only with this.
    worker_send_task_events=True,
    task_send_sent_event=True,
    task_routes={"synthq.generate": GENERATE_ROUTE, "synthq.dispatch": CONTROL_ROUTE,
                 "synthq.retokenize": TOKENIZE_ROUTE, "synthq.train": TRAIN_ROUTE},
    task_default_queue="control",
    beat_schedule={
        "dispatch": {
            "task": "synthq.dispatch",
            "schedule": settings.dispatch_interval,
            # A tick nobody ran in time is useless: the next one does the same work.
            "options": {**CONTROL_ROUTE, "expires": max(5.0, settings.dispatch_interval * 5)},
        },
    },
    worker_hijack_root_logger=False,
)


@signals.after_setup_logger.connect
def _setup_logs(logger: Any = None, **_: Any) -> None:
    """Passwords masked in every line; the idle dispatch tick and httpx quiet."""
    from worker.logs import setup

    setup(logger)


@signals.beat_init.connect
def _quiet_beat(**_: Any) -> None:
    """Beat sends only the dispatch tick: no task-sent event for it (Flower's list is
    for generation and tokenization)."""
    app.conf.task_send_sent_event = False

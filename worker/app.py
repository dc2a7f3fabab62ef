"""The Celery application (Redis broker).

Start the generation worker with::

    celery -A worker.app worker -Q generate,control,tokenize -P threads -c 128 -E
    celery -A worker.app beat
    celery -A worker.app worker -Q train -P solo     # drafter training (GPU)

(``synthq worker`` and ``synthq beat`` wrap exactly these.)
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.transport import redis as kombu_redis

from synthq.config import get_settings

__all__ = ["app", "GENERATE_ROUTE", "CONTROL_ROUTE", "TOKENIZE_ROUTE", "TRAIN_ROUTE"]

settings = get_settings()


def _survive_broker_loss() -> None:
    """Keep the worker alive when Redis goes away while it holds unacknowledged messages.

    With ``acks_late`` a busy worker always holds some. On a lost connection
    Celery's consumer first collects the connection (kombu clears the
    transport's client when the channel's close fails on the dead socket) and
    then closes it again; that second close restores the unacknowledged
    messages through a client it can no longer build, raises AttributeError,
    which Celery does not catch: "Unrecoverable error", and the worker exited
    on every Redis restart. Without a transport there is nothing to restore
    through: the messages stay in Redis' unacked hash (redelivered after the
    visibility timeout if Redis kept them), and SQL is the truth anyway (the
    queued deadline resends their samples).
    """
    restore = kombu_redis.QoS.restore_unacked

    def restore_unacked(self: Any, client: Any = None) -> Any:
        transport = getattr(self.channel, "connection", None)
        if client is None and getattr(transport, "client", None) is None:
            self._delivered.clear()
            return None
        return restore(self, client)

    kombu_redis.QoS.restore_unacked = restore_unacked


_survive_broker_loss()

# Messages go through Redis' default exchange straight to the named list, so
# publishing does not depend on kombu's binding keys: after a `FLUSHALL` (or a
# Redis restart without persistence) the dispatcher's messages still arrive.
GENERATE_ROUTE = {"queue": "generate", "exchange": "", "routing_key": "generate"}
CONTROL_ROUTE = {"queue": "control", "exchange": "", "routing_key": "control"}
TOKENIZE_ROUTE = {"queue": "tokenize", "exchange": "", "routing_key": "tokenize"}
# Drafter training (synthq.training): its own worker, one run at a time (-P solo, GPU).
TRAIN_ROUTE = {"queue": "train", "exchange": "", "routing_key": "train"}

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

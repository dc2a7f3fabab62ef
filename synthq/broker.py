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
           "send"]

GENERATE_ROUTE = {"queue": "generate", "exchange": "", "routing_key": "generate"}
CONTROL_ROUTE = {"queue": "control", "exchange": "", "routing_key": "control"}
TOKENIZE_ROUTE = {"queue": "tokenize", "exchange": "", "routing_key": "tokenize"}
TRAIN_ROUTE = {"queue": "train", "exchange": "", "routing_key": "train"}
CAPTURE_ROUTE = {"queue": "capture", "exchange": "", "routing_key": "capture"}


@lru_cache(maxsize=1)
def _client() -> Any:
    from celery import Celery

    from synthq.config import get_settings

    app = Celery("synthq-client", broker=get_settings().broker_url)
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True,
                    task_send_sent_event=True)
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

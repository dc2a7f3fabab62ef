"""Flower for synthq's Celery app, with its /metrics behind the same basic auth.

Flower 2.x serves ``/metrics`` to anyone, even with ``--basic-auth``; this
launcher wraps that handler with ``tornado.web.authenticated`` (which runs
Flower's basic-auth check) before starting ``celery -A worker.app flower``.
``/healthcheck`` stays open for container health checks. Started by
``synthq flower``, which checks that basic auth is configured.
"""

from __future__ import annotations

import sys

import tornado.web
from flower.views import monitor

__all__ = ["main"]


def _protect_metrics() -> None:
    get = monitor.Metrics.get
    if getattr(get, "__synthq_protected__", False):
        return
    protected = tornado.web.authenticated(get)
    protected.__synthq_protected__ = True  # type: ignore[attr-defined]
    monitor.Metrics.get = protected  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    _protect_metrics()
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", "-A", "worker.app", "flower", *argv]
    celery_main()


if __name__ == "__main__":
    main(sys.argv[1:])

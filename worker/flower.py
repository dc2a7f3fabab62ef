"""Flower for synthq's Celery app, with its /metrics behind the same basic auth.

Flower 2.x serves ``/metrics`` to anyone, even with ``--basic-auth``; this
launcher wraps that handler with ``tornado.web.authenticated`` (which runs
Flower's basic-auth check) before starting ``celery -A worker.app flower``.
``/healthcheck`` stays open for container health checks. Every page also
gets anti-framing headers. Started by ``synthq flower``, which checks that
basic auth is configured.
"""

from __future__ import annotations

import sys

import tornado.web
from flower import views
from flower.views import monitor

__all__ = ["main", "SECURITY_HEADERS"]

#: On every Flower page and API answer, as on synthq's API (api/guard.py): its
#: buttons (revoke, shut down a worker) may not be framed by another site.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


def _protect_metrics() -> None:
    get = monitor.Metrics.get
    if getattr(get, "__synthq_protected__", False):
        return
    protected = tornado.web.authenticated(get)
    protected.__synthq_protected__ = True  # type: ignore[attr-defined]
    monitor.Metrics.get = protected  # type: ignore[method-assign]


def _add_security_headers() -> None:
    base = views.BaseHandler.set_default_headers
    if getattr(base, "__synthq_headers__", False):
        return

    def set_default_headers(self: views.BaseHandler) -> None:
        base(self)
        for name, value in SECURITY_HEADERS.items():
            self.set_header(name, value)

    set_default_headers.__synthq_headers__ = True  # type: ignore[attr-defined]
    views.BaseHandler.set_default_headers = set_default_headers  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    _protect_metrics()
    _add_security_headers()
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", "-A", "worker.app", "flower", *argv]
    celery_main()


if __name__ == "__main__":
    main(sys.argv[1:])

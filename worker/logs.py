"""What the worker and beat log: passwords masked, the idle dispatch tick quiet.

* Every record that reaches a handler has the passwords of database and broker
  URLs masked (:func:`synthq.store.db.safe_url`, the one redaction function).
* The dispatch tick runs every second: Celery's "received", "succeeded" and
  beat's "Sending due task" lines about it are DEBUG unless it queued
  something (about 86,000 INFO lines a day otherwise).
* httpx's one INFO line per request is off.
"""

from __future__ import annotations

import logging
from typing import Any

from synthq.store.db import safe_url

__all__ = ["RedactFilter", "QuietHttpxFilter", "QuietTickFilter", "setup"]

#: The task whose routine runs are DEBUG.
TICK = "synthq.dispatch"


class RedactFilter(logging.Filter):
    """Masks URL passwords in the formatted message (and drops its args)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is logging's to report
            return True
        masked = safe_url(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class QuietHttpxFilter(logging.Filter):
    """Drops httpx/httpcore lines below WARNING (one per request), whatever their
    logger's level was set to later."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(("httpx",
                                                                                "httpcore"))


class QuietTickFilter(logging.Filter):
    """Demotes the dispatch tick's routine lines to DEBUG (dropped unless DEBUG is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _routine_tick(record):
            return True
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _routine_tick(record: logging.LogRecord) -> bool:
    args: Any = record.args
    if isinstance(args, dict) and args.get("name") == TICK:
        # "received", or "succeeded ...: 0" (nothing queued)
        return "return_value" not in args or args.get("return_value") in (0, "0", None)
    if isinstance(args, tuple) and len(args) == 2 and args[1] == TICK:
        return "Sending due task" in str(record.msg)
    return False


def setup(root: logging.Logger | None = None) -> None:
    """Install the filters (idempotent): redaction on the root's handlers, quiet ticks on
    Celery's trace, strategy and beat loggers; httpx at WARNING."""
    root = root or logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, RedactFilter) for f in handler.filters):
            handler.addFilter(QuietHttpxFilter())
            handler.addFilter(RedactFilter())
    for name in ("celery.app.trace", "celery.worker.strategy", "celery.beat"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietTickFilter) for f in logger.filters):
            logger.addFilter(QuietTickFilter())
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)

"""Defaults of the settings that code which must start fast reads without pydantic.

:mod:`synthq.config` (pydantic-settings, costly to import) takes these as its
field defaults. The CLI's fast path (:mod:`synthq.cli.fast`) runs only when
none of these settings is in the environment, and then uses the values here:
one definition for both.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DATA_DIR", "WORKER_TIMEOUT", "GPU_HOUR_PRICE", "StatusSettings"]

#: Where the embedded SQLite file (``synthq.db``) and other local state live.
DATA_DIR = "synthq-data"
#: Seconds without a heartbeat after which a worker counts as dead.
WORKER_TIMEOUT = 15.0
#: Dollars per GPU-hour for jobs enqueued without --gpu-hour-price (None: no dollar figures).
GPU_HOUR_PRICE: float | None = None


class StatusSettings(NamedTuple):
    """The settings a status and its cost report read. ``StatusSettings()`` holds the
    defaults (the fast path's case); :meth:`configured` the environment's."""

    worker_timeout: float = WORKER_TIMEOUT
    gpu_hour_price: float | None = GPU_HOUR_PRICE

    @classmethod
    def configured(cls) -> StatusSettings:
        """From :func:`synthq.config.get_settings` (loads pydantic-settings)."""
        from synthq.config import get_settings

        settings = get_settings()
        return cls(worker_timeout=settings.worker_timeout,
                   gpu_hour_price=settings.gpu_hour_price)

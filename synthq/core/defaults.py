"""Defaults of the settings that code which must start fast reads without pydantic.

:mod:`synthq.spec.config` (pydantic-settings, costly to import) takes these as its
field defaults. The CLI's fast path (:mod:`synthq.cli.fast`) runs only when
none of these settings is in the environment, and then uses the values here:
one definition for both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

__all__ = ["DATA_DIR", "WORKER_TIMEOUT", "TRAIN_LEASE", "GPU_HOUR_PRICE", "StatusSettings",
           "store_root"]

#: Where the embedded SQLite file (``synthq.db``) and other local state live.
DATA_DIR = "synthq-data"
#: Seconds without a heartbeat after which a worker counts as dead.
WORKER_TIMEOUT = 15.0
#: Seconds without a heartbeat after which a training run's holder counts as dead.
TRAIN_LEASE = 120.0
#: Dollars per GPU-hour for jobs enqueued without --gpu-hour-price (None: no dollar figures).
GPU_HOUR_PRICE: float | None = None


class StatusSettings(NamedTuple):
    """The settings a status and its cost report read. ``StatusSettings()`` holds the
    defaults (the fast path's case); :func:`synthq.spec.config.status_settings` the
    environment's (this module imports nothing of synthq: config imports it)."""

    worker_timeout: float = WORKER_TIMEOUT
    gpu_hour_price: float | None = GPU_HOUR_PRICE
    #: Where captured hidden states live (None: ``<SYNTHQ_DATA_DIR>/hidden-states``).
    capture_store: str | None = None
    #: Seconds after which a running training run's silent holder counts as dead.
    train_lease: float = TRAIN_LEASE


def store_root(capture_store: str | Path | None, data_dir: str | Path | None = None) -> Path:
    """Where captured hidden states live: ``SYNTHQ_CAPTURE_STORE``, else ``<data
    dir>/hidden-states`` (the data dir: ``data_dir``, else ``SYNTHQ_DATA_DIR`` or
    :data:`DATA_DIR`)."""
    if capture_store:
        return Path(capture_store)
    return Path(data_dir or os.environ.get("SYNTHQ_DATA_DIR") or DATA_DIR) / "hidden-states"

"""PostgreSQL advisory locks: one way to name a lock and take it for a transaction.

The dispatcher computes each server's room under :data:`DISPATCH`, and the
adaptive controller (:mod:`synthq.serving.adaptive`) writes a server's limit under the
same one, so a dispatch never reads a limit half-moved. A capture's claim is
taken under the lock of its capture server (``key("capture:" + url)``, see
:mod:`synthq.queue.capture_states`). The keys are made here, not in any of them, so
that none imports another for it. SQLite needs none: its write transactions
are serialized already (``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["DISPATCH", "key", "hold"]


def key(name: str) -> int:
    """The 64-bit advisory-lock key of ``name`` (its sha256's first 8 bytes, signed)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


#: Serializes dispatchers (room per server, worker capacity) and the limit's writes.
DISPATCH = key("synthq:dispatch")


def hold(session: Session, lock: int | str) -> None:
    """Take the advisory lock ``lock`` (a key, or a name for :func:`key`) until the
    session's transaction ends; nothing on SQLite."""
    from sqlalchemy import text

    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                        {"k": lock if isinstance(lock, int) else key(lock)})

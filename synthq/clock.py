"""The one clock synthq uses: timezone-aware UTC.

Apart from :mod:`synthq.db` (which re-exports it) so that the modules
``synthq status`` loads on its fast path need not import SQLAlchemy.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["utcnow"]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only clock synthq uses)."""
    return datetime.now(UTC)

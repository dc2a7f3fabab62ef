"""Adaptive in-flight limits as the ``servers`` table holds them: where one starts, and
each server's current one.

The controller that moves them (:mod:`synthq.serving.adaptive`) needs SQLAlchemy; what
the dispatcher and ``synthq status`` read of them is here, in plain SQL
(:mod:`synthq.store.sqlread`), so that the CLI's fast path reads them without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from synthq.store.sqlread import Reader, in_list, read_json, reader_of

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["START", "start_limit", "LimitRow", "current_limits"]

#: Where a server's limit starts (within the floor and the cap): every OpenAI-compatible
#: server we know runs 16 requests at once, and slow start doubles it in ~2 call lengths.
START = 16


def start_limit(floor: int, cap: int) -> int:
    """Where a server's limit starts: START, within the floor and the cap."""
    return max(floor, min(cap, START))


class LimitRow(NamedTuple):
    """One server's adaptive limit (the ``servers`` columns synthq.serving.adaptive writes)."""

    url: str
    #: What the dispatcher fills up to.
    limit_target: int
    #: The bound on queued + running now (see synthq.store.models.Server.limit).
    limit: int | None
    limit_reason: str | None
    #: ``[[unix time, limit, tok/s, done/s], ...]``; empty unless asked for.
    limit_history: list[Any]


def current_limits(db: Session | Reader, urls: Sequence[str], *, history: bool = False
                   ) -> dict[str, LimitRow]:
    """The servers among ``urls`` that carry an adaptive limit; ``history``: with their
    history (up to 300 points each: only the status asks for it)."""
    if not urls:
        return {}
    among, params = in_list("url", list(urls))
    rows = reader_of(db).rows(
        f'SELECT url, limit_target, "limit", limit_reason, '
        f'{"limit_history" if history else "NULL"} FROM servers '
        f"WHERE url IN {among} AND limit_target IS NOT NULL", params)
    return {url: LimitRow(url, int(target), None if bound is None else int(bound), reason,
                          list(read_json(past) or []))
            for url, target, bound, reason, past in rows}

"""Active health probes of inference servers, kept in the ``servers`` table.

Every few seconds the scheduler (Celery beat's tick, or the embedded loop)
asks each server of an active job ``GET /health`` (vLLM, SGLang and TGI all
serve it next to ``/v1``). A server that does not answer, or answers 5xx, is
marked unhealthy and the dispatcher sends it nothing until a probe succeeds
again. A 404 means the server has no health endpoint: it counts as healthy,
and the dispatcher's passive check (calls that fail to connect) still applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING

from synthq.store.sqlread import Reader, in_list, read_time, reader_of

if TYPE_CHECKING:
    # Imported where a probe runs: `synthq status` reads only the table (unhealthy(), in
    # plain SQL), and importing httpx, SQLAlchemy and the models costs it most of its
    # start-up CPU.
    import httpx
    from sqlalchemy.orm import Session

__all__ = ["PROBE_EVERY", "health_url", "probe", "probe_due", "unhealthy", "served_models",
           "check_model", "ModelsUnreadable"]

#: Seconds between probes of one server.
PROBE_EVERY = 5.0
#: Seconds a probe may take, in all (its body included).
PROBE_TIMEOUT = 3.0
#: Bytes of a probe's body read, at most: a health answer is empty, a model list small.
#: A body that never ends costs this much, not the process's memory.
HEALTH_BYTES = 64 << 10
MODELS_BYTES = 1 << 20


class ModelsUnreadable(Exception):
    """``/models`` answered 200 with a body cut by the byte cap or the deadline."""


def health_url(base_url: str) -> str:
    """``http://host:8000/v1`` → ``http://host:8000/health``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/health"


def probe(base_url: str, client: httpx.Client) -> str | None:
    """None when the server is healthy, else what went wrong."""
    import httpx

    from synthq.core.netio import get_bounded

    try:
        # The status is the answer; a body that never ends is cut, not read.
        body = get_bounded(client, health_url(base_url), max_bytes=HEALTH_BYTES,
                           seconds=PROBE_TIMEOUT)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
    if body.status >= 500:
        return f"GET /health answered HTTP {body.status}"
    return None


def served_models(base_url: str, client: httpx.Client) -> list[str] | None:
    """The model ids ``GET {base_url}/models`` lists; None when the server has no such list.

    Raises :class:`httpx.HTTPError` when the server cannot be reached, and
    :class:`ModelsUnreadable` when its list passes MODELS_BYTES or PROBE_TIMEOUT.
    """
    import json

    from synthq.core.netio import get_bounded

    body = get_bounded(client, f"{base_url.rstrip('/')}/models", max_bytes=MODELS_BYTES,
                       seconds=PROBE_TIMEOUT)
    if body.status != 200:
        return None
    if not body.complete:
        raise ModelsUnreadable(f"its /models answer did not end within {MODELS_BYTES:,} bytes "
                               f"and {PROBE_TIMEOUT:g} s")
    try:
        data = json.loads(body.data).get("data")
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError, TypeError):
        return None


def check_model(servers: Iterable[str], model: str, *,
                client: httpx.Client | None = None) -> list[str]:
    """Ask each server which models it serves (at enqueue, before any sample is sent).

    A server that lists its models but not ``model`` is a :class:`UserError`
    naming the ones it serves. A server that cannot be reached may come up
    later, and one whose list cannot be read is not checked: each is a warning,
    returned as a line to print.
    """
    import httpx

    from synthq.core.errors import UserError

    client = client or _shared_client()
    warnings = []
    for url in servers:
        try:
            models = served_models(url, client)
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"[:300]
            warnings.append(f"server {url} cannot be reached ({reason}); its samples wait "
                            "until it answers")
            continue
        except ModelsUnreadable as exc:
            warnings.append(f"server {url}: {exc}; model {model!r} is not checked")
            continue
        if models is None and _without_v1(url, client):
            raise UserError(f"server {url} answers 404 for /models, and {url.rstrip('/')}/v1 "
                            f"serves models: did you mean --server {url.rstrip('/')}/v1 ? "
                            "(the URL is the OpenAI base, ending in /v1)")
        if models is not None and model not in models:
            served = ", ".join(repr(m) for m in models) or "none"
            raise UserError(f"server {url} does not serve model {model!r}; it serves: {served}")
    return warnings


def _without_v1(url: str, client: httpx.Client) -> bool:
    """True when ``url`` lacks the ``/v1`` the server's OpenAI routes live under."""
    import httpx

    from synthq.core.netio import get_bounded

    if url.rstrip("/").endswith("/v1"):
        return False
    try:
        if get_bounded(client, f"{url.rstrip('/')}/models", max_bytes=HEALTH_BYTES,
                       seconds=PROBE_TIMEOUT).status != 404:
            return False
        return served_models(f"{url.rstrip('/')}/v1", client) is not None
    except (httpx.HTTPError, ModelsUnreadable):
        return False


_client: httpx.Client | None = None


def _shared_client() -> httpx.Client:
    """One client per process: making one builds an SSL context (milliseconds of CPU)."""
    import httpx

    global _client
    if _client is None:
        _client = httpx.Client()
    return _client


def probe_due(urls: Iterable[str], *, client: httpx.Client | None = None) -> dict[str, bool]:
    """Probe the servers not probed for PROBE_EVERY seconds; returns url → healthy."""
    from sqlalchemy import select

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Server

    urls = sorted(set(urls))
    if not urls:
        return {}
    cutoff = utcnow() - timedelta(seconds=PROBE_EVERY)
    with session_scope() as s:
        fresh = set(s.scalars(select(Server.url).where(Server.url.in_(urls),
                                                       Server.checked_at >= cutoff)))
    due = [u for u in urls if u not in fresh]
    if not due:
        return {}
    client = client or _shared_client()
    results = {url: probe(url, client) for url in due}
    with session_scope() as s:
        for url, error in results.items():
            _record(s, url, error)
    return {url: error is None for url, error in results.items()}


def _record(session: Session, url: str, error: str | None) -> None:
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    from synthq.store.db import utcnow
    from synthq.store.models import Server

    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    now = utcnow()
    stmt = insert(Server).values(url=url, healthy=error is None, checked_at=now,
                                 failures=0 if error is None else 1, last_error=error)
    stmt = stmt.on_conflict_do_update(index_elements=["url"], set_={
        "healthy": error is None, "checked_at": now, "last_error": error,
        "failures": 0 if error is None else Server.failures + 1})
    session.execute(stmt)


def unhealthy(db: Session | Reader, urls: Iterable[str]) -> dict[str, str | None]:
    """Servers among ``urls`` whose last probe failed: since when (local time), and why."""
    among, params = in_list("url", list(urls))
    rows = reader_of(db).rows("SELECT url, last_error, checked_at, failures FROM servers "
                              f"WHERE url IN {among} AND NOT healthy", params)
    result: dict[str, str | None] = {}
    for url, error, checked_at, failures in rows:
        # Probes run every PROBE_EVERY seconds: the first failure was that long per failure ago.
        since = read_time(checked_at) - timedelta(seconds=PROBE_EVERY * max(0, (failures or 1) - 1))
        result[url] = f"failing since {since.astimezone():%H:%M:%S}: {error or 'no answer'}"
    return result

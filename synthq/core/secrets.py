"""Secrets: placeholders refused at start-up, and passwords masked wherever a URL is shown.

Placeholder secrets: values copied unchanged from ``.env.example`` are refused.

``docker compose config`` cannot judge a value, so each service checks its own
at start-up: the settings refuse a database or broker URL whose password is a
placeholder, the API refuses a placeholder token, ``synthq flower`` a
placeholder basic-auth password.

Masking: :func:`safe_url` is the one function that hides the password of a URL
(``http://user:***@host``); every place a URL leaves the process (the API, the
job page, ``/metrics``, ``synthq status``/``sample`` and their ``--json``, the
export manifest, log lines, error messages) shows it through this function, or
through :func:`safe_keys` for a mapping keyed by URL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar
from urllib.parse import urlsplit

__all__ = ["PLACEHOLDER", "is_placeholder", "url_password", "check_secret", "check_url",
           "safe_url", "safe_keys", "ServerPattern", "parse_server_patterns", "server_allowed",
           "refused_servers"]

V = TypeVar("V")

#: ``scheme://user:password@``: what :func:`safe_url` replaces (with ``scheme://user:***@``).
_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]*@", re.I)


def safe_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _PASSWORD.sub(r"\1***@", text)


def safe_keys(mapping: Mapping[str, V]) -> dict[str, V]:
    """``mapping`` (keyed by server URL) with each key through :func:`safe_url`."""
    return {safe_url(k): v for k, v in mapping.items()}

#: Every secret in ``.env.example`` starts with this.
PLACEHOLDER = "change-me"


def is_placeholder(value: str | None) -> bool:
    """True for a value left as ``.env.example`` has it (``change-me…``)."""
    return bool(value) and value.strip().lower().startswith(PLACEHOLDER)  # type: ignore[union-attr]


def url_password(url: str) -> str | None:
    """The password in ``scheme://user:password@host/…``, or None."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def check_secret(name: str, value: str | None, *, required: bool = True) -> None:
    """Raise ValueError if ``value`` is missing (when required) or a placeholder.

    The message names the setting, never the value.
    """
    if not value:
        if required:
            raise ValueError(f"{name} is not set")
        return
    if is_placeholder(value):
        raise ValueError(f"{name} is still the placeholder from .env.example: set a real value")


def check_url(name: str, url: str) -> None:
    """Raise ValueError if ``url`` carries a placeholder password."""
    if is_placeholder(url_password(url)):
        raise ValueError(f"the password in {name} is still the placeholder from .env.example: "
                         "set a real one in .env")


# -- who may be sent work (and the API key) ----------------------------------------------

#: One allowed server: a host pattern and a port pattern (None: any port).
ServerPattern = tuple[str, str | None]


def parse_server_patterns(text: str) -> tuple[ServerPattern, ...]:
    """``SYNTHQ_ALLOWED_SERVERS`` (``vllm-*.internal:8000,10.0.0.*``) as patterns.

    Each entry is ``host`` or ``host:port``. In a host, ``*`` stands for any
    characters *within one label* (between dots) and ``?`` for one character, as
    in a TLS wildcard name, so ``10.0.0.*`` matches ``10.0.0.7`` but not
    ``10.0.0.7.attacker.example``; a port is digits or ``*``, and an entry without
    one allows every port. Raises ValueError naming a malformed entry.
    """
    patterns: list[ServerPattern] = []
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        host, port = entry, None
        if entry.startswith("["):  # [IPv6]:port
            host, close, rest = entry[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else None
            if not close or (rest and port is None):
                host = ""  # malformed
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        if not host or "/" in host or "@" in host or (port is not None and not (
                port == "*" or port.isdigit())):
            raise ValueError(f"SYNTHQ_ALLOWED_SERVERS: {raw.strip()!r} is not a host or "
                             "host:port pattern (e.g. vllm-*.internal:8000 or 10.0.0.*)")
        patterns.append((host, port))
    return tuple(patterns)


def _host_regex(pattern: str) -> re.Pattern[str]:
    parts = {"*": "[^.]*", "?": "[^.]"}
    return re.compile("".join(parts.get(c) or re.escape(c) for c in pattern))


def server_allowed(url: str, patterns: tuple[ServerPattern, ...]) -> bool:
    """Whether ``url``'s host (and port) matches one of ``patterns``."""
    try:
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        return False
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme)
    for host_pattern, port_pattern in patterns:
        if not _host_regex(host_pattern).fullmatch(host):
            continue
        if port_pattern in (None, "*") or str(port) == port_pattern:
            return True
    return False


def refused_servers(urls: list[str], patterns: tuple[ServerPattern, ...]) -> str | None:
    """Why the API refuses a job naming ``urls`` (one line), or None when it may.

    The workers send ``SYNTHQ_API_KEY`` to a job's servers and the API probes them,
    so a user of the API may name only the hosts ``SYNTHQ_ALLOWED_SERVERS`` lists;
    with the setting empty the API accepts no server URL (the CLI, run by whoever
    holds the settings, is not limited).
    """
    if not patterns:
        return ("the API accepts no server URL until SYNTHQ_ALLOWED_SERVERS lists the hosts "
                "its users may send work (and SYNTHQ_API_KEY) to, e.g. vllm-*.internal:8000")
    for url in urls:
        if not server_allowed(url, patterns):
            return (f"server {safe_url(url)} is not in SYNTHQ_ALLOWED_SERVERS (the hosts the "
                    "API may send work and SYNTHQ_API_KEY to)")
    return None

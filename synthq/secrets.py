"""Placeholder secrets: values copied unchanged from ``.env.example`` are refused.

``docker compose config`` cannot judge a value, so each service checks its own
at start-up: the settings refuse a database or broker URL whose password is a
placeholder, the API refuses a placeholder token, ``synthq flower`` a
placeholder basic-auth password.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["PLACEHOLDER", "is_placeholder", "url_password", "check_secret", "check_url"]

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

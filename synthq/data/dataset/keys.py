"""Content keys: what makes two rows the same sample of a job (``jobs.key_version``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from synthq.data.dataset.rows import KEY_VERSION


def content_key(messages: list[dict[str, Any]], settings: Mapping[str, Any],
                key_version: int = KEY_VERSION, tools: Mapping[str, Any] | None = None) -> str:
    """SHA-256 hex digest identifying a prompt under given generation settings.

    The digest is taken over canonical JSON (sorted keys, compact separators,
    no ASCII escaping), so key order in ``settings`` does not matter. From key
    version 2 on the version is part of it; version 1 keys are the digest of
    ``{"messages", "settings"}`` alone, as they were.
    """
    body: dict[str, Any] = {"messages": messages, "settings": dict(settings)}
    if key_version != 1:
        body["key_version"] = key_version
    if tools:  # only rows that declare tools: every other key stays as it was
        body["tools"] = dict(tools)
    # ContentKeys builds the same text from parts: keep the two in step.
    canonical = json.dumps(
        body,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return _sha256(canonical)


#: The canonical JSON of :func:`content_key`.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ContentKeys:
    """:func:`content_key` for many rows under the same settings, and the prompt's JSON.

    The same digests, built from parts: canonical JSON writes an object's keys
    in sorted order (``key_version`` < ``messages`` < ``settings`` < ``tools``),
    so the text :func:`content_key` hashes is a head, the messages' own
    canonical JSON, then the settings (encoded once here) and the tools. The
    messages' JSON is returned too: enqueue stores it as the prompt instead of
    encoding the messages a second time.
    """

    def __init__(self, settings: Mapping[str, Any], key_version: int = KEY_VERSION) -> None:
        self._settings_json = _CANONICAL.encode(dict(settings))
        head = '{"messages":' if key_version == 1 else \
            f'{{"key_version":{_CANONICAL.encode(key_version)},"messages":'
        self._head = hashlib.sha256(head.encode("utf-8"))
        self._tail = _utf8(f',"settings":{self._settings_json}}}')

    def key(self, messages: list[dict[str, Any]],
            tools: Mapping[str, Any] | None = None) -> tuple[str, bytes]:
        """``(content_key(messages, settings, key_version, tools), messages as canonical
        JSON in UTF-8)``."""
        text = _utf8(_CANONICAL.encode(messages))
        digest = self._head.copy()
        digest.update(text)
        if tools:
            digest.update(_utf8(f',"settings":{self._settings_json},"tools":'
                                f'{_CANONICAL.encode(dict(tools))}}}'))
        else:
            digest.update(self._tail)
        return digest.hexdigest(), text


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def raw_key(raw: str) -> str:
    """SHA-256 hex digest identifying a skipped row by its raw text."""
    return _sha256("skipped:" + raw)


def _sha256(text: str) -> str:
    """Hex SHA-256 of ``text`` as UTF-8 (lone surrogates passed through)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------


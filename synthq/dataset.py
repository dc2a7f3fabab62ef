"""Reading dataset rows and normalising them into chat prompts.

A *source* is a local ``.jsonl`` / ``.json`` (JSON lines, optionally
gzip-compressed) or ``.parquet`` file, a directory of such files, or a
Hugging Face dataset id (``name`` or ``name:split``).  Every row becomes a
:class:`Row`: either a prompt in OpenAI chat form, or a skipped row carrying a
short human-readable reason and a preview of the raw text.

Three row forms are understood (see :func:`normalize`):

* OpenAI ``messages``: ``[{"role": ..., "content": ...}, ...]``
* ShareGPT ``conversations`` (or ``conversation``):
  ``[{"from": ..., "value": ...}, ...]``
* a plain ``prompt`` string, with an optional ``system`` string.

The prompt is the conversation up to and including its last user turn: the
last turn the model must answer. Assistant turns after it are dropped (they are
what the inference server regenerates); a row that ends in a user turn is sent
whole. A tool result is also a turn the model must answer: a prompt may end
with a ``tool`` message.

Tool conversations come in OpenAI form: the row's ``tools`` (and optional
``tool_choice``), assistant messages with ``tool_calls``, and ``tool``
messages with ``tool_call_id``; they are kept on :attr:`Row.tools` and in the
messages. With ``regenerate="all"`` the whole conversation is kept (every
assistant turn is regenerated on the regenerated history, see
:mod:`synthq.turns`).

That rule is *key version* 2 (:data:`KEY_VERSION`). Jobs created before it,
key version 1, cut the prompt before the last assistant turn instead, which
dropped a trailing user question; they keep that rule, so that enqueueing the
same data into such a job again adds nothing rather than a second copy of
every multi-turn row (see :func:`normalize` and :func:`content_key`).

A row's own id (its ``id``, ``uuid``, ``conversation_id`` or ``sample_id``
field, or the one field the user names) is kept as :attr:`Row.source_id`, so
generated data can be joined back to its source.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from synthq.jobspec import BY_NAME

__all__ = [
    "ID_FIELDS",
    "KEY_VERSION",
    "MAX_ROW_CHARS",
    "RAW_PREVIEW_CHARS",
    "DatasetError",
    "InvalidRow",
    "Row",
    "content_key",
    "ContentKeys",
    "iter_rows",
    "normalize",
    "raw_key",
    "REGENERATE_MODES",
    "row_tools",
    "source_id",
    "unread_files",
]

MAX_ROW_CHARS = 200_000
"""Default limit on the total characters of a prompt's message contents."""

RAW_PREVIEW_CHARS = 2_000
"""How much of a skipped row's raw text is kept in :attr:`Row.raw`."""

PARQUET_BATCH_SIZE = 1024

MAX_LINE_BYTES = 16 << 20
"""A JSONL line longer than this is a skipped row, read through without holding it."""

MAX_ARRAY_BYTES = 64 << 20
"""The largest ``.json`` file holding one array (it is parsed whole)."""

KEY_VERSION = 2
"""The prompt rule and content-key form of new jobs (``jobs.key_version``).

1: the prompt ends before the last assistant turn; key over (messages, settings).
2: the prompt ends with the last turn the model must answer; the key also
covers the version, so no key of version 2 equals one of version 1.
"""

ID_FIELDS = ("id", "uuid", "conversation_id", "sample_id")
"""Fields holding a row's own id, in order of precedence (``--id-field`` overrides)."""

# Roles whose turn the model answers: the prompt ends with the last of them.
_ANSWERED_ROLES = frozenset({"user", "tool"})

_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_PARQUET_SUFFIXES = (".parquet",)
_SUPPORTED_SUFFIXES = _JSONL_SUFFIXES + _PARQUET_SUFFIXES

# Role names accepted in either key style, mapped to OpenAI roles.
_ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
}

#: ``--regenerate`` modes: the last assistant turn, or every one on regenerated history.
REGENERATE_MODES = BY_NAME["regenerate"].choices  # declared in synthq.jobspec

# Conversation-list fields, in order of precedence.
_LIST_FIELDS = ("messages", "conversations", "conversation")

_EXTENSION_RE = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")


class DatasetError(Exception):
    """The dataset source cannot be opened or read at all."""


class InvalidRow(ValueError):
    """A row cannot be turned into a prompt; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which
# was a tenth of enqueue's time per row. Treat a Row as read-only all the same.
@dataclass(slots=True)
class Row:
    """One dataset row: a prompt, or a skipped row with its reason.

    ``index`` is the row's 0-based position in the whole source (blank lines
    do not count).  Exactly one of ``messages`` and ``skip_reason`` is set;
    ``raw`` holds the start of a skipped row's text so a user can inspect it.
    ``source_id`` is the row's own id as text (see :data:`ID_FIELDS`), skipped
    rows included; None when the row has none. ``where`` says where a person
    finds the row: ``line 7`` (1-based) in a text file, ``row 7`` in Parquet
    or a Hugging Face dataset, prefixed by the file's name in a directory.
    """

    index: int
    messages: list[dict[str, str]] | None
    skip_reason: str | None = None
    raw: str | None = None
    source_id: str | None = None
    where: str = dataclasses.field(default="", compare=False)
    #: The row's ``{"tools": [...], "tool_choice": ...}`` when it declares tools.
    tools: dict[str, Any] | None = None

    @property
    def skipped(self) -> bool:
        """True when the row is malformed and has no prompt."""
        return self.skip_reason is not None


# --------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------


def normalize(obj: Mapping[str, Any], *, max_chars: int = MAX_ROW_CHARS,
              key_version: int = KEY_VERSION, regenerate: str = "last") -> list[dict[str, Any]]:
    """Turn one row object into an OpenAI-style prompt.

    Returns a fresh list of ``{"role", "content"}`` dicts (assistant messages
    may carry ``tool_calls``, tool messages ``tool_call_id``): the
    conversation up to and including its last user or tool turn (``key_version``
    1: up to, not including, its last assistant turn; ``regenerate="all"``: the
    whole conversation, whose assistant turns are all regenerated). Raises
    :class:`InvalidRow` with a short reason otherwise.
    """
    if not _is_mapping(obj):
        raise InvalidRow("row is not a JSON object")
    conversation = _extract_conversation(obj)
    if not conversation:
        raise InvalidRow("empty conversation")
    _check_tool_pairs(conversation)
    if regenerate == "all":
        _check_prompt(conversation, max_chars=max_chars, whole=True)
        from synthq.turns import turn_positions

        if not turn_positions(conversation):
            raise InvalidRow("no assistant turn to regenerate")
        return conversation
    if key_version == 1:
        prompt = _trim_last_answer(conversation)
    else:
        prompt = _through_last_question(conversation)
    _check_prompt(prompt, max_chars=max_chars)
    return prompt


def _is_mapping(obj: Any) -> bool:
    """isinstance(obj, Mapping), quicker for the dict that nearly every row is."""
    return type(obj) is dict or isinstance(obj, Mapping)


def _present(obj: Mapping[str, Any], key: str) -> bool:
    """True when ``key`` is in ``obj`` with a non-null value.

    Nulls are treated as absent because columnar sources (Parquet, Hugging
    Face) fill columns that a row does not use with ``None``.
    """
    return obj.get(key) is not None


def _extract_conversation(obj: Mapping[str, Any]) -> list[dict[str, str]]:
    """Find the row's conversation field and parse it into OpenAI messages."""
    for field in _LIST_FIELDS:
        items = obj.get(field)  # _present, inline: this runs for every row
        if items is not None:
            if not isinstance(items, (list, tuple)):
                raise InvalidRow(f"{field} is not a list")
            return [_parse_message(item, number) for number, item in enumerate(items, 1)]
    if _present(obj, "prompt"):
        return _prompt_form(obj)
    raise InvalidRow("no messages, conversations or prompt field")


def _prompt_form(obj: Mapping[str, Any]) -> list[dict[str, str]]:
    """Build messages from a plain ``prompt`` (and optional ``system``) field."""
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise InvalidRow("prompt is not a string")
    messages: list[dict[str, str]] = []
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise InvalidRow("system is not a string")
        if system.strip():
            messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


def _pick(item: Mapping[str, Any], keys: tuple[str, str]) -> tuple[bool, Any]:
    """Return ``(found, value)`` for the first of ``keys`` with a non-null value.

    ``found`` is also true when a key exists but is null everywhere, so that
    callers can tell "missing" from "null".
    """
    for key in keys:
        if item.get(key) is not None:
            return True, item[key]
    return any(key in item for key in keys), None


def row_tools(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The row's ``{"tools": [...], "tool_choice": ...}``, or None when it declares none.

    Raises :class:`InvalidRow` for tools that are not a list of function objects.
    """
    tools = obj.get("tools") if _is_mapping(obj) else None
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        return None
    if isinstance(tools, str):  # Parquet / HF columns often hold it as JSON text
        try:
            tools = json.loads(tools)
        except ValueError:
            raise InvalidRow("tools is not a list") from None
    if not isinstance(tools, (list, tuple)):
        raise InvalidRow("tools is not a list")
    for number, tool in enumerate(tools, 1):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRow(f"tool {number} has no function name")
    found: dict[str, Any] = {"tools": [dict(t) for t in tools]}
    if obj.get("tool_choice") is not None:
        found["tool_choice"] = obj["tool_choice"]
    return found


def _parse_tool_calls(value: Any, number: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked: ``[{id, type, function}, ...]``."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRow(f"message {number} tool_calls is not a list")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRow(f"message {number} has a tool call without a function name")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, (str, Mapping)):
            raise InvalidRow(f"message {number} tool call arguments are not text or an object")
        calls.append({"id": str(call.get("id") or ""), "type": call.get("type") or "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _check_tool_pairs(conversation: list[dict[str, Any]]) -> None:
    """Every tool message follows an assistant turn with tool calls (or another tool message)."""
    for number, message in enumerate(conversation, 1):
        if message["role"] != "tool":
            continue
        before = conversation[number - 2] if number > 1 else None
        if before is None or not (before["role"] == "tool" or before.get("tool_calls")):
            raise InvalidRow(f"message {number} is a tool result without a tool call before it")


def _parse_message(item: Any, number: int) -> dict[str, Any]:
    """Parse one message in either role/content or from/value style."""
    if type(item) is dict:
        # The common case, a plain text turn, without the checks below (the result
        # is the same): the first non-null of role/from and of content/value are
        # strings, the role is known, and there is no tool in play.
        role = item.get("role")
        if role is None:
            role = item.get("from")
        content = item.get("content")
        if content is None:
            content = item.get("value")
        if type(role) is str and type(content) is str and "tool_calls" not in item:
            canonical = _ROLE_ALIASES.get(role) or _ROLE_ALIASES.get(role.strip().lower())
            if canonical is not None and canonical != "tool":
                return {"role": canonical, "content": content}
    if not isinstance(item, Mapping):
        raise InvalidRow(f"message {number} is not an object")
    has_role, role = _pick(item, ("role", "from"))
    if not has_role or role is None:
        raise InvalidRow(f"message {number} has no role")
    if not isinstance(role, str):
        raise InvalidRow(f"message {number} role is not a string")
    canonical = _ROLE_ALIASES.get(role.strip().lower())
    if canonical is None:
        raise InvalidRow(f"unknown role {role!r} in message {number}")
    has_content, content = _pick(item, ("content", "value"))
    tool_calls = item.get("tool_calls") if canonical == "assistant" else None
    if tool_calls is not None and not (isinstance(tool_calls, (list, tuple)) and
                                       not tool_calls):
        message: dict[str, Any] = {"role": canonical, "content": content or ""}
        if content is not None and not isinstance(content, str):
            raise InvalidRow(f"message {number} content is not a string")
        message["tool_calls"] = _parse_tool_calls(tool_calls, number)
        return message
    if not has_content:
        raise InvalidRow(f"message {number} has no content")
    if not isinstance(content, str):
        raise InvalidRow(f"message {number} content is not a string")
    if canonical == "tool":
        message = {"role": "tool", "content": content}
        for key in ("tool_call_id", "name"):
            if isinstance(item.get(key), str):
                message[key] = item[key]
        return message
    return {"role": canonical, "content": content}


def _through_last_question(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to and including the last turn the model must answer.

    Without such a turn the result is empty (the row has no user turn).
    """
    for position in range(len(conversation) - 1, -1, -1):
        if conversation[position]["role"] in _ANSWERED_ROLES:
            return conversation[: position + 1]
    return []


def _trim_last_answer(conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """Key version 1: drop the last assistant turn and everything after it.

    Without an assistant turn the whole conversation is the prompt.
    """
    for position in range(len(conversation) - 1, -1, -1):
        if conversation[position]["role"] == "assistant":
            return conversation[:position]
    return conversation


def _check_prompt(prompt: list[dict[str, Any]], *, max_chars: int, whole: bool = False) -> None:
    """Reject prompts that a chat server could not sensibly answer (``whole``: a
    conversation whose every assistant turn is regenerated)."""
    if not any(message["role"] == "user" for message in prompt):
        raise InvalidRow("no user turn")
    if whole:
        first_user = next(i for i, m in enumerate(prompt) if m["role"] == "user")
        if any(m["role"] == "assistant" for m in prompt[:first_user]):
            raise InvalidRow("an assistant turn comes before the first user turn")
    elif prompt[-1]["role"] not in _ANSWERED_ROLES:
        raise InvalidRow("prompt does not end with a user turn")
    total = 0
    for number, message in enumerate(prompt, 1):
        content = message["content"]
        if message["role"] == "user" and not content.strip():
            raise InvalidRow(f"message {number} is empty")
        if not _is_encodable(content):
            raise InvalidRow(f"message {number} content is not valid Unicode")
        total += len(content)
    if total > max_chars:
        raise InvalidRow(f"row has {total} characters, over the limit of {max_chars}")


def _check_storable(value: Any, what: str) -> None:
    """Refuse text a database cannot store: a NUL character (PostgreSQL's text and JSONB
    refuse ``\\u0000``) or a lone surrogate (not UTF-8), anywhere in ``value``."""
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidRow(f"{what} holds a NUL character (\\u0000), which cannot be stored")
        if not _is_encodable(value):
            raise InvalidRow(f"{what} holds text that is not valid Unicode (a lone surrogate)")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_storable(key, what)
            _check_storable(item, what)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_storable(item, what)


def storable(text: str) -> str:
    """``text`` as a database stores it: NUL written as ``\\u0000``, lone surrogates as
    ``\\udXXX`` escapes (a skipped row's preview, ids, file names)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\u0000")
    if not _is_encodable(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _is_encodable(text: str) -> bool:
    """True unless ``text`` holds lone surrogates (from ``\\ud83d``-style escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------


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


def iter_rows(source: str, *, max_chars: int = MAX_ROW_CHARS, id_field: str | None = None,
              key_version: int = KEY_VERSION, regenerate: str = "last") -> Iterator[Row]:
    """Yield every row of ``source`` as a :class:`Row`, in order.

    ``source`` may be a JSON-lines file (``.jsonl``, ``.json``, optionally
    ``.gz``), a ``.parquet`` file, a directory of such files (read in sorted
    order, indices continuing), or a Hugging Face dataset id (``name`` or
    ``name:split``; needs the ``datasets`` package).  Problems with the source
    itself raise :class:`DatasetError` immediately, before iteration starts;
    problems with single rows become skipped rows.

    ``id_field`` names the field holding each row's own id; without it, the
    first of :data:`ID_FIELDS` that a row has. ``key_version`` selects the
    prompt rule (see :func:`normalize`).
    """
    if id_field is not None and not id_field.strip():
        raise DatasetError("--id-field is empty")
    fields = (id_field,) if id_field is not None else ID_FIELDS
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        files = _list_data_files(path)
        for file in files:
            _check_content(file)
        records = _iter_directory(path, files)
    elif path.exists():
        _check_supported(path)
        _check_content(path)
        records = _iter_file(path)
    elif _looks_like_path(source):
        raise DatasetError(f"no such file: {source}")
    else:
        records = _iter_hf(source)
    return _rows_from_objects(records, max_chars, fields, key_version, regenerate)


# A parsed record: either an object to normalise or an early skip reason,
# together with the raw text to show if the row is skipped.
# The last element says where the row is (``line 3``, ``row 3``).
_Record = tuple[Any, str | None, str | None, str]

#: Bytes read from the start of a file to tell a dataset from something else.
SNIFF_BYTES = 4096


def _check_content(path: Path) -> None:
    """Refuse a file whose first bytes are not what its suffix promises.

    A binary file named ``.jsonl`` would otherwise become a job of hundreds of
    skipped rows.
    """
    try:
        with _open_binary(path) as handle:
            head = handle.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {path}: {_os_reason(exc)}") from exc
    if _suffix(path) in _PARQUET_SUFFIXES:
        if head[:4] != b"PAR1":
            raise DatasetError(f"{path} is not a JSONL/JSON/Parquet file (no Parquet header)")
        return
    # Not final: a character cut at the 4 KiB mark is fine. A stray bad line is a
    # skipped row; a NUL byte, or a tenth of the text undecodable, is not a text file.
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=False)
    bad = sum(1 for c in text if c == "\ufffd" or c in _BINARY_CHARS)
    if "\0" in text or bad > len(text) / 10:
        raise DatasetError(f"{path} is not a JSONL/JSON/Parquet file (its first "
                           f"{SNIFF_BYTES // 1024} KiB are not text)")


#: Control characters that never occur in a JSON text file.
_BINARY_CHARS = frozenset(chr(c) for c in range(32) if chr(c) not in "\t\n\r\f")


def _os_reason(exc: BaseException) -> str:
    """``Permission denied`` rather than ``[Errno 13] Permission denied: '/x'``."""
    return getattr(exc, "strerror", None) or str(exc)


def source_id(obj: Any, fields: tuple[str, ...] = ID_FIELDS) -> str | None:
    """The row's own id as text: the first of ``fields`` it has, non-empty.

    Strings are kept as they are, numbers become their decimal text, anything
    else its compact JSON. None when the row has none of the fields.
    """
    if not _is_mapping(obj):
        return None
    for name in fields:
        value = obj.get(name)
        if value is None or value == "" or isinstance(value, bool):
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, int | float):
            return str(value)
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(value)
    return None


def _rows_from_objects(records: Iterable[_Record], max_chars: int,
                       fields: tuple[str, ...] = ID_FIELDS,
                       key_version: int = KEY_VERSION, regenerate: str = "last") -> Iterator[Row]:
    """Number records and normalise them into :class:`Row` objects."""
    for index, (obj, skip_reason, raw, where) in enumerate(records):
        sid = source_id(obj, fields) if skip_reason is None else None
        if skip_reason is None:
            try:
                messages = normalize(obj, max_chars=max_chars, key_version=key_version,
                                     regenerate=regenerate)
                tools = row_tools(obj)
                _check_storable(messages, "the conversation")
                _check_storable(tools, "tools")
            except InvalidRow as exc:
                skip_reason = exc.reason
            else:
                yield Row(index=index, messages=messages, skip_reason=None, raw=None,
                          source_id=storable(sid) if sid is not None else None, where=where,
                          tools=tools)
                continue
        if raw is None:
            raw = _preview(obj)
        yield Row(index=index, messages=None, skip_reason=skip_reason,
                  raw=storable(raw[:RAW_PREVIEW_CHARS]),
                  source_id=storable(sid) if sid is not None else None, where=storable(where))


def _preview(obj: Any) -> str:
    """JSON text of a non-JSONL row, for showing a skipped row to a user."""
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(obj)


def _looks_like_path(source: str) -> bool:
    """True when ``source`` is clearly meant as a local path, not a dataset id."""
    if source.startswith((".", "/", "~", "\\")):
        return True
    name = source.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return bool(_EXTENSION_RE.search(name))


def _suffix(path: Path) -> str:
    """The lower-cased data suffix of ``path`` (``.jsonl.gz`` counts as one)."""
    name = path.name.lower()
    for suffix in sorted(_SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def _check_supported(path: Path) -> None:
    """Raise :class:`DatasetError` for a file type we cannot read."""
    if _suffix(path) not in _SUPPORTED_SUFFIXES:
        raise DatasetError(
            f"unsupported file type: {path} (expected .jsonl, .json, .jsonl.gz or .parquet)"
        )
    if _suffix(path) in _PARQUET_SUFFIXES and importlib.util.find_spec("pyarrow") is None:
        raise DatasetError(f"cannot read {path}: the 'pyarrow' package is not installed")


def _list_data_files(directory: Path) -> list[Path]:
    """All supported data files under ``directory``, sorted by relative path.

    Hidden files and directories (names starting with ``.``) are ignored.
    """
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_file() and _suffix(path) in _SUPPORTED_SUFFIXES:
            found.append(path)
    if not found:
        raise DatasetError(
            f"no .jsonl, .json, .jsonl.gz or .parquet files in directory: {directory}"
        )
    found.sort(key=lambda p: p.relative_to(directory).as_posix())
    for path in found:
        _check_supported(path)
    return found


def unread_files(directory: Path) -> list[str]:
    """Files in ``directory`` (not hidden) that a dataset folder skips: not a data suffix."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and _suffix(p) not in _SUPPORTED_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def _iter_directory(directory: Path, files: list[Path]) -> Iterator[_Record]:
    """Records of every file in ``files``, one file after another."""
    for path in files:
        name = path.relative_to(directory).as_posix()
        for obj, skip_reason, raw, where in _iter_file(path):
            yield obj, skip_reason, raw, f"{name} {where}"


def _iter_file(path: Path) -> Iterator[_Record]:
    """Records of one supported data file."""
    if _suffix(path) in _PARQUET_SUFFIXES:
        yield from _iter_parquet(path)
    else:
        yield from _iter_jsonl(path)


def _open_binary(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading, decompressing ``.gz`` files."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _iter_jsonl(path: Path) -> Iterator[_Record]:
    """Stream a JSON-lines file line by line, skipping blank lines.

    A ``.json`` file whose first character is ``[`` is read as one JSON array
    instead (that form cannot be streamed, so it is loaded whole).
    """
    try:
        with _open_binary(path) as handle:
            if _suffix(path) in (".json", ".json.gz") and _starts_with_array(handle):
                yield from _iter_json_array(handle)
                return
            for number, raw_line in enumerate(_bounded_lines(handle), 1):
                if isinstance(raw_line, _LongLine):
                    yield (None, f"line is over {MAX_LINE_BYTES >> 20} MiB",
                           raw_line.head.decode("utf-8", errors="replace"), f"line {number}")
                    continue
                if number == 1:
                    raw_line = raw_line.removeprefix(b"\xef\xbb\xbf")
                if not raw_line.strip():
                    continue
                yield (*_parse_line(raw_line), f"line {number}")
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _LongLine:
    """A line over :data:`MAX_LINE_BYTES`: only its start is kept."""

    head: bytes


def _bounded_lines(handle: BinaryIO) -> Iterator[bytes | _LongLine]:
    """The file's lines; one over :data:`MAX_LINE_BYTES` is read through, never held whole.

    A 300 MB single line (or a gzip that inflates to one) would otherwise take
    several times its size in memory to split, decode and parse.
    """
    while line := handle.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        head = line[:RAW_PREVIEW_CHARS]
        del line
        while (rest := handle.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield _LongLine(head)


def _starts_with_array(handle: BinaryIO) -> bool:
    """Peek whether a binary stream's first non-blank byte is ``[``; rewinds."""
    head = handle.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    handle.seek(0)
    return head.startswith(b"[")


def _iter_json_array(handle: BinaryIO) -> Iterator[_Record]:
    """Records of a file holding a single JSON array of row objects."""
    data = handle.read(MAX_ARRAY_BYTES + 1)
    if len(data) > MAX_ARRAY_BYTES:
        raise DatasetError(f"a JSON array file over {MAX_ARRAY_BYTES >> 20} MiB cannot be read "
                           "(it is loaded whole); write it as JSON lines, one row a line")
    text = data.decode("utf-8-sig", errors="replace")
    del data
    try:
        items = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DatasetError(f"not valid JSON: {exc}") from exc
    for number, item in enumerate(items, 1):
        if isinstance(item, dict):
            yield item, None, None, f"item {number}"
        else:
            yield None, "row is not a JSON object", _preview(item), f"item {number}"


def _parse_line(raw_line: bytes) -> tuple[Any, str | None, str | None]:
    """Decode and parse one non-blank JSONL line into a record."""
    try:
        line = raw_line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "not valid UTF-8", raw_line.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(line)
    except ValueError as exc:
        return None, f"not valid JSON: {exc}", line
    except RecursionError:
        return None, "not valid JSON: nested too deeply", line
    if not isinstance(obj, dict):
        return None, "row is not a JSON object", line
    return obj, None, line


def _iter_parquet(path: Path) -> Iterator[_Record]:
    """Stream a Parquet file in record batches, one dict per row."""
    import pyarrow as pa  # imported lazily: only Parquet sources need it
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        number = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_SIZE):
            for obj in batch.to_pylist():
                number += 1
                yield obj, None, None, f"row {number}"
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


def _split_hf_id(source: str) -> tuple[str, str]:
    """Split ``name[:split]`` into the dataset name and split (default ``train``)."""
    name, sep, split = source.rpartition(":")
    if not sep or not name or not split:
        return source.rstrip(":"), "train"
    return name, split


#: Seconds the Hugging Face Hub has to answer before a dataset id is given up on.
HUB_TIMEOUT_S = 5.0


def _check_hub_reachable(source: str, name: str) -> None:
    """Fail in seconds, not after the Hub client's ~30 s of retries, when the Hub does not
    answer; and say that no local file of that name was found (often the real mistake).

    Only a transport failure stops here: any HTTP answer (even 401 or 404 for a private
    dataset) goes on to ``datasets``, which has the token and its own messages. Offline
    mode (HF_HUB_OFFLINE=1) reads the local cache and is not checked.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
            os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes"):
        return
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        httpx.head(f"{endpoint}/api/datasets/{name}", timeout=HUB_TIMEOUT_S)
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatasetError(
            f"no local file or folder named {source!r}, and the Hugging Face Hub "
            f"({endpoint}) did not answer within {HUB_TIMEOUT_S:g} s to load it as a dataset "
            f"id: {reason}; check the path, or the network (HF_HUB_OFFLINE=1 uses the "
            "local cache)") from None


def _iter_hf(source: str) -> Iterator[_Record]:
    """Open a Hugging Face dataset (eagerly) and return an iterator of records."""
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(
            f"no such file or directory: {source!r}; it cannot be loaded as a Hugging Face "
            "dataset id either, because the 'datasets' package is not installed "
            "(pip install datasets)"
        )
    name, split = _split_hf_id(source)
    _check_hub_reachable(source, name)
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a source error
        raise DatasetError(
            f"cannot load Hugging Face dataset {name!r} (split {split!r}): {exc}"
        ) from exc
    return ((dict(obj), None, None, f"row {n}") for n, obj in enumerate(dataset, 1))

"""Dataset rows normalised into chat prompts: the row forms, tools, the prompt rule
and what a database can store (see the package's docstring).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from synthq.spec.jobspec import BY_NAME

MAX_ROW_CHARS = 200_000

"""Default limit on the total characters of a prompt's message contents."""


RAW_PREVIEW_CHARS = 2_000

"""How much of a skipped row's raw text is kept in :attr:`Row.raw`."""


"""A JSONL line longer than this is a skipped row, read through without holding it."""


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

REGENERATE_MODES = BY_NAME["regenerate"].choices  # declared in synthq.spec.jobspec


# Conversation-list fields, in order of precedence.

_LIST_FIELDS = ("messages", "conversations", "conversation")


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
    if not is_mapping(obj):
        raise InvalidRow("row is not a JSON object")
    conversation = _extract_conversation(obj)
    if not conversation:
        raise InvalidRow("empty conversation")
    _check_tool_pairs(conversation)
    if regenerate == "all":
        _check_prompt(conversation, max_chars=max_chars, whole=True)
        from synthq.data.turns import turn_positions

        if not turn_positions(conversation):
            raise InvalidRow("no assistant turn to regenerate")
        return conversation
    if key_version == 1:
        prompt = _trim_last_answer(conversation)
    else:
        prompt = _through_last_question(conversation)
    _check_prompt(prompt, max_chars=max_chars)
    return prompt


def is_mapping(obj: Any) -> bool:
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
    tools = obj.get("tools") if is_mapping(obj) else None
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


def check_storable(value: Any, what: str) -> None:
    """Refuse text a database cannot store: a NUL character (PostgreSQL's text and JSONB
    refuse ``\\u0000``) or a lone surrogate (not UTF-8), anywhere in ``value``."""
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidRow(f"{what} holds a NUL character (\\u0000), which cannot be stored")
        if not _is_encodable(value):
            raise InvalidRow(f"{what} holds text that is not valid Unicode (a lone surrogate)")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_storable(key, what)
            check_storable(item, what)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_storable(item, what)


def escape_unstorable(text: str) -> str:
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


"""A server's answer, read and checked before synthq trusts it (pure: no I/O).

The chat client (:mod:`synthq.serving.inference`) hands this module the bytes it
receives: a streamed body is split into server-sent-event lines (:func:`sse_lines`),
each ``data:`` payload parsed as exactly one JSON value (:func:`parse_json`) and folded
into an :class:`Accumulator`, which checks each field's type as it goes. A non-streamed
document's fields pass the same checks (``checked_*``). The token counts a server
reports are checked against what it sent (:func:`checked_usage`), and text no database
column takes is repaired and counted (:func:`replace_unstorable`).

A field of the wrong type raises :class:`Malformed` (the server's fault: the client
turns it into ``server_error``), never a crash of the worker.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from synthq.core import errors

__all__ = ["MAX_USAGE_TOKENS", "Accumulator", "Malformed", "Usage", "checked_finish",
           "checked_ids", "checked_object", "checked_text", "checked_usage",
           "message_tool_calls", "parse_json", "replace_unstorable", "sse_lines"]

#: Most tokens a usage field may report: far above any context window, far below the
#: database's INTEGER (a server's 10**15 failed a good answer on storing it).
MAX_USAGE_TOKENS = 10_000_000


async def sse_lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[list[bytes]]:
    """The complete lines of a server-sent-event body, as bytes, a list per read (no
    text decoding layer, no generator step per line: this runs for every token).
    More than ``limit`` bytes in all fails the call."""
    pending = b""
    seen = 0
    async for data in chunks:
        seen += len(data)
        if seen > limit:
            raise errors.ResponseTooLarge(
                f"the streamed response passed max_response_bytes={limit:,}")
        if pending:
            data = pending + data
        lines = data.split(b"\n")
        pending = lines.pop()
        if lines:
            yield lines
    if pending:
        yield [pending]


#: The C scanner behind ``json.loads``, called without its per-call wrappers (encoding
#: detection, the whitespace regexes): one SSE payload per streamed token.
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def parse_json(data: bytes, repairs: dict[str, int]) -> Any:
    """One SSE payload (stripped of surrounding whitespace): exactly one JSON value, as
    ``json.loads`` takes it; invalid UTF-8 is decoded with U+FFFD and counted."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        repairs["invalid_utf8"] = repairs.get("invalid_utf8", 0) + text.count("\ufffd")
    try:
        value, end = _scan(text, 0)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


#: Characters no database text column takes: NUL (PostgreSQL) and lone surrogates (UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def replace_unstorable(text: str | None, repairs: dict[str, int]) -> str | None:
    """``text`` with NUL and lone surrogates replaced by U+FFFD, each counted in ``repairs``."""
    if text is None or not _UNSTORABLE.search(text):
        return text

    def fix(match: re.Match[str]) -> str:
        kind = "nul" if match.group() == "\x00" else "surrogate"
        repairs[kind] = repairs.get(kind, 0) + 1
        return "\ufffd"

    return _UNSTORABLE.sub(fix, text)


class Malformed(ValueError):
    """A chunk or document field of the wrong type: the server's fault (``server_error``)."""


def checked_text(value: Any, what: str) -> str:
    if type(value) is not str:
        raise Malformed(f"{what} is a {type(value).__name__}, not a string")
    return value


def checked_ids(value: Any, what: str) -> list[int]:
    """Token ids as int32 can store them (the packed columns are int32)."""
    if type(value) is list:
        for i in value:  # a loop, not all(...): a generator per chunk costs a microsecond
            if type(i) is not int or not 0 <= i < _INT32:
                break
        else:
            return value
    raise Malformed(f"{what} is not a list of token ids")


_INT32 = 1 << 31


def checked_finish(value: Any) -> str:
    if type(value) is not str or len(value) > 32:  # samples.finish_reason is VARCHAR(32)
        raise Malformed(f"finish_reason {str(value)[:40]!r} is not a short string")
    return value


def checked_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if type(value) is not dict:
        raise Malformed(f"{what} is a {type(value).__name__}, not an object")
    return value


class Accumulator:
    """Builds the answer from SSE chunk payloads, checking each field's type as it goes
    (a wrong one raises :class:`Malformed`): ``"delta": "str"`` or a tool call's
    ``"index": [1]`` is a broken server, never a crash of the worker."""

    __slots__ = ("content", "reasoning", "finish_reason", "usage", "token_ids", "prompt_token_ids",
                 "calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        #: As the server sent it: checked once, at the end (:func:`checked_usage`).
        self.usage: Any = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        #: Streamed tool calls by index: id, name and the argument pieces.
        self.calls: dict[int, dict[str, Any]] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(checked_ids(chunk["prompt_token_ids"], "prompt_token_ids"))
        choices = chunk.get("choices") or []
        if type(choices) is not list:
            raise Malformed(f"choices is a {type(choices).__name__}, not a list")
        for choice in choices:
            if type(choice) is not dict:
                raise Malformed(f"a choice is a {type(choice).__name__}, not an object")
            # Type checks inline, the helpers only on the way to the error: this runs
            # once per streamed token.
            delta = choice.get("delta")
            if type(delta) is not dict:
                delta = checked_object(delta, "delta")
            if piece := delta.get("content"):
                self.content.append(piece if type(piece) is str else
                                    checked_text(piece, "delta.content"))
            # vLLM: reasoning_content; some versions and SGLang: reasoning.
            if piece := delta.get("reasoning_content") or delta.get("reasoning"):
                self.reasoning.append(piece if type(piece) is str else
                                      checked_text(piece, "delta.reasoning_content"))
            if calls := delta.get("tool_calls"):
                self._add_calls(calls)
            if ids := choice.get("token_ids"):
                if type(ids) is not list:
                    raise Malformed(f"token_ids is a {type(ids).__name__}, not a list")
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)  # each id checked once, at the end (ids())
            if choice.get("finish_reason"):
                self.finish_reason = checked_finish(choice["finish_reason"])

    def pieces(self) -> int:
        """Chunks that carried generated text: the token count when usage cannot be trusted
        (a server's chunk carries at least one token)."""
        calls = sum(len(c["arguments"]) or 1 for c in (self.calls or {}).values())
        return len(self.content) + len(self.reasoning) + calls

    def ids(self) -> list[int] | None:
        """The streamed token ids, checked (one pass over them all is cheaper than a
        check per chunk)."""
        return None if self.token_ids is None else checked_ids(self.token_ids, "token_ids")

    def _add_calls(self, calls: Any) -> None:
        if type(calls) is not list:
            raise Malformed(f"tool_calls is a {type(calls).__name__}, not a list")
        if self.calls is None:
            self.calls = {}
        for piece in calls:
            piece = checked_object(piece, "a tool call")
            index = piece.get("index")
            if index is None:
                index = 0
            elif type(index) is not int or index < 0:
                raise Malformed(f"a tool call's index is {str(index)[:40]!r}, not an integer")
            at = self.calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            if piece.get("id"):
                at["id"] = checked_text(piece["id"], "a tool call's id")
            function = checked_object(piece.get("function"), "a tool call's function")
            if function.get("name"):
                at["name"] += checked_text(function["name"], "a tool call's name")
            if function.get("arguments"):
                at["arguments"].append(checked_text(function["arguments"],
                                                    "a tool call's arguments"))

    def tool_calls(self, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
        if not self.calls:
            return None
        fix = replace_unstorable
        return [{"id": fix(c["id"], repairs) or f"call_{i}", "type": "function",
                 "function": {"name": fix(c["name"], repairs) or "",
                              "arguments": fix("".join(c["arguments"]), repairs) or ""}}
                for i, c in sorted(self.calls.items())]


def _count(value: Any) -> int | None:
    """A token count as a server must send it: a JSON integer in [0, MAX_USAGE_TOKENS]
    (not a bool, a float or a string such as "1e9")."""
    if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    return None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int | None
    completion: int | None
    #: What was wrong with the server's figures (None: nothing); they were replaced.
    problem: str | None = None


def checked_usage(usage: Any, *, ceiling: int, ids: list[int] | None,
                  prompt_ids: list[int] | None, streamed: int | None, text: bool) -> Usage:
    """The token counts to record, from the server's ``usage`` checked against the call.

    A count must be an integer in range; the completion count can be no lower than
    the token ids streamed (or 1 when text was), and no higher than the request's
    ``max_tokens`` (``ceiling``). A bad one is replaced by what was streamed (the
    token ids, else the chunks that carried text: a server's chunk carries at
    least one token), never by a figure that could make a counter go negative or
    fail the answer. Absent figures stay None (the server gave none).
    """
    if usage is not None and type(usage) is not dict:
        return Usage(len(prompt_ids) if prompt_ids else None, len(ids) if ids else streamed,
                     f"usage is a {type(usage).__name__}, not an object")
    problems: list[str] = []
    usage = usage or {}
    said = usage.get("prompt_tokens")
    prompt = _count(said)
    if said is not None and prompt is None:
        problems.append(f"prompt_tokens={str(said)[:40]!r}")
    if prompt_ids and prompt != len(prompt_ids):
        if prompt is not None:
            problems.append(f"prompt_tokens={prompt} for {len(prompt_ids)} prompt token ids")
        prompt = len(prompt_ids)
    said = usage.get("completion_tokens")
    completion = _count(said)
    low = len(ids) if ids else int(text)
    if said is not None and (completion is None or not low <= completion <= max(ceiling, low)):
        problems.append(f"completion_tokens={str(said)[:40]!r} (streamed {low}, "
                        f"max_tokens {ceiling})")
        completion = len(ids) if ids else streamed
    return Usage(prompt, completion, "; ".join(problems) or None)


def message_tool_calls(calls: Any, repairs: dict[str, int]) -> list[dict[str, Any]] | None:
    """A non-streamed message's ``tool_calls``, in the form the streamed path builds."""
    if not calls or not isinstance(calls, list):
        return None
    out = []
    for i, call in enumerate(c for c in calls if isinstance(c, dict)):
        function = call.get("function") or {}
        fix = replace_unstorable
        out.append({"id": fix(str(call.get("id") or ""), repairs) or f"call_{i}",
                    "type": "function",
                    "function": {"name": fix(str(function.get("name") or ""), repairs) or "",
                                 "arguments": fix(str(function.get("arguments") or ""),
                                                  repairs) or ""}})
    return out or None

"""Chat templates rendered under limits: size and time, in whatever process renders them.

A chat template is code (Jinja) that a user (``--chat-template``, the API's
``chat_template``, a tokenizer folder) or a Hub repository supplies, and synthq
renders it in the API and CLI (the probe renders at enqueue) and in every worker
(each sample). transformers renders it in jinja2's
``ImmutableSandboxedEnvironment``, which keeps it from reaching Python's internals
but not from using the machine: ``{% set x = 'a' * 800000000 %}`` took the API to
1.84 GB, nested ``range(100000)`` loops never end, ``[1] | slice(20000000) | list``
built 1.4 GB at compile time, ``lipsum(200000)`` ran 30 s. :class:`BoundedSandbox` is
that sandbox with a budget per render, checked *before* anything large is built:

* **bytes**: every string, list or tuple the template builds (``*``, ``+``, ``~``,
  ``%``, ``str.format``'s fields, a filter's or a method's result, the items a lazy
  filter yields, an output or ``{% set %}`` block) is charged against
  :data:`RENDER_BYTES`, about: a character 1, a list's item :data:`SLOT`, a new
  list or string object :data:`OBJECT`. An operation whose result would go over is
  refused before it runs: ``'a' * 10**9``, ``'{0:>{1}}'.format('x', 10**9)`` (each
  field once its nested fields are known), ``'%*s' % (10**9, 'x')``,
  ``x | slice(10**8)``, ``x | batch(10**8, 0)``, ``s.split()`` of a long string,
  ``lipsum(10**6)``, ``x | tojson(indent=10**7)``, ``s | urlize(target=...)``;
* **time**: :data:`RENDER_SECONDS` per render (:func:`limits` narrows it: the
  probe renders at enqueue get :data:`PROBE_SECONDS`), checked at each item of
  every ``{% for %}`` loop and of every lazy filter (``slice``, ``batch``, ``map``,
  ``unique``...), each ``lipsum`` paragraph, attribute access, call, operator and
  output piece; and a watchdog (:class:`_Watchdog`) stops a render still running
  past its deadline inside one Python-level call that ticks nowhere (``urlize``,
  ``wordwrap``, ``pprint``, a sort key of a long list);
* **counts**: ``range`` holds at most :data:`MAX_RANGE` items, ``**`` and ``*`` of
  integers at most :data:`MAX_POWER_BITS`, ``round`` at most
  :data:`MAX_ROUND_DIGITS` digits; ``sum`` of lists is linear (Python's is
  quadratic: 70 s for 3,000 lists of 1,000);
* **compile time**: jinja2 folds constant expressions (``[1] | slice(20000000) |
  list``) while it compiles, outside any render: folding gets
  :data:`FOLD_BYTES` of its own, and a constant over that is computed at render,
  under the render's budget.

A template over a limit raises :class:`TemplateLimitError` (a jinja2
``TemplateError``): at enqueue the job is refused with one line, in a worker
that sample fails as ``invalid_input``. :func:`install` makes transformers
build its template environment from this class (its ``_compile_jinja_template``
looks the sandbox class up by name when it compiles), so ``apply_chat_template``
renders under these limits everywhere.

What the budget does not see: time spent inside one C call it allowed (a
``sort`` of a list within the budget, a regex-free string method), each
bounded by the size budget (a C call cannot be interrupted: the watchdog's
exception lands when it returns); memory is counted as above, not measured (a
string of characters beyond Latin-1 takes 2-4 bytes each); and renders through
transformers' ``return_assistant_tokens_mask`` path (``Template.generate``),
which synthq does not use.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import re
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from string import Formatter
from typing import Any

from jinja2 import nodes, pass_context, pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from jinja2.utils import generate_lorem_ipsum
from markupsafe import Markup

__all__ = ["BoundedSandbox", "TemplateLimitError", "install", "limits", "RENDER_BYTES",
           "RENDER_SECONDS", "PROBE_SECONDS", "MAX_RANGE"]

#: Bytes (about: see the module doc) one render may build in all: about 16× the
#: largest row (synthq.data.dataset.MAX_ROW_CHARS) rendered a few times over.
RENDER_BYTES = 32 << 20
#: What one item of a list or tuple costs (a reference).
SLOT = 8
#: What a new object costs (an empty list, a short string, a tuple).
OBJECT = 64
#: Bytes that constant folding may build while a template compiles.
FOLD_BYTES = 64 << 10
#: Seconds one render may take (a real template renders a conversation in ms).
RENDER_SECONDS = 20.0
#: Seconds a probe render at enqueue may take (two short turns).
PROBE_SECONDS = 2.0
#: Items one ``range()`` may hold.
MAX_RANGE = 100_000
#: Bits a ``**`` or ``*`` of integers may have.
MAX_POWER_BITS = 1 << 16
#: Digits ``round`` may round to (``round(x, 10**8, 'floor')`` computes ``10 ** 10**8``).
MAX_ROUND_DIGITS = 1_000
#: Seconds past its deadline after which the watchdog stops a render that has not
#: stopped itself at a tick.
WATCHDOG_GRACE = 0.1


class TemplateLimitError(SecurityError):
    """The chat template went over a limit of synthq's sandbox while rendering."""


class _Overtime(TemplateLimitError):
    """Raised by the watchdog in a render's thread (an exception class with no
    arguments: the render replaces it with its own line)."""


class _Budget:
    __slots__ = ("deadline", "left", "seconds", "stopped")

    def __init__(self, seconds: float, size: int) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.left = size
        #: The watchdog raised _Overtime in the render's thread.
        self.stopped = False


class _Local(threading.local):
    #: The render under way in this thread (None: no render; a class attribute, so that
    #: reading it is a plain attribute read, not a getattr with a default).
    budget: _Budget | None = None


_local = _Local()


def _budget() -> _Budget | None:
    return _local.budget


def _late(budget: _Budget) -> TemplateLimitError:
    return TemplateLimitError(f"the chat template ran over {budget.seconds:g} s in one "
                              "render (synthq's limit)")


def _tick() -> None:
    budget = _local.budget
    if budget is not None and time.monotonic() > budget.deadline:
        raise _late(budget)


def _over() -> TemplateLimitError:
    return TemplateLimitError(f"the chat template would build over {RENDER_BYTES >> 20} MiB "
                              "in one render (synthq's limit)")


def _need(n: int) -> None:
    """Refuse an operation that would build ``n`` bytes more than are left."""
    budget = _local.budget
    if budget is not None and n > budget.left:
        raise _over()


def _charge(n: int) -> None:
    budget = _local.budget
    if budget is not None:
        budget.left -= n
        if budget.left < 0:
            raise _over()


def _cost(value: Any) -> int:
    """What ``value`` took to build, about (module doc): 0 for what is not a string,
    bytes or container."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, list | tuple):
        return OBJECT + SLOT * len(value)
    if isinstance(value, dict):
        return OBJECT + 4 * SLOT * len(value)
    return 0


def _charge_result(value: Any) -> Any:
    cost = _cost(value)
    if cost:
        _charge(cost)
    return value


def _size(value: Any) -> int:
    """An upper estimate of ``len(str(value))`` (or its JSON), stopping once over the
    budget left: what turning ``value`` into text would build."""
    budget = _budget()
    limit = budget.left if budget is not None else RENDER_BYTES
    total, stack, steps = 0, [value], 0
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, bytes):  # its repr: "\\xff" for a byte
            total += 4 * len(item) + 3
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            stack.extend(item)
        else:
            total += 24
        steps += 1
        if not steps & 1023:
            _tick()
    return total


def _json_size(value: Any, width: int) -> int:
    """An upper estimate of ``len(json.dumps(value, indent=..., separators=...))`` where
    the indent and separators add ``width`` characters at most per item and level:
    each item is on a line of its own, indented by its depth."""
    if width <= 0:
        return _size(value)
    budget = _budget()
    limit = budget.left if budget is not None else RENDER_BYTES
    total, stack, steps = 0, [(value, 0)], 0
    while stack and total <= limit:
        item, depth = stack.pop()
        total += (depth + 1) * width + 2
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend((x, depth + 1) for x in itertools.chain(item.keys(), item.values()))
        elif isinstance(item, list | tuple):
            stack.extend((x, depth + 1) for x in item)
        else:
            total += 24
        steps += 1
        if not steps & 1023:
            _tick()
    return total


def _len(value: Any) -> int:
    """``len(value)``, or 0 for what has none (a lazy input: its items are charged as
    they come, :func:`_stream`)."""
    try:
        return len(value)
    except TypeError:
        return 0


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _ints(args: Iterable[Any]) -> list[int]:
    return [a for a in args if isinstance(a, int) and not isinstance(a, bool)]


def _text_lengths(args: Iterable[Any]) -> int:
    """The characters of every string among ``args`` (and inside a list or tuple among
    them): separators, fill strings, indents, ``end`` markers, targets."""
    total = 0
    for arg in args:
        if isinstance(arg, str):
            total += len(arg)
        elif isinstance(arg, list | tuple):
            total += sum(len(x) for x in arg if isinstance(x, str))
    return total


def _escaped(value: Any) -> int:
    """How many times longer escaping makes a text (``&`` becomes ``&amp;``): a Markup
    escapes what it is combined with."""
    return 5 if isinstance(value, Markup) else 1


def _digits(text: str) -> int:
    """A width or precision written in a format string."""
    if len(text) > 12:
        raise _over()
    return int(text)


#: A printf-style conversion's width and precision (``%-*.*f``, ``%(name)10s``).
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _percent_need(fmt: str | bytes, args: Sequence[Any]) -> int:
    """What ``fmt % args`` builds at most: the text, each width and precision (a
    ``*`` takes its number from the arguments), each argument as text."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    need = len(text) + sum(_size(a) for a in args)
    star = False
    for width, precision in _PERCENT.findall(text):
        for digits in (width, precision):
            if digits == "*":
                star = True
            elif digits:
                need += _digits(digits)
    if star:
        need += sum(n for n in _ints(args) if n > 0)
    return need * _escaped(fmt)


_SPEC_DIGITS = re.compile(r"\d+")


class _BoundedFields(Formatter):
    """``str.format``'s fields, each checked once its spec is known (nested ``{1}``
    fields resolved): the width and precision it would pad to, before it is built."""

    escapes = 1

    def format_field(self, value: Any, format_spec: str) -> Any:
        widths = sum(_digits(d) for d in _SPEC_DIGITS.findall(format_spec))
        _need((widths + _size(value)) * self.escapes)
        return _charge_result(super().format_field(value, format_spec))


class _BoundedFormatter(_BoundedFields, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFields, SandboxedEscapeFormatter):
    escapes = 5


def _split_need(value: str | bytes, args: Sequence[Any], name: str) -> int:
    """``split``/``rsplit``/``splitlines``: a new object for each piece, counted (the
    separators, in C) before the list is built."""
    if name == "splitlines":
        breaks = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
        if isinstance(value, bytes):
            pieces = value.count(b"\n") + value.count(b"\r") + 1
        else:
            pieces = sum(value.count(c) for c in breaks) + 1
    else:
        seps = [a for a in args if isinstance(a, str | bytes)]
        if seps and seps[0]:
            try:
                pieces = value.count(seps[0]) + 1  # type: ignore[arg-type]
            except TypeError:  # bytes split by a str: the call raises
                return 0
        elif isinstance(value, str) and value.isascii():
            pieces = sum(value.count(c) for c in " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f") + 1
        else:
            pieces = len(value) // 2 + 1
        counts = [n for n in _ints(args) if n >= 0]
        if counts:
            pieces = min(pieces, counts[0] + 1)
    return len(value) + pieces * (SLOT + OBJECT)


def _translate_need(value: str, args: Sequence[Any]) -> int:
    table = args[0] if args else None
    longest = 1
    if isinstance(table, dict):
        longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    elif isinstance(table, list | tuple):
        longest = max((len(v) for v in table if isinstance(v, str)), default=1)
    return len(value) * max(longest, 1)


def _strings(args: Iterable[Any]) -> list[str | bytes]:
    return [a for a in args if isinstance(a, str | bytes)]


def _wordwrap_need(value: str, args: Sequence[Any]) -> int:
    """Each line at most ``width`` characters, each joined by ``wrapstring``."""
    width = max(min(_ints(args), default=79), 1)
    wrap = _text_lengths(args) or 1
    lines = len(value) // width + value.count("\n") + 1
    return len(value) + lines * wrap


def _urlize_need(value: str, args: Sequence[Any]) -> int:
    """Escaping (at most 5× a character), a URL written twice (``href``), and each
    URL's attributes (``target``, ``rel``: any length a template passes)."""
    urls = value.count(".") + value.count("@") + value.count(":") + 1
    return 10 * len(value) + urls * (_text_lengths(args) + 64)


def _batch_need(value: Any, args: Sequence[Any]) -> int:
    """``batch(n, fill)``: a list per ``n`` items, the last padded to ``n`` by ``fill``."""
    count, numbers = _len(value), _ints(args)
    per = max(min(numbers, default=1), 1)
    pad = SLOT * max(numbers, default=0) if len(args) > 1 else 0
    return SLOT * count + OBJECT * (count // per + 1) + pad


def _slice_need(value: Any, args: Sequence[Any]) -> int:
    """``slice(n, fill)``: ``n`` lists, each one item longer with ``fill``."""
    slices = max(max(_ints(args), default=0), 0)
    return SLOT * _len(value) + slices * (OBJECT + (SLOT if len(args) > 1 else 0))


def _round_check(value: Any, args: Sequence[Any]) -> int:
    for digits in _ints(args):
        if abs(digits) > MAX_ROUND_DIGITS:
            raise TemplateLimitError(f"round() to {digits:,} digits in the chat template "
                                     f"(synthq's limit: {MAX_ROUND_DIGITS:,})")
    return 0


def _width_need(value: Any, args: Sequence[Any]) -> int:
    """``center(width)``, ``ljust``, ``zfill``...: the width, or the text itself."""
    return max([_len(value), *_ints(args)]) + _text_lengths(args)


def _indent_need(value: str, args: Sequence[Any]) -> int:
    """Each line indented by ``width`` (a number of spaces, or a string)."""
    width = max([len(a) for a in _strings(args)] + _ints(args) + [4])
    return len(value) + (value.count("\n") + 1) * width


def _replace_need(value: Any, args: Sequence[Any]) -> int:
    """Each occurrence of ``old`` replaced by ``new`` (whichever of the strings each is)."""
    texts, hits = _strings(args), 0
    for text in texts:
        try:
            hits = max(hits, value.count(text) if text else len(value) + 1)
        except TypeError:  # bytes and str: the call raises
            return 0
    longest = max((len(t) for t in texts), default=0)
    return len(value) + hits * longest * _escaped(value)


def _join_need(items: Any, sep: Any) -> int:
    if not isinstance(items, list | tuple):
        return 0  # lazy: its items are charged as they come
    return (_size(items) + _len(sep) * len(items)) * _escaped(sep)


def _cased_need(value: Any, args: Sequence[Any]) -> int:
    """``upper``, ``title``...: up to 3 characters for one beyond ASCII (``'ß'`` is
    ``'SS'``, ``'ﬃ'`` is ``'FFI'``)."""
    return len(value) if isinstance(value, str) and value.isascii() else 3 * _len(value)


def _expandtabs_need(value: Any, args: Sequence[Any]) -> int:
    size = max(_ints(args), default=8)
    tab = "\t" if isinstance(value, str) else b"\t"
    return len(value) + value.count(tab) * max(size, 0)


def _to_text(factor: int) -> Callable[[Any, Sequence[Any]], int]:
    """The value as text, at most ``factor`` times as long (escaped, quoted)."""
    return lambda value, args: factor * _size(value)


def _items(per: int) -> Callable[[Any, Sequence[Any]], int]:
    """A list of the value's items, ``per`` bytes each."""
    return lambda value, args: OBJECT + per * _len(value)


#: Filters whose result can be much larger than their value, and what they need
#: (``name -> need(value, args)`` in bytes). ``args`` are the filter's, keywords last
#: in the order written, so a need reads them by kind (the numbers, the strings), never
#: by position, and takes the worst case: ``indent(first=True, width=10**7)``.
_FILTER_NEEDS: dict[str, Callable[[Any, Sequence[Any]], int]] = {
    "center": _width_need,
    "truncate": lambda value, args: _len(value) + _text_lengths(args),
    "indent": lambda value, args: _indent_need(value, args) if isinstance(value, str) else 0,
    "wordwrap": lambda value, args: _wordwrap_need(value, args) if isinstance(value, str)
    else 0,
    "urlize": lambda value, args: _urlize_need(value, args) if isinstance(value, str) else 0,
    "replace": lambda value, args: _replace_need(value, args) if isinstance(value, str) else 0,
    "format": lambda value, args: _percent_need(value, args) if isinstance(value, str) else 0,
    "join": lambda value, args: _join_need(value, max(_strings(args), key=len, default="")),
    "batch": _batch_need,
    "slice": _slice_need,
    "round": _round_check,
    "upper": _cased_need, "lower": _cased_need, "title": _cased_need,
    "capitalize": _cased_need,
    "tojson": lambda value, args: 6 * _json_size(value, sum(n for n in _ints(args) if n > 0)
                                                 + _text_lengths(args)),
    "string": _to_text(1), "pprint": _to_text(1), "xmlattr": _to_text(5),
    "urlencode": _to_text(3), "e": _to_text(5), "escape": _to_text(5),
    "forceescape": _to_text(5),
    "list": lambda value, args: OBJECT + (SLOT if not isinstance(value, str) or
                                          value.isascii() else SLOT + OBJECT) * _len(value),
    "sort": _items(SLOT),
    "reverse": lambda value, args: _len(value) if isinstance(value, str) else 0,
    "dictsort": _items(OBJECT + 3 * SLOT), "groupby": _items(OBJECT + 3 * SLOT),
}

#: The same for methods of strings, bytes, lists and tuples.
_METHOD_NEEDS: dict[str, Callable[[Any, Sequence[Any]], int]] = {
    "center": _width_need, "ljust": _width_need, "rjust": _width_need,
    "zfill": _width_need,
    "expandtabs": _expandtabs_need,
    "replace": _replace_need,
    "translate": lambda value, args: _translate_need(value, args)
    if isinstance(value, str) else _len(value),
    "split": functools.partial(_split_need, name="split"),
    "rsplit": functools.partial(_split_need, name="rsplit"),
    "splitlines": functools.partial(_split_need, name="splitlines"),
    "encode": lambda value, args: 10 * _len(value),  # "\\U0001f600", "&#128512;"
    "hex": lambda value, args: 3 * _len(value),
    "upper": _cased_need, "lower": _cased_need, "title": _cased_need,
    "capitalize": _cased_need, "swapcase": _cased_need, "casefold": _cased_need,
    "copy": _items(SLOT),
}


class _Range(Sequence[int]):
    """``range()`` in a template: at most MAX_RANGE items, each one on the clock."""

    def __init__(self, inner: range) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: Any) -> Any:
        item = self.inner[index]
        return _Range(item) if isinstance(item, range) else item

    def __iter__(self) -> Iterator[int]:
        for item in self.inner:
            _tick()
            yield item

    def __reversed__(self) -> Iterator[int]:
        return iter(_Range(self.inner[::-1]))

    def __contains__(self, item: object) -> bool:
        return item in self.inner

    def __repr__(self) -> str:
        return repr(self.inner)


def _range(*args: int) -> _Range:
    inner = range(*args)
    if len(inner) > MAX_RANGE:
        raise TemplateLimitError(f"range() of {len(inner):,} items in the chat template "
                                 f"(synthq's limit: {MAX_RANGE:,})")
    return _Range(inner)


#: The longest word of jinja2's lorem ipsum, with its comma or full stop and a space.
_LIPSUM_WORD = 20


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """``lipsum()``: what it would build checked first, each paragraph on the clock
    (jinja2's own runs 30 s for ``lipsum(200000)`` with no tick)."""
    if _ints((n, min, max)) != [n, min, max]:
        raise TypeError("lipsum() takes whole numbers")
    _need(n * (max * _LIPSUM_WORD + 16))
    paragraphs = []
    for _ in range(n):
        _tick()
        paragraphs.append(generate_lorem_ipsum(1, html, min, max))
    if html:
        return Markup("\n".join(paragraphs))
    return "\n\n".join(paragraphs)


@pass_environment
def _sum(environment: Any, iterable: Iterable[Any], attribute: Any = None,
         start: Any = 0) -> Any:
    """The ``sum`` filter, lists and tuples concatenated in linear time: Python's
    ``sum`` copies the total at each item (70 s for 3,000 lists of 1,000 items)."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if not isinstance(start, list | tuple):
        return sum(iterable, start)
    kind, total, parts = type(start), len(start), [start]
    for part in iterable:
        if type(part) is not kind:
            raise TypeError(f'can only concatenate {kind.__name__} (not '
                            f'"{type(part).__name__}") to {kind.__name__}')
        total += len(part)
        _tick()
        _need(OBJECT + SLOT * total)
        parts.append(part)
    return kind(itertools.chain.from_iterable(parts))


def _stream(items: Iterator[Any]) -> Iterator[Any]:
    """A filter's lazy result (``slice``, ``batch``, ``map``, ``unique``...): each item
    on the clock and charged as it comes (a list of them may be built)."""
    for item in items:
        budget = _local.budget
        if budget is not None:
            if time.monotonic() > budget.deadline:
                raise _late(budget)
            budget.left -= SLOT + (_cost(item) if isinstance(item, list | tuple) else 0)
            if budget.left < 0:
                raise _over()
        yield item


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes_arg = getattr(func, "jinja_pass_arg", None) is not None
    needs = _FILTER_NEEDS.get(name)

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if needs is not None:
            rest = args[1:] if passes_arg else args
            if rest:
                _need(needs(rest[0], [*rest[1:], *kwargs.values()]))
        result = func(*args, **kwargs)
        if hasattr(type(result), "__next__") and not isinstance(result, str):
            return _stream(result)
        return _charge_result(result)

    return bounded


#: Globals a caller adds (transformers' ``strftime_now``), and what they need.
_GLOBAL_NEEDS: dict[str, Callable[[Sequence[Any]], int]] = {
    # %c is 24 characters.
    "strftime_now": lambda args: 12 * _text_lengths(args),
}


def _bounded_global(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    needs = _GLOBAL_NEEDS[name]

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _need(needs([*args, *kwargs.values()]))
        return _charge_result(func(*args, **kwargs))

    return bounded


#: The filter every ``{% for %}`` iterates through: the clock checked at each item.
_ITERATE = "synthq_clock"


@pass_context
def _iterate(context: Any, iterable: Iterable[Any]) -> Iterator[Any]:
    # pass_context: jinja2 never folds it at compile time (it would print the generator).
    del context
    budget = _local.budget  # the render's (a loop runs inside one)
    for item in iterable:
        if budget is not None and time.monotonic() > budget.deadline:
            raise _late(budget)
        yield item


class _Watchdog:
    """One daemon thread per process that stops a render past its deadline (and
    :data:`WATCHDOG_GRACE`) which has not stopped itself at a tick: it is inside one
    call that runs Python code and ticks nowhere (``urlize`` of a long text,
    ``wordwrap``, ``pprint``, a sort key). It raises :class:`_Overtime` in the
    render's thread (``PyThreadState_SetAsyncExc``, delivered at the thread's next
    bytecode); the render replaces it with its own line, and clears one that was not
    delivered before the render ended. It polls while renders run and sleeps
    otherwise: a render pays a dict write and a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starting = threading.Lock()
        #: thread id -> the budget of the render it runs
        self.renders: dict[int, _Budget] = {}
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def enter(self, budget: _Budget) -> int:
        if self.thread is None:  # the process's first render (a forked child's too)
            with self.starting:
                if self.thread is None:
                    self.thread = threading.Thread(target=self.run, daemon=True,
                                                   name="synthq-sandbox-watchdog")
                    self.thread.start()
        ident = threading.get_ident()
        self.renders[ident] = budget
        if not self.wake.is_set():  # after the write: run() clears, then looks again
            self.wake.set()
        return ident

    def leave(self, ident: int, budget: _Budget) -> None:
        """End the render: idempotent, since an _Overtime delivered here cuts it short
        and the render calls it again."""
        _local.budget = None
        with self.lock:
            if self.renders.pop(ident, None) is not None and budget.stopped:
                _async_raise(ident, None)  # not delivered yet: never after the render

    def run(self) -> None:
        while True:
            self.wake.wait()
            time.sleep(WATCHDOG_GRACE)
            now = time.monotonic()
            with self.lock:
                for ident, budget in list(self.renders.items()):  # enter() writes unlocked
                    if not budget.stopped and now > budget.deadline + WATCHDOG_GRACE:
                        budget.stopped = True
                        _async_raise(ident, _Overtime)
                if not self.renders:
                    self.wake.clear()
                    if self.renders:  # entered between the look and the clear
                        self.wake.set()


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` at its next bytecode (None: clear it)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                               ctypes.py_object(exc) if exc else None)


_watchdog = _Watchdog()
# A forked child (Celery's prefork pool) has no watchdog thread, and may hold a lock
# that a thread of the parent held: it starts afresh at its first render.
os.register_at_fork(after_in_child=lambda: _Watchdog.__init__(_watchdog))


class _BoundedCodeGenerator(CodeGenerator):
    """Every ``{% for %}`` over :func:`_iterate` (a loop that does nothing else is on
    the clock too), and ``a ~ b`` through :meth:`BoundedSandbox.str_join` (jinja2 writes
    a call of its own ``str_join``, which no sandbox hook sees)."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _ITERATE, [], [], None, None,
                                     lineno=loop.iter.lineno)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.str_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedTemplate(Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        if _budget() is not None:  # a render inside a render shares its budget
            return super().render(*args, **kwargs)
        budget = _local.budget = _Budget(getattr(_local, "seconds", RENDER_SECONDS),
                                         RENDER_BYTES)
        ident = _watchdog.enter(budget)
        try:
            try:
                out = super().render(*args, **kwargs)
            finally:
                _watchdog.leave(ident, budget)
        except BaseException as exc:
            _watchdog.leave(ident, budget)  # again: an _Overtime may have cut it short
            if budget.stopped:  # the watchdog's, or what the code it hit made of it
                raise _late(budget) from (None if isinstance(exc, _Overtime) else exc)
            raise
        if budget.stopped:  # delivered, then swallowed by the code it hit
            raise _late(budget)
        return out


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a size and time budget per render (module doc)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _BoundedCodeGenerator
    template_class = _BoundedTemplate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("finalize", self._finalize)
        super().__init__(*args, **kwargs)
        self.globals = _BoundedGlobals(self.globals)
        self.globals["range"] = _range
        self.globals["lipsum"] = _lipsum
        self.filters = _BoundedFilters(self.filters)
        self.filters["sum"] = _sum
        dict.__setitem__(self.filters, _ITERATE, _iterate)

    @staticmethod
    def _finalize(value: Any) -> Any:
        # ``{{ value }}`` of a list or dict prints its repr: as large as its items.
        if not isinstance(value, str):
            _need(_size(value))
        return value

    def _generate(self, source: nodes.Template, name: str | None, filename: str | None,
                  defer_init: bool = False) -> str:
        """Compile with a budget of :data:`FOLD_BYTES`: jinja2 folds constant
        expressions here, outside any render (``{{ [1] | slice(20000000) | list }}``
        built 1.4 GB); a constant over that budget is left to the render."""
        if _local.budget is not None:
            return super()._generate(source, name, filename, defer_init=defer_init)
        _local.budget = _Budget(getattr(_local, "seconds", RENDER_SECONDS), FOLD_BYTES)
        try:
            return super()._generate(source, name, filename, defer_init=defer_init)
        finally:
            _local.budget = None

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Every output and ``{% set %}`` block is joined here: charged as it grows."""
        budget, parts, total = _local.budget, [], 0
        for piece in pieces:
            total += len(piece)
            if budget is not None:
                if time.monotonic() > budget.deadline:
                    raise _late(budget)
                if total > budget.left:
                    raise _over()
            parts.append(piece)
        _charge(total)
        return "".join(parts)

    def str_join(self, items: Iterable[Any]) -> str:
        items = tuple(items)
        _need(sum(len(x) if isinstance(x, str) else _size(x) for x in items))
        return _charge_result("".join(map(str, items)))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:
            # The common case (``'<|im_start|>' + message.role``), inline: the same
            # clock, the same charge before the string is built, one budget read.
            budget = _local.budget
            if budget is not None:
                if time.monotonic() > budget.deadline:
                    raise _late(budget)
                size = len(left) + len(right)
                if size > budget.left:
                    raise _over()
                budget.left -= size
            return left + right
        _tick()
        _need(_binop_need(operator, left, right))
        return _charge_result(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _local.budget  # _tick(), inline: a template reads attributes all along
        if budget is not None and time.monotonic() > budget.deadline:
            raise _late(budget)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _local.budget
        if budget is not None and time.monotonic() > budget.deadline:
            raise _late(budget)
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """jinja2's own (``str.format`` and ``format_map`` through its sandboxed
        formatter), with each field checked by :class:`_BoundedFields`."""
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) or \
                value.__name__ not in ("format", "format_map"):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        kind, is_map = type(owner), value.__name__ == "format_map"
        formatter: SandboxedFormatter
        if isinstance(owner, Markup):
            formatter = _BoundedEscapeFormatter(self, escape=owner.escape)
        else:
            formatter = _BoundedFormatter(self)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument "
                                    f"({len(args)} given)")
                kwargs, args = args[0], ()
            return kind(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str | bytes | list | tuple):
            name = getattr(__obj, "__name__", "")
            if name == "join":
                _need(_join_need(args[0] if args else (), owner))
            elif name in _METHOD_NEEDS:
                _need(_METHOD_NEEDS[name](owner, [*args, *kwargs.values()]))
        return _charge_result(super().call(__context, __obj, *args, **kwargs))


def _binop_need(operator: str, left: Any, right: Any) -> int:
    """What ``left <operator> right`` would build (``*``: a repetition or a product of
    integers, ``+``: a concatenation, ``%``: printf-style formatting, ``**``)."""
    if operator == "*":
        if type(left) is int and type(right) is int:
            bits = abs(left).bit_length() + abs(right).bit_length()
            if bits > MAX_POWER_BITS:
                raise TemplateLimitError(f"a product of {bits:,} bits in the chat template "
                                         f"(synthq's limit: {MAX_POWER_BITS:,})")
            return 0
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int):
            if isinstance(seq, str | bytes):
                return len(seq) * max(times, 0)
            if isinstance(seq, list | tuple):
                return OBJECT + SLOT * len(seq) * max(times, 0)
    elif operator == "+":
        if isinstance(left, str | bytes) and isinstance(right, str | bytes):
            return len(left) * _escaped(right) + len(right) * _escaped(left)
        if isinstance(left, list | tuple) and isinstance(right, list | tuple):
            return OBJECT + SLOT * (len(left) + len(right))
    elif operator == "%" and isinstance(left, str | bytes):
        return _percent_need(left, right if isinstance(right, tuple) else (right,))
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
            right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
        raise TemplateLimitError(f"{left} ** {right} in the chat template is over "
                                 f"{MAX_POWER_BITS:,} bits (synthq's limit)")
    return 0


class _BoundedFilters(dict[str, Any]):
    """The environment's filters, each wrapped by :func:`_bounded_filter` (also those a
    caller adds after, such as transformers' ``tojson``)."""

    def __init__(self, filters: dict[str, Any]) -> None:
        super().__init__()
        for name, func in filters.items():
            self[name] = func

    def __setitem__(self, name: str, func: Any) -> None:
        super().__setitem__(name, _bounded_filter(name, func))


class _BoundedGlobals(dict[str, Any]):
    """The environment's globals: those of :data:`_GLOBAL_NEEDS` a caller adds
    (transformers' ``strftime_now``) wrapped by :func:`_bounded_global`."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__()
        for name, value in values.items():
            self[name] = value

    def __setitem__(self, name: str, value: Any) -> None:
        if name in _GLOBAL_NEEDS and callable(value):
            value = _bounded_global(name, value)
        super().__setitem__(name, value)


@contextmanager
def limits(*, seconds: float) -> Iterator[None]:
    """Renders in this thread within the block get ``seconds`` each (the probes at
    enqueue: :data:`PROBE_SECONDS`)."""
    before = getattr(_local, "seconds", RENDER_SECONDS)
    _local.seconds = seconds
    try:
        yield
    finally:
        _local.seconds = before


_installed = False


def install() -> None:
    """Make transformers' ``apply_chat_template`` render in :class:`BoundedSandbox`.

    transformers builds the environment in ``_cached_compile_jinja_template`` from
    the name ``ImmutableSandboxedEnvironment`` of its module, looked up when a
    template is compiled; compiled templates are cached, so the cache is emptied
    once. tests/unit/test_sandbox.py fails if transformers stops doing so.
    """
    global _installed
    if _installed:
        return
    from transformers.utils import chat_template_utils

    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox  # type: ignore[misc]
    chat_template_utils._compile_jinja_template.cache_clear()
    _installed = True

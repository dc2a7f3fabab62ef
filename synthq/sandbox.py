"""Chat templates rendered under limits: size and time, in whatever process renders them.

A chat template is code (Jinja) that a user (``--chat-template``, the API's
``chat_template``) or a Hub repository supplies, and synthq renders it in the
API and CLI (the probe renders at enqueue) and in every worker (each sample).
transformers renders it in jinja2's ``ImmutableSandboxedEnvironment``, which
keeps it from reaching Python's internals but not from using the machine:
``{% set x = 'a' * 800000000 %}`` took the API to 1.84 GB, and nested
``range(100000)`` loops never end. :class:`BoundedSandbox` is that sandbox with
a budget per render, checked *before* anything large is built:

* **characters**: every string or list the template builds (``*``, ``+``,
  ``~``, ``%``, a filter's or a method's result, an output or ``{% set %}``
  block) is charged against :data:`RENDER_CHARS`; an operation whose result
  would go over (``'a' * 10**9``, ``'x'.center(10**9)``, ``s | indent(10**6)``,
  ``big_list | tojson``) is refused before it runs;
* **time**: :data:`RENDER_SECONDS` per render (:func:`limits` narrows it: the
  probe renders at enqueue get :data:`PROBE_SECONDS`), checked at each
  item of every ``{% for %}`` loop, attribute access, call, operator and
  output piece;
* ``range`` holds at most :data:`MAX_RANGE` items, ``**`` at most 64 Kibit.

A template over a limit raises :class:`TemplateLimitError` (a jinja2
``TemplateError``): at enqueue the job is refused with one line, in a worker
that sample fails as ``invalid_input``. :func:`install` makes transformers
build its template environment from this class (its ``_compile_jinja_template``
looks the sandbox class up by name when it compiles), so ``apply_chat_template``
renders under these limits everywhere.

What the budget does not see: time spent inside one C call it allowed (a
``sort`` of a list within the budget, a regex-free string method), each
bounded by the size budget; and renders through transformers'
``return_assistant_tokens_mask`` path (``Template.generate``), which synthq
does not use.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["BoundedSandbox", "TemplateLimitError", "install", "limits", "RENDER_CHARS",
           "RENDER_SECONDS", "PROBE_SECONDS", "MAX_RANGE"]

#: Characters (or list items) one render may build in all: about 16× the largest
#: row (synthq.dataset.MAX_ROW_CHARS) rendered a few times over.
RENDER_CHARS = 32 << 20
#: Seconds one render may take (a real template renders a conversation in ms).
RENDER_SECONDS = 20.0
#: Seconds a probe render at enqueue may take (two short turns).
PROBE_SECONDS = 2.0
#: Items one ``range()`` may hold.
MAX_RANGE = 100_000
#: Bits a ``**`` result may have.
MAX_POWER_BITS = 1 << 16


class TemplateLimitError(SecurityError):
    """The chat template went over a limit of synthq's sandbox while rendering."""


class _Budget:
    __slots__ = ("deadline", "left", "seconds")

    def __init__(self, seconds: float, chars: int) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.left = chars


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
    return TemplateLimitError(f"the chat template would build over {RENDER_CHARS:,} "
                              "characters in one render (synthq's limit)")


def _need(n: int) -> None:
    """Refuse an operation that would build ``n`` characters more than are left."""
    budget = _local.budget
    if budget is not None and n > budget.left:
        raise _over()


def _charge(n: int) -> None:
    budget = _local.budget
    if budget is not None:
        budget.left -= n
        if budget.left < 0:
            raise _over()


def _charge_result(value: Any) -> Any:
    if isinstance(value, str | list | tuple | dict):
        _charge(len(value))
    return value


def _size(value: Any) -> int:
    """An upper estimate of ``len(str(value))`` (or its JSON), stopping once over the
    budget left: what turning ``value`` into text would build."""
    budget = _budget()
    limit = budget.left if budget is not None else RENDER_CHARS
    total, stack, steps = 0, [value], 0
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
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


def _check_ints(args: Iterable[Any]) -> None:
    """A width or count argument larger than the budget left builds too much."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > 0:
            _need(arg)


_DIGITS = re.compile(r"\d+")


def _check_format(text: str) -> None:
    """A width inside a format string (``'%999999999s'``, ``'{:>999999999}'``)."""
    for digits in _DIGITS.findall(text):
        if len(digits) > 12:
            raise _over()
        _need(int(digits))


#: Filters and string methods whose number arguments are widths or counts of what
#: they build (``center(10**9)``, ``batch(10**9, 'x')``).
_WIDTHS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "batch",
                     "slice", "wordwrap", "truncate"})


def _check(name: str, value: Any, args: Sequence[Any], *, method: bool = False) -> None:
    """Refuse the filter or string method ``name`` on ``value`` with ``args`` when what it
    would build is over the budget left (for those whose result can be much larger
    than their arguments)."""
    if name in _WIDTHS:
        _check_ints(args)
    if name in ("tojson", "string", "pprint", "urlencode", "xmlattr", "list", "dictsort"):
        _need(_size(value) * (3 if name == "urlencode" else 1))
    elif name == "join":
        items, sep = (args[0], value) if method else (value, args[0] if args else "")
        if isinstance(items, list | tuple) and isinstance(sep, str):
            _need(_size(items) + len(sep) * len(items))
    elif name in ("format", "format_map") and isinstance(value, str):
        _check_format(value)
        if "*" in value:
            _check_ints(args)
        _need(len(value) + sum(_size(a) for a in args))
    elif not isinstance(value, str):
        return
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = value.count(old) if old else len(value) + 1
        _need(len(value) + hits * len(new))
    elif name == "indent":
        width = args[0] if args else 4
        width = len(width) if isinstance(width, str) else int(width or 0)
        _need(len(value) + (value.count("\n") + 1) * max(width, 0))
    elif name == "expandtabs":
        size = int(args[0]) if args else 8
        _need(len(value) + value.count("\t") * max(size, 0))


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


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes_arg = getattr(func, "jinja_pass_arg", None) is not None

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        rest = args[1:] if passes_arg else args
        if rest:
            _check(name, rest[0], [*rest[1:], *kwargs.values()])
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
        _local.budget = _Budget(getattr(_local, "seconds", RENDER_SECONDS), RENDER_CHARS)
        try:
            return super().render(*args, **kwargs)
        finally:
            _local.budget = None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a size and time budget per render (module doc)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _BoundedCodeGenerator
    template_class = _BoundedTemplate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("finalize", self._finalize)
        super().__init__(*args, **kwargs)
        self.globals["range"] = _range
        self.filters = _BoundedFilters(self.filters)
        dict.__setitem__(self.filters, _ITERATE, _iterate)

    @staticmethod
    def _finalize(value: Any) -> Any:
        # ``{{ value }}`` of a list or dict prints its repr: as large as its items.
        if not isinstance(value, str):
            _need(_size(value))
        return value

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
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                _need(len(seq) * max(times, 0))
        elif operator == "+" and isinstance(left, str | list | tuple) and \
                isinstance(right, str | list | tuple):
            _need(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            _check("format", left, right if isinstance(right, tuple) else (right,))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"{left} ** {right} in the chat template is over "
                                     f"{MAX_POWER_BITS:,} bits (synthq's limit)")
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

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        owner = getattr(__obj, "__self__", None)
        if owner is None:  # the sandbox's wrapper of str.format
            owner = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
        if isinstance(owner, str | list | tuple):
            _check(getattr(__obj, "__name__", ""), owner, [*args, *kwargs.values()],
                   method=True)
        return _charge_result(super().call(__context, __obj, *args, **kwargs))


class _BoundedFilters(dict[str, Any]):
    """The environment's filters, each wrapped by :func:`_bounded_filter` (also those a
    caller adds after, such as transformers' ``tojson``)."""

    def __init__(self, filters: dict[str, Any]) -> None:
        super().__init__()
        for name, func in filters.items():
            self[name] = func

    def __setitem__(self, name: str, func: Any) -> None:
        super().__setitem__(name, _bounded_filter(name, func))


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

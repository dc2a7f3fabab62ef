"""`--help` that reads at 80 columns: one row per option, its help beside it.

Typer draws each options panel as a table of six columns (long names, short names,
negative names twice, type, help) that rich shares out evenly when the terminal is
narrow: at 80 columns `synthq run --help` gave its help 17 characters, 298 lines in
all, and cut the example URL ``http://vllm:8000/v1`` to ``http://vllm:8000…``.
Here a panel is two columns: the names with their value (``--server, -s <url>``,
``--[no-]stream``) kept whole, and the help, which takes the rest of the width and
wraps between words, its default on the same line. Nothing else of Typer's help
changes (usage, description, command lists, errors).

:func:`install` swaps the panel function in; the CLI calls it when help is first drawn
(``synthq.cli._compact_help``), so a command run without ``--help`` imports neither
this module nor rich.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

__all__ = ["install", "names_cell", "help_cell"]

#: A value shown beside the names when at most this long; a longer one (a list of
#: choices) opens the help instead, so the names column stays narrow.
SHORT_METAVAR = 10

_CODE = re.compile(r"`([^`]+)`")


def names_cell(param: Any, ctx: Any) -> Text:
    """``--server, -s <url>``; ``--[no-]stream``; ``--keep-truncated/--drop-truncated``
    on two lines; an argument by its name (``JOB``)."""
    from rich.text import Text
    from typer.core import TyperArgument

    cell = Text(no_wrap=True, overflow="fold")
    if isinstance(param, TyperArgument):
        cell.append(param.display_name_raw, style="bold cyan")
        return cell
    longs = [o for o in param.opts if o.startswith("--")]
    shorts = [o for o in param.opts if not o.startswith("--")]
    negatives = list(getattr(param, "secondary_opts", ()))
    first = longs[0] if longs else (shorts[0] if shorts else param.name or "")
    if len(longs) == 1 and negatives == ["--no-" + first[2:]]:
        cell.append(f"--[no-]{first[2:]}", style="bold cyan")
        negatives = []
    else:
        cell.append(", ".join([*longs, *shorts]), style="bold cyan")
    metavar = _metavar(param, ctx)
    if metavar and len(metavar) <= SHORT_METAVAR:
        cell.append(" " + metavar, style="yellow")
    if negatives:
        cell.append("\n" + ", ".join(negatives), style="bold magenta")
    return cell


def _metavar(param: Any, ctx: Any) -> str | None:
    """The value an option takes as --help shows it (``<int>``; a repeatable option by
    its item, ``<str>`` for ``<list[str]>``), None for a flag."""
    shown = param.display_type_rich(ctx=ctx)  # type: ignore[attr-defined]
    if not shown:
        return None
    return _LIST.sub(r"<\1>", str(shown))


_LIST = re.compile(r"^<list\[(\w+)\]>$")


def help_cell(param: Any, ctx: Any) -> Text:
    """The help as one paragraph: a long value first, then the text (backticks shown as
    code), its default and ``[required]`` on the same line, wrapped between words."""
    from rich.text import Text
    from typer.core import TyperArgument, TyperOption

    cell = Text(overflow="fold")
    metavar = None if isinstance(param, TyperArgument) else _metavar(param, ctx)
    if metavar and len(metavar) > SHORT_METAVAR:
        cell.append(metavar + " ", style="yellow")
    text = " ".join((getattr(param, "help", None) or "").split())
    at = 0
    for code in _CODE.finditer(text):
        cell.append(text[at:code.start()])
        cell.append(code.group(1), style="bold")
        at = code.end()
    cell.append(text[at:])
    bounds = getattr(param, "_get_number_range_help_str", lambda: "")()
    if bounds:
        cell.append(f" [{bounds}]", style="dim")
    if isinstance(param, (TyperOption, TyperArgument)):
        default = _default(param, ctx)
        if default:
            cell.append(f" [default: {default}]", style="dim")
    if param.required:
        cell.append(" [required]", style="dim red")
    return cell


def _default(param: Any, ctx: Any) -> str:
    """The default as Typer words it, or "" where none is shown; ``on``/``off`` for a
    ``--[no-]flag``."""
    value = param._extract_default_help_str(ctx=ctx)
    as_text = isinstance(param.show_default, str)
    if not as_text and (value is None or not (param.show_default or ctx.show_default)):
        return ""
    longs = [o for o in param.opts if o.startswith("--")]
    if (len(longs) == 1 and getattr(param, "secondary_opts", None) == ["--no-" + longs[0][2:]]
            and isinstance(value, bool)):
        return "on" if value else "off"
    return str(param._get_default_string(ctx=ctx, show_default_is_str=as_text,
                                         default_value=value))


def _print_options_panel(*, name: str, params: list[Any], ctx: Any,
                         markup_mode: Any, console: Console) -> None:
    """Typer's ``rich_utils._print_options_panel`` in two columns (see the module)."""
    del markup_mode  # the help is read as plain text with `code`, in every mode
    if not params:
        return
    from rich import box
    from rich.panel import Panel
    from rich.table import Table

    table = Table(show_header=False, box=None, expand=True, pad_edge=False, padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for param in params:
        table.add_row(names_cell(param, ctx), help_cell(param, ctx))
    console.print(Panel(table, border_style="dim", title=name, title_align="left",
                        box=box.ROUNDED))


def install() -> None:
    """Draw Typer's options panels with :func:`_print_options_panel` from now on (called
    by the CLI when help is first drawn: Typer imports ``rich_utils`` only then)."""
    from typer import rich_utils

    rich_utils._print_options_panel = _print_options_panel  # type: ignore[assignment]

"""The CLI reference (docs/cli.md), written from the CLI itself so that it cannot drift.

Two ways in:

* a MkDocs hook (``hooks:`` in mkdocs.yml): every ``mkdocs build`` or ``serve`` adds the
  page ``cli.md``, made from the Typer app at that moment; nothing is committed, so no
  copy can go stale;
* ``python scripts/cli_reference.py [OUT]``: the same Markdown on stdout (or in OUT), to
  read it without building the site.

It walks the Click command Typer builds (``typer.main.get_command``), so every command,
group, argument and option ``synthq --help`` shows is here, with the help text and
default that ``--help`` prints (the same ``get_help_record``). A job setting's ``--help``
is a one-line brief that points here, so the page adds the setting's whole explanation
below it (:attr:`synthq.spec.jobspec.Setting.help`, the API schema's description too).
"""

from __future__ import annotations

import re
import sys
from typing import Any

__all__ = ["render", "on_files"]

#: What the page says about itself, above the commands.
INTRO = """\
# CLI reference

Every `synthq` command, argument and option, written from the CLI itself (the Typer
app) each time the docs are built, by `scripts/cli_reference.py`: what
`synthq COMMAND --help` prints, as one page. The guides explain when to use what:
[generating data](generation.md), [training data](data.md),
[training](training.md), [capture](capture.md), [operations](operations.md).
"""

_CODE = re.compile(r"(`[^`]*`)")


def _text(help_text: str | None) -> str:
    """A help text as Markdown: the app's help is Markdown already (Typer's
    ``rich_markup_mode="markdown"``), but ``<`` and ``>`` outside code spans (a default
    such as ``<think>``) would be read as HTML tags and vanish."""
    if not help_text:
        return ""
    pieces = _CODE.split(help_text.strip())
    for i in range(0, len(pieces), 2):  # even pieces lie outside code spans
        pieces[i] = pieces[i].replace("<", "&lt;").replace(">", "&gt;")
    return "".join(pieces)


def _one_line(help_text: str | None) -> str:
    """A help text on one line, for a list item (paragraphs joined)."""
    return " ".join(_text(help_text).split())


_DEFAULT = re.compile(r" \[default: [^]]*\]")


def _setting_help(param: Any) -> str:
    """The whole explanation of a job setting's option (``synthq.spec.jobspec.BY_NAME``), where
    it says more than the brief ``--help`` shows; "" for any other option. The option is
    the setting's only if its help is one the setting gives (synthq.cli.options._help):
    another command's option of the same name (``synthq simulate --model``) is not."""
    from synthq.spec.jobspec import BY_NAME

    s = BY_NAME.get(param.name or "")
    if s is None or not s.help or not getattr(param, "help", None):
        return ""
    shown = param.help.removesuffix(" [default: the job's]")
    if shown == s.requeue_help:  # a requeue's own words: they say more than the setting's
        return ""
    own = {s.help, s.help + (f" [default: {s.omitted}]" if s.omitted else ""),
           s.brief, _DEFAULT.sub("", s.brief)}
    if shown not in own:
        return ""
    said = " ".join(_DEFAULT.sub("", shown).split())
    return "" if " ".join(s.help.split()) == said else _one_line(s.help)


def _params(command: Any, ctx: Any) -> list[str]:
    """One list item per argument and option, as ``--help`` shows it; a job setting's
    item goes on with its whole explanation, a paragraph of its own."""
    lines = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:  # an argument Typer shows no help for
            record = (param.human_readable_name, "")
        names, help_text = record
        line = f"- `{names}`"
        if help_text:
            line += f": {_one_line(help_text)}"
        full = _setting_help(param)
        if full:
            line += f"\n\n    {full}\n"
        lines.append(line)
    return lines


def _command(command: Any, ctx: Any, path: str, out: list[str]) -> None:
    """The section of ``path`` (``synthq run``), then those of its subcommands."""
    level = "#" * min(path.count(" ") + 2, 4)
    out.append(f"{level} `{path}`\n")
    if command.help:
        out.append(_text(command.help) + "\n")
    pieces = " ".join(command.collect_usage_pieces(ctx))
    out.append(f"```\n{path} {pieces}\n```\n")
    params = _params(command, ctx)
    if params:
        out.append("\n".join(params) + "\n")
    subcommands = getattr(command, "list_commands", None)
    for name in subcommands(ctx) if subcommands else []:
        sub = command.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
        _command(sub, sub_ctx, f"{path} {name}", out)


def render() -> str:
    """The whole page, from the app as it is now."""
    import typer.main

    from synthq.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="synthq")  # Typer's own Click
    out = [INTRO]
    _command(root, ctx, "synthq", out)
    return "\n".join(out)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add ``cli.md``, generated now, to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "cli.md", content=render()))
    return files


if __name__ == "__main__":
    text = render()
    if len(sys.argv) > 1:
        from pathlib import Path

        Path(sys.argv[1]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)

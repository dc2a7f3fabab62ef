"""`--help` reads at 80 columns: `synthq run --help` fits in 80 lines (it was 298, with a
17-character help column), no example URL is cut (`http://vllm:8000…` hid the `/v1`),
and every command's options keep a help column wide enough to read. In-process
(Typer's CliRunner), so it stays in the fast tier."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

URL = re.compile(r"https?://[^\s`'\"),\]]+")


def _commands() -> list[list[str]]:
    """Every command and subcommand, as its words (``["db", "upgrade"]``)."""
    from synthq.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="synthq")
    out: list[list[str]] = [[]]
    for name in root.list_commands(ctx):  # type: ignore[attr-defined]
        command = root.get_command(ctx, name)  # type: ignore[attr-defined]
        out.append([name])
        if hasattr(command, "list_commands"):
            sub_ctx = command.context_class(command, info_name=name, parent=ctx)
            out += [[name, sub] for sub in command.list_commands(sub_ctx)]
    return out


def _help(words: list[str], columns: int) -> str:
    from synthq.cli import app

    result = CliRunner().invoke(app, [*words, "--help"],
                                env={"COLUMNS": str(columns), "TERMINAL_WIDTH": None})
    assert result.exit_code == 0, result.output
    return result.output


def test_run_help_fits_in_80_lines_at_80_columns() -> None:
    text = _help(["run"], 80)
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 80, f"{len(lines)} lines:\n{text}"
    assert max(len(line) for line in lines) <= 80
    # Grouped: the options that make a job first, then panels by what they change.
    panels = re.findall(r"╭─ ([^─]+?) ─", text)
    assert panels == ["Options", "Generation", "Calls and retries", "Load and cost",
                      "Training data"], panels
    # Each option on one row, its help beside it (not a 17-character column).
    assert re.search(r"│ --max-tokens <int> +max_tokens per answer\. \[default: 4096\] +│",
                     text), text
    assert "docs/cli.md" in text  # where the long explanations are


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w) or "synthq")
def test_no_url_is_cut_and_the_help_column_is_readable(words: list[str]) -> None:
    """Each URL that --help shows on a wide terminal is whole on one line at 80 columns,
    no option's help starts right of column 45 (Typer's table gave it 17 columns), and
    the whole help fits in 80 lines (train's was 176, enqueue's 309)."""
    wide, narrow = _help(words, 400), _help(words, 80)
    assert len(narrow.rstrip("\n").splitlines()) <= 80, narrow
    assert "…" not in narrow.replace("…/v1", ""), narrow
    for url in URL.findall(wide):
        assert url in narrow, (url, narrow)
    for line in narrow.splitlines():
        row = re.match(r"│ (-\S.*?\S)  +(\S)", line)
        if row:
            assert row.start(2) <= 45, line

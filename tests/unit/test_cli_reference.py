"""The docs' CLI reference is made from the CLI itself at each build, so it cannot drift:
every command and option is on the page, the site's build runs the generator, and no
hand-kept copy of the page exists to go stale."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import typer.main

REPO = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cli_reference",
                                                  REPO / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_and_option_is_on_the_page() -> None:
    from synthq.cli import app

    page = _generator().render()
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="synthq")
    seen = 0
    for name in root.list_commands(ctx):  # type: ignore[attr-defined]
        command = root.get_command(ctx, name)  # type: ignore[attr-defined]
        commands = [(f"synthq {name}", command)]
        if hasattr(command, "list_commands"):
            sub_ctx = command.context_class(command, info_name=name, parent=ctx)
            commands += [(f"synthq {name} {sub}", command.get_command(sub_ctx, sub))
                         for sub in command.list_commands(sub_ctx)]
        for path, cmd in commands:
            assert f"`{path}`" in page, path
            for param in cmd.params:
                for opt in param.opts:
                    if opt.startswith("-"):
                        assert opt in page, (path, opt)
                        seen += 1
    assert seen > 150  # every option of every command, not a handful
    assert "`synthq db upgrade`" in page and "`synthq testing real-target`" in page


def test_the_page_shows_each_help_text_and_default() -> None:
    page = _generator().render()
    run = page.split("### `synthq run`", 1)[1].split("\n### ", 1)[0]
    assert "Enqueue (or resume) a job and process it to the end" in run
    assert re.search(r"`--max-tokens <int>`: max_tokens per answer\. \[default: 4096\]", run)
    # A default such as <think> is escaped outside code spans, not lost as an HTML tag.
    assert "&lt;think&gt;" in run


def test_the_site_build_generates_it_and_no_copy_is_kept() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^hooks:\n  - scripts/cli_reference\.py$", config, re.M)
    assert "cli.md" in config  # in the nav
    assert not (REPO / "docs" / "cli.md").exists(), "docs/cli.md is generated at build time"


def test_a_job_settings_whole_explanation_follows_its_brief() -> None:
    """--help shows a job setting's one-line brief and points to this page for the rest:
    the page carries the setting's whole text (synthq.spec.jobspec's help), under the brief."""
    from synthq.spec.jobspec import BY_NAME

    page = _generator().render()
    run = page.split("### `synthq run`", 1)[1].split("\n### ", 1)[0]
    inflight = BY_NAME["inflight"]
    assert inflight.brief and inflight.brief != inflight.help
    item = run.split("- `--inflight <N|auto>`: ", 1)[1].split("\n- ", 1)[0]
    assert item.startswith(inflight.brief)
    assert f"\n\n    {' '.join(inflight.help.split())}\n" in item
    capture = page.split("### `synthq capture`", 1)[1].split("\n### ", 1)[0]
    assert " ".join(BY_NAME["capture_dtype"].help.split()) in capture
    # Another command's option of a setting's name is not that setting.
    simulate = page.split("### `synthq simulate`", 1)[1].split("\n### ", 1)[0]
    model = simulate.split("- `--model <str>`: ", 1)[1].split("\n- ", 1)[0]
    assert "\n\n" not in model

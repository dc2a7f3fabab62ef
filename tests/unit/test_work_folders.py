"""The walkthroughs' work folders leave a clone clean: the folders that `synthq testing`
writes (targets, prompt sets) are named, in its help and in the docs, inside a folder git
ignores (synthq-data/), or outside the clone (the real-model steps left `smol/` and
`prompts/` untracked in it). In process: reads .gitignore, the docs and the help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
WRITES = re.compile(r"synthq testing (?:tiny-target|real-target|doc-prompts|tiny-prompts) "
                    r"([^\s`'\"&;)]+)")


def _ignored_folders() -> set[str]:
    """Top folders of the clone that .gitignore ignores (``name/`` or ``/name/`` lines)."""
    out = set()
    for line in (REPO / ".gitignore").read_text().splitlines():
        line = line.strip()
        if re.fullmatch(r"/?[\w.-]+/", line):
            out.add(line.strip("/"))
    return out


def _leaves_clone_clean(path: str) -> bool:
    if path.startswith(("/", "~", "$")) or path.isupper():  # outside, or a placeholder (DIR)
        return True
    first = Path(path).parts[0] if Path(path).parts else ""
    return first in _ignored_folders()


@pytest.mark.parametrize("command", ["tiny-target", "tiny-prompts", "real-target",
                                     "doc-prompts"])
def test_the_help_examples_write_where_git_ignores(command: str) -> None:
    from synthq.cli import app

    result = CliRunner().invoke(app, ["testing", command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    paths = WRITES.findall(" ".join(result.output.replace("│", " ").split()))
    assert paths, result.output
    for path in paths:
        assert _leaves_clone_clean(path), (command, path)


def test_the_docs_walkthroughs_write_where_git_ignores() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for page in pages:
        for path in WRITES.findall(page.read_text()):
            found.append(path)
            assert _leaves_clone_clean(path), (page.name, path)
    assert found  # the real-model and tiny-target walkthroughs are there
    # The names older docs used are ignored too, should one run them in the clone.
    assert {"smol", "prompts", "tiny", "tiny-prompts", "synthq-data"} <= _ignored_folders()

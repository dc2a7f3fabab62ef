"""The README stays a front door: short, in a newcomer's order, no internal history, every
link it gives resolving (the reference lives in docs/, which `mkdocs build --strict`
checks)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_it_is_short_and_in_a_newcomers_order() -> None:
    assert len(README.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", README, re.M)
    order = ["Install", "The demo", "Your own vLLM", "A real model on a CPU, in minutes",
             "Distributed mode", "The ten most common errors", "Read on"]
    assert [h for h in headings if h in order] == order, headings


def test_it_names_no_internal_issue() -> None:
    assert not re.search(r"\bissues? \d+", README, re.I)


def test_its_demo_and_test_commands_are_the_ones_ci_runs() -> None:
    assert "bash scripts/demo.sh    # " in README
    assert "bash scripts/test.sh    # " in README
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh --fast" in README


def test_every_link_resolves() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert len(links) > 10
    for link in links:
        assert (REPO / link).exists(), link


def test_the_ten_errors_are_ten() -> None:
    section = README.split("## The ten most common errors", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) == 10, rows

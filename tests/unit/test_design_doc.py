"""The code's references to the design point at docs/design.md, and at what it has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_design_references_resolve() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    invariants = {int(n) for n in re.findall(r"^(\d+)\. \*\*", design, re.M)}
    sections = set(re.findall(r"^## (.+)$", design, re.M))
    assert invariants == set(range(1, 10))
    cited = 0
    for folder in ("synthq", "worker", "api"):
        for path in sorted((REPO / folder).rglob("*.py")):
            code = path.read_text()
            assert "DESIGN" not in code, f"{path}: cite docs/design.md, not DESIGN"
            for n in re.findall(r"docs/design\.md, invariant (\d+)", code):
                assert int(n) in invariants, (path, n)
                cited += 1
            for name in re.findall(r'docs/design\.md, "([^"]+)"', code):
                assert name in sections, (path, name)
                cited += 1
    assert cited >= 5

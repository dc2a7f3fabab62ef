"""pyproject.toml declares every package that synthq, worker and api import (every import
statement, those inside functions too), in the extra its code needs: not one that merely
arrives through another package (httpx2 and httpcore2 came only through openai)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"synthq", "worker", "api", "__future__"}
#: Which extras (besides the base dependencies) the code under a folder may rely on.
# synthq/testing/tiny.py builds the tiny target with torch (``synthq testing``).
EXTRAS = {"api/": {"api"}, "synthq/training/": {"train"}, "synthq/testing/": {"train"},
          # captured features for the peers' trainers: torch/safetensors, datasets
          "synthq/training/export_features.py": {"train", "hf"}}
#: Imports behind a check that says which extra to install (module → the extra).
GUARDED = {"datasets": "hf"}


def imports(path: Path) -> set[str]:
    """The top-level names of the absolute imports in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - FIRST_PARTY - set(sys.stdlib_module_names)


def normalized(requirement: str) -> str:
    """``psycopg[binary]>=3.1`` → ``psycopg`` (PEP 503 names: lower case, ``-``)."""
    name = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """Extra ("" for the base dependencies) → the distributions it declares."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = {"": {normalized(r) for r in project["dependencies"]}}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out[extra] = {normalized(r) for r in reqs}
    return out


def missing(root: Path = REPO) -> list[str]:
    """``file: module (distribution)`` for each import no allowed requirement covers."""
    dists = packages_distributions()
    have = declared()
    found = []
    for folder in ("synthq", "worker", "api"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            allowed = set(have[""])
            for prefix, extras in EXTRAS.items():
                if rel.startswith(prefix):
                    allowed |= {d for e in extras for d in have.get(e, set())}
            for module in sorted(imports(path)):
                if module in GUARDED:
                    allowed_here = allowed | have.get(GUARDED[module], set())
                else:
                    allowed_here = allowed
                names = {normalized(d) for d in dists.get(module, [module])}
                if not names & allowed_here:
                    found.append(f"{rel}: {module} ({', '.join(sorted(names))})")
    return found


def test_every_imported_package_is_declared() -> None:
    assert missing() == [], "imported but not declared in pyproject.toml (for that code)"


def test_the_check_sees_a_package_that_only_arrives_through_another(tmp_path: Path) -> None:
    for folder in ("synthq", "worker", "api"):
        (tmp_path / folder).mkdir()
    (tmp_path / "synthq" / "a.py").write_text(
        "import os\nimport httpx\nfrom synthq import b\n\n"
        "def f():\n    import anyio.abc\n")
    (tmp_path / "api" / "b.py").write_text("import fastapi\nimport torch\n")
    assert missing(tmp_path) == ["synthq/a.py: anyio (anyio)", "api/b.py: torch (torch)"]

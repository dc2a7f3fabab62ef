"""Real prompts, offline: the docstrings of Python's own standard library.

Text nobody on this project wrote, present on every machine that runs synthq (the
interpreter's ``Lib/`` folder), and the same for one Python version: the prompt
set of the real-target pipeline (``synthq testing doc-prompts DIR``,
``scripts/check_real.py``). Each prompt is one docstring's opening paragraphs,
verbatim, as the user's message (a user pasting documentation and waiting for the
model's answer). Read with :mod:`ast`, nothing imported.

The split is fixed by content: a prompt is held out when the first byte of its
text's SHA-256 is below 26 (about a tenth), so it does not move when the
standard library gains or loses a docstring elsewhere. The order is the hash's
too (a shuffle that every run repeats).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DocPrompt", "doc_prompts", "write_prompt_set", "HELD_OUT_BELOW"]

#: A prompt is held out when its hash's first byte is below this (26/256: ~10 %).
HELD_OUT_BELOW = 26
#: Docstrings with fewer words say too little to answer.
MIN_WORDS = 12
#: A prompt is cut at a paragraph end before this many characters.
MAX_CHARS = 700
#: Folders of the standard library that are tests, demos or vendored code.
SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
        "ensurepip", "turtledemo", "__pycache__", "pydoc_data")


@dataclass(frozen=True)
class DocPrompt:
    id: str  # doc-<first 12 hex of the text's sha256>
    text: str
    source: str  # Lib-relative path:qualified name
    held_out: bool

    def row(self) -> dict[str, Any]:
        """A dataset row in OpenAI ``messages`` form (what ``synthq enqueue`` reads)."""
        return {"id": self.id, "messages": [{"role": "user", "content": self.text}],
                "source": self.source}


def _opening(doc: str) -> str | None:
    """The docstring's first paragraphs up to :data:`MAX_CHARS` (whole paragraphs; the
    first one cut at a sentence end when it alone is longer), or None when too short."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    out = ""
    for p in paragraphs:
        if out and len(out) + 2 + len(p) > MAX_CHARS:
            break
        out = f"{out}\n\n{p}" if out else p
    if len(out) > MAX_CHARS:
        cut = out.rfind(". ", 0, MAX_CHARS)
        out = out[:cut + 1] if cut > 0 else out[:MAX_CHARS]
    if len(out.split()) < MIN_WORDS or ">>>" in out:
        return None
    return out


def _docstrings(tree: ast.Module) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module, its classes and functions, in source
    order; private names (one leading underscore) skipped."""
    found: list[tuple[str, str]] = []
    if doc := ast.get_docstring(tree):
        found.append(("", doc))

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_") and not child.name.startswith("__"):
                    continue
                name = f"{prefix}{child.name}"
                if doc := ast.get_docstring(child):
                    found.append((name, doc))
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{name}.")
    walk(tree, "")
    return found


def doc_prompts(lib: Path | None = None) -> list[DocPrompt]:
    """Every prompt of the standard library at ``lib`` (default: this interpreter's),
    deduplicated by text, ordered by their hash."""
    lib = lib or Path(sysconfig.get_paths()["stdlib"])
    seen: dict[str, DocPrompt] = {}
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(part in SKIP for part in rel.parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(rel))
        except (SyntaxError, ValueError, OSError):
            continue
        for name, doc in _docstrings(tree):
            text = _opening(doc)
            if text is None:
                continue
            digest = hashlib.sha256(text.encode()).digest()
            key = digest.hex()[:12]
            if key not in seen:
                seen[key] = DocPrompt(f"doc-{key}", text, f"{rel.as_posix()}:{name or '-'}",
                                      digest[0] < HELD_OUT_BELOW)
    return [seen[k] for k in sorted(seen)]


def write_prompt_set(out: Path, *, train: int | None = None,
                     held_out: int | None = None) -> dict[str, Any]:
    """``out/train.jsonl`` and ``out/held_out.jsonl`` (the first ``train`` and
    ``held_out`` of each split, all by default) and ``out/manifest.json`` (source,
    counts, the set's hash). Returns the manifest."""
    prompts = doc_prompts()
    splits = {"train": [p for p in prompts if not p.held_out][:train],
              "held_out": [p for p in prompts if p.held_out][:held_out]}
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    for name, rows in splits.items():
        lines = "".join(json.dumps(p.row()) + "\n" for p in rows)
        digest.update(lines.encode())
        (out / f"{name}.jsonl").write_text(lines)
    manifest = {"source": f"docstrings of Python {sys.version.split()[0]}'s standard "
                f"library ({sysconfig.get_paths()['stdlib']})",
                "available": {"train": sum(not p.held_out for p in prompts),
                              "held_out": sum(p.held_out for p in prompts)},
                "train": len(splits["train"]), "held_out": len(splits["held_out"]),
                "sha256": digest.hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest

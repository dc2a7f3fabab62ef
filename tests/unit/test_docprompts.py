"""The real prompt set: the standard library's docstrings, a split fixed by content."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from synthq.testing.docprompts import HELD_OUT_BELOW, doc_prompts, write_prompt_set

#: Each parses the whole standard library (about 10 s on 2 cores): outside the fast tier.
pytestmark = pytest.mark.slow


def test_prompts_are_real_docstrings_with_a_content_fixed_split(tmp_path: Path) -> None:
    prompts = doc_prompts()
    held = [p for p in prompts if p.held_out]
    assert len(prompts) > 2000 and 0.05 < len(held) / len(prompts) < 0.15
    assert len({p.text for p in prompts}) == len(prompts)  # deduplicated
    for p in prompts:
        digest = hashlib.sha256(p.text.encode()).digest()
        assert p.id == f"doc-{digest.hex()[:12]}"
        assert p.held_out == (digest[0] < HELD_OUT_BELOW)
        assert len(p.text.split()) >= 12 and ">>>" not in p.text
    # Each is verbatim text of the file it names.
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    for p in prompts[:50]:
        source = (lib / p.source.split(":")[0]).read_text(errors="replace")
        first_line = p.text.splitlines()[0].strip()
        assert first_line in source, (p.source, first_line)

    # A smaller library (a subset of the files) keeps each prompt's split.
    sub = tmp_path / "lib"
    sub.mkdir()
    for name in ("json", "email"):
        for f in (lib / name).rglob("*.py"):
            dest = sub / f.relative_to(lib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read_bytes())
    by_id = {p.id: p.held_out for p in prompts}
    subset = doc_prompts(sub)
    assert subset and all(by_id[p.id] == p.held_out for p in subset)


def test_written_set_is_deterministic(tmp_path: Path) -> None:
    a = write_prompt_set(tmp_path / "a", train=30, held_out=5)
    b = write_prompt_set(tmp_path / "b", train=30, held_out=5)
    assert a["sha256"] == b["sha256"] and (a["train"], a["held_out"]) == (30, 5)
    rows = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(r["messages"][0]["role"] == "user" for r in rows)
    held = {json.loads(line)["id"] for line in
            (tmp_path / "a" / "held_out.jsonl").read_text().splitlines()}
    assert not held & {r["id"] for r in rows}
    assert "standard library" in a["source"]

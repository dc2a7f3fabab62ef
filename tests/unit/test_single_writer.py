"""states.py is the only writer of samples, attempts and job states (a grep, as the rule says)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Writes that belong in synthq/states.py only.
FORBIDDEN = re.compile(
    r"update\(\s*(Sample|Attempt|Job)\b|insert\(\s*(Sample|Attempt)\b|delete\(\s*(Sample|Attempt)\b"
    r"|\.state\s*=[^=]|session\.add\(\s*(Sample|Attempt)\(")
#: New samples are created by enqueue (a COPY, or an INSERT of pending and skipped rows);
#: every change to a sample after that is states.py's.
CREATES_SAMPLES = (Path("synthq/enqueue.py"), re.compile(r"insert\(\s*Sample\b"))


def offenders() -> list[str]:
    found = []
    for folder in ("synthq", "worker", "api"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "synthq" / "states.py":
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if path.relative_to(ROOT) == CREATES_SAMPLES[0] and \
                        CREATES_SAMPLES[1].search(code) and "update(" not in code:
                    continue
                if FORBIDDEN.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return found


def test_only_states_writes_samples_attempts_and_job_states() -> None:
    assert offenders() == []


def test_the_rule_can_fail(tmp_path: Path) -> None:
    assert FORBIDDEN.search("s.execute(update(Sample).where(Sample.id == 1))")
    assert FORBIDDEN.search("session.execute(insert(Attempt).values(**row))")
    assert FORBIDDEN.search("    job.state = JobState.PAUSED")
    assert not FORBIDDEN.search("if job.state == JobState.PAUSED:")

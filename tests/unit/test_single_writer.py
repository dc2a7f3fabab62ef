"""states.py is the only writer of samples, attempts and job states (a grep, as the rule says)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Writes that belong in synthq/states.py only.
FORBIDDEN = re.compile(
    r"update\(\s*(Sample|Attempt|Job)\b|insert\(\s*(Sample|Attempt)\b|delete\(\s*(Sample|Attempt)\b"
    r"|\.state\s*=[^=]|session\.add\(\s*(Sample|Attempt)\(")
#: New samples are created by enqueue's bulk writer (a COPY, or an INSERT of pending and
#: skipped rows); every change to a sample after that is states.py's.
CREATES_SAMPLES = (Path("synthq/samplecopy.py"), re.compile(r"insert\(\s*Sample\b"))


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


# -- job settings: states.update_job is their one writer; the API writes through service.py ---

#: The names a Job row goes by in the code (``j`` in a CLI callback, ``job`` elsewhere).
JOB_NAMES = {"j", "job"}


def settings_writes(path: Path) -> list[str]:
    """Assignments to a Job column on ``j``/``job`` and ``setattr(job, ...)`` in a module."""
    import ast

    from synthq.models import Job

    columns = set(Job.__mapper__.attrs.keys())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple)
                                                          else [t])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "setattr" and node.args and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in JOB_NAMES:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in columns and \
                    isinstance(t.value, ast.Name) and t.value.id in JOB_NAMES:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(t)} = ...")
    return found


def test_job_settings_are_written_by_states_only(tmp_path: Path) -> None:
    found = [w for folder in ("synthq", "worker", "api")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if path != ROOT / "synthq" / "states.py" for w in settings_writes(path)]
    assert found == []
    # The check can fail: the two writes it replaced.
    bad = tmp_path / "bad.py"
    bad.write_text("def f(j, job, changes):\n"
                   "    j.train_when, j.train_target = 'ready', 'x'\n"
                   "    for name, value in changes.items():\n"
                   "        setattr(job, name, value)\n"
                   "    job.tokenize_version += 1\n")
    assert len(settings_writes(bad)) == 4


def test_the_api_writes_through_service_only() -> None:
    """The REST API's routes call synthq.service, never synthq.states itself."""
    for path in sorted((ROOT / "api").rglob("*.py")):
        code = path.read_text()
        assert not re.search(r"from synthq import [^\n]*\bstates\b|synthq\.states\b|\bstates\.",
                             code), path

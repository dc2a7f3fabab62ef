"""states.py is the only writer of samples and attempts, jobs.py of job states (a grep, as the
rule says)."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The one writer of samples and attempts, and the one writer of jobs' states and settings.
SAMPLE_WRITER, JOB_WRITER = Path("synthq/queue/states.py"), Path("synthq/queue/jobs.py")
#: Writes that belong in synthq/queue/states.py (samples, attempts) or jobs.py (jobs) only.
FORBIDDEN = re.compile(
    r"update\(\s*(Sample|Attempt|Job)\b|insert\(\s*(Sample|Attempt)\b|delete\(\s*(Sample|Attempt)\b"
    r"|\.state\s*=[^=]|session\.add\(\s*(Sample|Attempt)\(")
#: New samples are created by enqueue's bulk writer (a COPY, or an INSERT of pending and
#: skipped rows); every change to a sample after that is states.py's.
CREATES_SAMPLES = (Path("synthq/jobs/samplecopy.py"), re.compile(r"insert\(\s*Sample\b"))


def offenders() -> list[str]:
    found = []
    for folder in ("synthq", "worker", "api"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT) in (SAMPLE_WRITER, JOB_WRITER):
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


def test_the_two_writers_keep_to_their_tables() -> None:
    """states.py writes no job row, jobs.py no sample or attempt row."""
    jobs_only = re.compile(r"update\(\s*Job\b")
    samples_only = re.compile(r"(update|insert|delete)\(\s*(Sample|Attempt)\b"
                              r"|session\.add\(\s*(Sample|Attempt)\(")
    for path, theirs in ((SAMPLE_WRITER, jobs_only), (JOB_WRITER, samples_only)):
        code = [line.split("#", 1)[0] for line in (ROOT / path).read_text().splitlines()]
        assert not [c for c in code if theirs.search(c)], path
    assert samples_only.search("session.execute(insert(Attempt), rows)")
    assert jobs_only.search("update(Job).where(Job.id == job_id)")


def test_the_rule_can_fail(tmp_path: Path) -> None:
    assert FORBIDDEN.search("s.execute(update(Sample).where(Sample.id == 1))")
    assert FORBIDDEN.search("session.execute(insert(Attempt).values(**row))")
    assert FORBIDDEN.search("    job.state = JobState.PAUSED")
    assert not FORBIDDEN.search("if job.state == JobState.PAUSED:")


# -- job settings: jobs.update_job is their one writer; the API writes through service.py -----

#: The names a Job row goes by in the code (``j`` in a CLI callback, ``job`` elsewhere).
JOB_NAMES = {"j", "job"}


def settings_writes(path: Path) -> list[str]:
    """Assignments to a Job column on ``j``/``job`` and ``setattr(job, ...)`` in a module."""
    import ast

    from synthq.store.models import Job

    columns = set(Job.__mapper__.attrs.keys())
    found = []
    for node, attr in attribute_writes(ast.parse(path.read_text(), str(path)), JOB_NAMES,
                                       columns):
        text = ast.unparse(node) if attr == "setattr" else f"{attr} = ..."
        found.append(f"{path.name}:{node.lineno}: {text}")
    return found


def attribute_writes(tree: ast.AST, names: set[str] | frozenset[str], columns: set[str]
                     ) -> list[tuple[ast.AST, str]]:
    """(node, what) for each write in ``tree`` to a column of a variable named in
    ``names``: ``NAME.column = ...`` (plain, augmented, annotated, or in a tuple), as
    ``"NAME.column"``; and ``setattr(NAME, ...)``, as ``"setattr"``."""
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple)
                                                          else [t])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and \
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names:
            found.append((node, "setattr"))
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in columns and \
                    isinstance(t.value, ast.Name) and t.value.id in names:
                found.append((node, ast.unparse(t)))
    return found


def test_job_settings_are_written_by_states_only(tmp_path: Path) -> None:
    found = [w for folder in ("synthq", "worker", "api")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if path.relative_to(ROOT) != JOB_WRITER for w in settings_writes(path)]
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
    """The REST API's routes call synthq.app.service, never synthq.queue.states (or
    synthq.queue.jobs) itself."""
    for path in sorted((ROOT / "api").rglob("*.py")):
        code = path.read_text()
        assert not re.search(r"from synthq import [^\n]*\bstates\b|synthq\.states\b|\bstates\."
                             r"|from synthq\.queue import [^\n]*\bjobs\b|synthq\.queue\.jobs\b",
                             code), path


# -- captures and training runs: each kind's states module is the one writer of its rows ---

#: The one writer of each kind's rows besides synthq.queue.ledger, whose transitions take the
#: kind's model as a value and never name it.
KIND_WRITERS = {"Capture": Path("synthq/queue/capture_states.py"),
                "TrainingRun": Path("synthq/queue/run_states.py")}
#: Writes outside the writer, known and owed to it (issue 42): (module, column). The test
#: fails when one is gone too, so the entry goes with its fix.
KNOWN_KIND_WRITES: set[tuple[str, str]] = set()


def _statement_writes(model: str) -> re.Pattern[str]:
    """Core writes and ORM inserts of ``model``'s table, by name."""
    return re.compile(rf"(update|insert|delete)\(\s*{model}\b|session\.add\(\s*{model}\("
                      rf"|(?<![\w.]){model}\(")


def _loaders(model: str) -> set[str]:
    """The package's functions that return a row of ``model`` (``-> TrainingRun``)."""
    import ast

    names = set()
    for path in sorted((ROOT / "synthq").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.returns is not None and \
                    ast.unparse(node.returns) == model:
                names.add(node.name)
    return names


def row_writes(path: Path, model: Any, loaders: Collection[str] = ()) -> list[tuple[int, str]]:
    """ORM writes to rows of ``model`` in a module: ``name.column = ...`` (or ``setattr``)
    on a name bound to ``s.get(Model, ...)``, ``s.get_one(...)``, a ``select(Model)`` or a
    call of one of ``loaders``. Returns (line, column)."""
    import ast

    model_name = model.__name__
    columns = set(model.__mapper__.attrs.keys())

    def loads(expr: ast.AST) -> bool:
        for call in ast.walk(expr):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = ast.unparse(call.args[0]) if call.args else ""
            if (name in ("get", "get_one", "select") and first == model_name) or \
                    name in loaders:
                return True
        return False

    tree = ast.parse(path.read_text(), str(path))
    rows: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and loads(node.value):
            rows.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.For) and loads(node.iter):
            rows.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    found = [(node.lineno, what if what == "setattr" else what.split(".", 1)[1])
             for node, what in attribute_writes(tree, rows, columns)]
    return sorted(found)


def kind_offenders() -> set[tuple[str, str]]:
    """(module, what) for each write to captures or training runs outside their writer."""
    from synthq.store import models

    found = set()
    for model_name, writer in KIND_WRITERS.items():
        model = getattr(models, model_name)
        statements = _statement_writes(model_name)
        loaders = _loaders(model_name)
        for folder in ("synthq", "worker", "api"):
            for path in sorted((ROOT / folder).rglob("*.py")):
                rel = path.relative_to(ROOT)
                if rel in (writer, Path("synthq/store/models.py")):
                    continue
                for no, line in enumerate(path.read_text().splitlines(), 1):
                    if statements.search(line.split("#", 1)[0]):
                        found.add((str(rel), f"{no}: {line.strip()}"))
                found.update((str(rel), column) for _, column in
                             row_writes(path, model, loaders))
    return found


def test_only_their_states_modules_write_captures_and_training_runs() -> None:
    found = kind_offenders()
    assert found - KNOWN_KIND_WRITES == set()
    assert KNOWN_KIND_WRITES - found == set(), "fixed: drop them from KNOWN_KIND_WRITES"


def test_the_kind_rule_can_fail(tmp_path: Path) -> None:
    from synthq.store.models import Capture, TrainingRun

    assert _statement_writes("Capture").search("s.execute(update(Capture).values(x=1))")
    assert _statement_writes("TrainingRun").search("session.add(TrainingRun(job_id=1))")
    assert _statement_writes("TrainingRun").search("run = TrainingRun(job_id=1)")
    assert not _statement_writes("Capture").search("select(Capture.id).where(x)")
    assert not _statement_writes("Capture").search("claimed = capture_states.Capture(1)")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(s, ids):\n"
                   "    run = s.get(TrainingRun, 1)\n"
                   "    run.error, run.step = 'x', 2\n"
                   "    run.step += 1\n"
                   "    setattr(run, 'error', 'y')\n"
                   "    for cap in s.scalars(select(Capture).where(Capture.id.in_(ids))):\n"
                   "        cap.path = None\n"
                   "    made = new_run(s)\n"
                   "    made.output_dir = '/x'\n"
                   "    other = s.get(Job, 1)\n"
                   "    other.error = 'fine'\n")
    assert [c for _, c in row_writes(bad, TrainingRun, {"new_run"})] == \
        ["error", "step", "step", "setattr", "output_dir"]
    assert [c for _, c in row_writes(bad, Capture)] == ["path"]

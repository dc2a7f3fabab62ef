"""The import graph of synthq/, read from the source (every import statement, those inside
functions too): no cycle, and the data side (retokenize) never reaches the call module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name → file, for every module of ``package`` under ``root``."""
    found = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its file."""

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            # ``from synthq import states`` imports the module synthq.queue.states.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            found = resolve(target)
            if found is not None and found != name:
                yield found


def graph(root: Path = REPO, package: str = "synthq") -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def path_to(g: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest chain of imports from ``start`` to ``goal`` (None: it is not reached)."""
    came: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        v = todo.pop(0)
        if v == goal:
            chain = [v]
            while chain[-1] != start:
                chain.append(came[chain[-1]])
            return chain[::-1]
        for w in sorted(g[v]):
            if w not in came:
                came[w] = v
                todo.append(w)
    return None


def test_the_reader_sees_lazy_imports_and_cycles() -> None:
    """The reader on a package of its own: a cycle through an import inside a function."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "a.py").write_text("from pkg import b\n")
        (pkg / "b.py").write_text("def f():\n    from pkg.c import x\n")
        (pkg / "c.py").write_text("from . import a\nimport pkg.d\n")
        (pkg / "d.py").write_text("import os\n")
        g = graph(Path(tmp), "pkg")
        assert g["pkg.b"] == {"pkg.c"} and g["pkg.c"] == {"pkg.a", "pkg.d"}
        assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_synthq_has_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles (each a group of modules that import one another, " \
        f"counting imports inside functions): {found}"


def test_retokenize_does_not_reach_the_call_module() -> None:
    """Re-tokenizing stored answers is data work: it must not import the server call."""
    chain = path_to(graph(), "synthq.jobs.retokenize", "synthq.serving.call")
    assert chain is None, f"retokenize imports the call module: {' -> '.join(chain or [])}"


#: What the runtime may import of synthq.testing: the simulator (the demo and
#: ``synthq simulate``) and the recipes behind ``synthq testing tiny-target``,
#: ``real-target`` and ``doc-prompts``.
RUNTIME_MAY_USE = {"synthq.testing", "synthq.testing.simulator", "synthq.testing.tiny",
                   "synthq.testing.real", "synthq.testing.docprompts"}


def runtime_graph() -> dict[str, set[str]]:
    """The imports among synthq, api and worker, read as one tree."""
    known = {**modules(REPO, "synthq"), **modules(REPO, "api"), **modules(REPO, "worker")}
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def test_test_tooling_is_outside_the_runtime_import_graph() -> None:
    """No module of the service (synthq outside synthq.testing, api, worker) reaches the
    chaos cluster, the hostile servers, the process helpers or the vLLM launcher."""
    g = runtime_graph()
    tooling = {m for m in g if m.startswith("synthq.testing.")} - RUNTIME_MAY_USE
    assert tooling, "the tooling modules moved: update this test"
    runtime = [m for m in g if not m.startswith("synthq.testing")]
    for start in runtime:
        for goal in tooling:
            chain = path_to(g, start, goal)
            assert chain is None, f"the runtime imports test tooling: {' -> '.join(chain)}"
    for allowed in RUNTIME_MAY_USE - {"synthq.testing"}:
        for goal in tooling:
            assert path_to(g, allowed, goal) is None, (allowed, goal)


#: The floors of the house, lowest first: one folder of synthq each. A module imports only
#: modules of its own folder or of a lower one (imports inside functions count); the
#: package's own ``__init__`` (the version) is below them all, the front ends (the CLI, the
#: API, the workers) are above them, and synthq.testing is apart (see the test above).
FLOORS: tuple[str, ...] = (
    "core",      # errors, enums, the clock, backoff, locks, secrets, compact forms
    "spec",      # the settings: the service's and a job's
    "data",      # conversations and examples, pure: dataset rows, templates, tokens, masks
    "store",     # the schema, sessions, migrations, plain-SQL reads
    "queue",     # the ledger, each kind of leased work, workers, dispatch, the sweep
    "serving",   # calling the inference servers
    "jobs",      # a job's data in and out of SQL: enqueue, retokenize, export
    "capture",   # hidden states from the engine
    "training",  # drafters trained, checkpoints, served acceptance
    "views",     # what the CLI, the API and the job page read
    "app",       # the scheduler tick, embedded mode, the operations the front ends share
)
FRONT_ENDS = ("synthq.cli", "api", "worker")


def floor_of(module: str) -> int:
    """The floor's number (0: the package itself, 1: core); the front ends above them all."""
    parts = module.split(".")
    if parts[0] != "synthq":
        return len(FLOORS) + 1
    if len(parts) == 1:
        return 0
    if parts[1] in ("cli", "testing"):  # the CLI runs the testing recipes (tiny-target ...)
        return len(FLOORS) + 1
    if parts[1] not in FLOORS:
        raise AssertionError(f"{module} is in no floor's folder: add its folder to FLOORS")
    return FLOORS.index(parts[1]) + 1


def upward(g: dict[str, set[str]]) -> list[str]:
    """Each import of a module on a higher floor than the importer's, as ``a -> b``."""
    return [f"{a} -> {b}" for a in sorted(g) if not a.startswith("synthq.testing")
            for b in sorted(g[a]) if floor_of(b) > floor_of(a)]


def test_no_floor_imports_a_higher_one() -> None:
    """The layering, folder by folder: settings never import a feature (``config``
    importing ``capture`` was one), the queue never the capture stage that drives it
    (``dispatch`` and ``capture`` imported each other), pure data never the queue, the
    server call never a job's export, nothing below the front ends a front end."""
    g = runtime_graph()
    folders = {m.split(".")[1] for m in g if m.startswith("synthq.") and m.count(".") > 1}
    assert folders - {"cli", "testing"} == set(FLOORS), "folders and floors differ"
    found = upward(g)
    assert not found, f"imports of a higher floor: {found}"


def test_the_floor_check_sees_an_upward_import() -> None:
    """The two climbs the flat package let through: tokenization reaching the dispatcher,
    the server call reaching the export (each added to today's real graph)."""
    g = runtime_graph()
    g["synthq.data.tokenize"].add("synthq.queue.dispatch")
    g["synthq.serving.inference"].add("synthq.jobs.export")
    g["synthq.app.tick"].add("synthq.cli.render")
    assert upward(g) == ["synthq.app.tick -> synthq.cli.render",
                         "synthq.data.tokenize -> synthq.queue.dispatch",
                         "synthq.serving.inference -> synthq.jobs.export"]


def test_a_module_outside_the_floors_is_named() -> None:
    with pytest.raises(AssertionError, match="synthq.newfolder.x is in no floor"):
        floor_of("synthq.newfolder.x")


def test_the_ledger_knows_no_kind_of_work() -> None:
    """Inside the queue's floor, the ledger is below the kinds of work that use it: it
    imports nothing of the queue (the kinds declare themselves to it)."""
    g = runtime_graph()
    assert not {m for m in g["synthq.queue.ledger"] if m.startswith("synthq.queue.")}

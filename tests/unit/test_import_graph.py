"""The import graph of synthq/, read from the source (every import statement, those inside
functions too): no cycle, and the data side (retokenize) never reaches the call module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

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
            # ``from synthq import states`` imports the module synthq.states.
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
    chain = path_to(graph(), "synthq.retokenize", "synthq.call")
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


#: The floors of the house, lowest first: a module imports only modules of its own floor
#: or below (imports inside functions count). A module of synthq named on no floor is on
#: the domain floor, above these; the front ends (the CLI, the API, the workers) are above
#: it, and synthq.testing is apart (see the test above).
FLOORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("foundation", frozenset({
        "synthq", "synthq.defaults", "synthq.errors", "synthq.enums", "synthq.eagle3",
        "synthq.capture", "synthq.capture.protocol", "synthq.training", "synthq.secrets",
        "synthq.clock", "synthq.retry", "synthq.locks", "synthq.packing", "synthq.netio",
        "synthq.sqlread"})),
    ("settings", frozenset({"synthq.config", "synthq.jobspec"})),
    ("storage", frozenset({"synthq.models", "synthq.db", "synthq.counts"})),
    ("ledger", frozenset({"synthq.ledger"})),
    ("kinds of work", frozenset({"synthq.states", "synthq.capture.states",
                                 "synthq.training.states", "synthq.workers"})),
)
FRONT_ENDS = ("synthq.cli", "api", "worker")


def floor_of(module: str) -> int:
    """The floor's number (0: the foundation); the domain and the front ends above them."""
    for number, (_, members) in enumerate(FLOORS):
        if module in members:
            return number
    if any(module == f or module.startswith(f + ".") for f in FRONT_ENDS):
        return len(FLOORS) + 1
    return len(FLOORS)


def upward(g: dict[str, set[str]]) -> list[str]:
    """Each import of a module on a higher floor than the importer's, as ``a -> b``."""
    return [f"{a} -> {b}" for a in sorted(g) if not a.startswith("synthq.testing")
            for b in sorted(g[a]) if floor_of(b) > floor_of(a)]


def test_no_floor_imports_a_higher_one() -> None:
    """The layering: settings never import a feature (``config`` importing ``capture`` was
    one), the ledger never a kind of work, a kind of work never the domain that drives
    it, the domain never a front end."""
    g = runtime_graph()
    for _, members in FLOORS:
        assert members <= set(g), f"modules moved: {sorted(members - set(g))}"
    found = upward(g)
    assert not found, f"imports of a higher floor: {found}"


def test_the_floor_check_sees_an_upward_import() -> None:
    g = {"synthq.config": {"synthq.capture.progress"}, "synthq.capture.progress": set(),
         "synthq.dispatch": {"synthq.states"}, "synthq.states": set()}
    assert upward(g) == ["synthq.config -> synthq.capture.progress"]

"""The import graph of colabkit/ has no cycle: no module imports a module that imports it back, counting
every import, also those inside functions (a lazy import can hide a cycle but not remove it). The walk is
an AST walk of the source files, independent of the import machinery; its negative control is a small
package with a cycle hidden in a function, which the walk must report.

And imports only go down the floors of CONTRIBUTING's layout (:data:`FLOORS`, written down here once):
every colabkit module is on a floor, and none imports a module on a higher floor, in a function or not.
Its negative control: a small package with an upward import hidden in a function, and one module on no
floor, both of which the check must report."""
import ast
from fnmatch import fnmatchcase
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "colabkit"


def module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        name = ".".join((root.name, *path.relative_to(root).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


def edges(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from .x import y`` counts x and x.y when they are modules);
    a module importing its own parent package is not an edge (the parent's __init__ runs first anyway)."""
    mods = module_files(root)
    out = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    prefix = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{prefix}.{base}" if base else prefix
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t in mods and t != m and not m.startswith(t + "."):
                    out[m].add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [])
    return found


def test_colabkit_has_no_import_cycle():
    graph = edges(ROOT)
    assert len(graph) > 20 and any(graph.values())  # the walk saw the package and its imports
    assert cycles(graph) == []


def test_walk_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    assert cycles(edges(pkg)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


# The layers of CONTRIBUTING.md's layout, bottom to top: a module imports only from its own floor or below.
# Entries are module names or fnmatch globs; an exact name wins over a glob. Modules other branches add
# (device, callbacks, alerts, progress, lesson) are listed already: an entry that matches nothing is fine.
FLOORS: list[tuple[str, list[str]]] = [
    ("ground", ["colabkit.env", "colabkit.data", "colabkit.models", "colabkit.plan", "colabkit.timing",
                "colabkit.device", "colabkit.device.*",  # the CUDA seam and its twin
                "colabkit.batches", "colabkit.hf_models", "colabkit.instruct",  # batches -> losses, model families, data
                "colabkit.determinism", "colabkit.collectives", "colabkit.drive",  # seeds, gloo/NCCL rules, Drive paths
                "colabkit.notices",  # colabkit's warnings
                "colabkit.gpu_results",  # figures measured on a lent GPU, read from package data
                "colabkit.structured.matrix", "colabkit.structured.hodlr", "colabkit.structured.parallel",
                "colabkit.structured.layer"]),  # structured matrices: math and a layer, no measurement
    ("memory", ["colabkit.memory", "colabkit.memory_*"]),
    ("techniques", ["colabkit.techniques", "colabkit.techniques.*"]),
    ("trainer", ["colabkit.trainer"]),
    ("train loop and its event receivers", ["colabkit.train", "colabkit.checkpoints", "colabkit.oom", "colabkit.logs",
                                            "colabkit.callbacks", "colabkit.alerts", "colabkit.progress",
                                            "colabkit.distributed", "colabkit.resilience", "colabkit.feed"]),
    ("estimate", ["colabkit.estimate", "colabkit.estimate.*"]),
    ("what the notebooks show", ["colabkit.quickstart", "colabkit.compare", "colabkit.widgets", "colabkit.plots",
                                 "colabkit.chartstyle", "colabkit.liveplot", "colabkit.demos", "colabkit.hf", "colabkit.hf_witness",
                                 "colabkit.lesson",
                                 "colabkit.selftest",  # measured vs predicted per technique: runs demos
                                 "colabkit.selftest_checks",  # the selftest's technique checks (uses hf)
                                 "colabkit.structured", "colabkit.structured.report"]),  # measured like compare
    ("CLI and the public API", ["colabkit.__main__", "colabkit"]),
]


def floor_of(module: str, floors: list[tuple[str, list[str]]] = FLOORS) -> int | None:
    """Index of the floor that lists ``module`` (by name first, then by glob); None when none does."""
    for exact in (True, False):
        for i, (_, entries) in enumerate(floors):
            if any(module == e if exact else fnmatchcase(module, e) for e in entries):
                return i
    return None


def floor_problems(graph: dict[str, set[str]], floors: list[tuple[str, list[str]]] = FLOORS) -> list[str]:
    """Each module on no floor (with the floor its imports and importers allow) and each import that goes
    up a floor, as sentences."""
    at = {m: floor_of(m, floors) for m in graph}
    out = []
    for m in sorted(graph):
        if at[m] is None:
            low = max((at[t] for t in graph[m] if at[t] is not None), default=0)
            high = min((at[u] for u in graph if m in graph[u] and at[u] is not None), default=len(floors) - 1)
            where = (f"floor {floors[low][0]!r}" if low == high else
                     f"a floor from {floors[low][0]!r} to {floors[high][0]!r}" if low < high else
                     f"no floor: it imports from {floors[low][0]!r} and is imported from {floors[high][0]!r}")
            out.append(f"{m} is on no floor: add it to FLOORS in tests/test_import_graph.py, on {where}")
    for m in sorted(graph):
        for t in sorted(graph[m]):
            if at[m] is not None and at[t] is not None and at[t] > at[m]:
                out.append(f"{m} (floor {floors[at[m]][0]!r}) imports {t}, a floor up ({floors[at[t]][0]!r})")
    return out


def test_imports_only_go_down_the_floors():
    graph = edges(ROOT)
    assert floor_problems(graph) == []
    # every floor holds a module of today's package (a floor that lost all its modules is a stale layout)
    assert all(any(floor_of(m) == i for m in graph) for i in range(len(FLOORS)))


def test_floor_check_reports_an_upward_import_in_a_function_and_a_module_on_no_floor(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from . import high\n    return high\n")  # up, hidden in a function
    (pkg / "high.py").write_text("from .low import f\n")
    (pkg / "mid.py").write_text("from . import low\n")  # on no floor
    floors = [("low", ["pkg.low", "pkg"]), ("high", ["pkg.high"])]
    assert floor_problems(edges(pkg), floors) == [
        "pkg.mid is on no floor: add it to FLOORS in tests/test_import_graph.py, on a floor from 'low' to 'high'",
        "pkg.low (floor 'low') imports pkg.high, a floor up ('high')"]
    assert floor_problems(edges(pkg), [("low", ["pkg.*", "pkg"])]) == []  # one floor: nothing goes up

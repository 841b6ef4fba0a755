"""The import graph of colabkit/ has no cycle: no module imports a module that imports it back, counting
every import, also those inside functions (a lazy import can hide a cycle but not remove it). The walk is
an AST walk of the source files, independent of the import machinery; its negative control is a small
package with a cycle hidden in a function, which the walk must report."""
import ast
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

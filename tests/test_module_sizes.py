"""No module of colabkit is longer than 600 lines (CONTRIBUTING: one topic per module): a module past that
holds several topics and is split by topic. The count is the file's lines, as ``wc -l`` counts them; the
negative control is a small package with one module a line too long, which the check must name."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "colabkit"
LIMIT = 600


def too_long(root: Path, limit: int = LIMIT, exempt: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    """``{"pkg/sub/mod.py": lines}`` for every .py file under ``root`` longer than ``limit`` lines, paths
    relative to ``root``'s parent (as the exemptions name them)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        n = len(path.read_text().splitlines())
        if n > limit and rel not in exempt:
            out[rel] = n
    return out


def test_no_colabkit_module_is_longer_than_600_lines():
    assert len(list(ROOT.rglob("*.py"))) > 20  # the walk saw the package
    assert too_long(ROOT) == {}, "split these modules by topic (CONTRIBUTING, Layout)"


def test_the_check_names_a_module_one_line_too_long(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "short.py").write_text("x = 1\n" * LIMIT)              # at the limit: fine
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (LIMIT + 1))  # one line over
    assert too_long(pkg) == {"pkg/sub/long.py": LIMIT + 1}
    assert too_long(pkg, exempt={"pkg/sub/long.py"}) == {}

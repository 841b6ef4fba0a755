"""`make test-fast` leaves out tests marked ``slow``; each one names, on its marker's line (or the comment line
just above a ``pytest.param(..., marks=pytest.mark.slow)``), the lighter test in the fast set that proves
the same claim -- and that test exists (CONTRIBUTING.md, "Set up and run the tests")."""
import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))


def unnamed_twins(files: dict[str, str]) -> list[str]:
    """'file:line' of every slow marker without a named, existing fast twin. ``files``: name -> source."""
    defined = {name: set(re.findall(r"^def (test_\w+)", src, re.M)) for name, src in files.items()}
    bad = []
    for name, src in files.items():
        lines = src.splitlines()
        for i, line in enumerate(lines):
            if not re.search(r"pytest\.mark\.slow\b", line) or line.lstrip().startswith("#"):
                continue
            comment = line.partition("#")[2] or (lines[i - 1].strip() if i and lines[i - 1].strip().startswith("#") else "")
            twins = re.findall(r"(?:(test_\w+\.py)::)?(test_\w+)", comment)
            if not twins or not all(t in defined.get(f or name, ()) for f, t in twins):
                bad.append(f"{name}:{i + 1}")
    return bad


def test_every_slow_test_names_its_fast_twin():
    files = {}
    for f in sorted(os.listdir(TESTS)):
        if f.startswith("test_") and f.endswith(".py") and f != os.path.basename(__file__):
            with open(os.path.join(TESTS, f)) as fh:
                files[f] = fh.read()
    assert sum(len(re.findall(r"pytest\.mark\.slow\b", s)) for s in files.values()) >= 10
    assert unnamed_twins(files) == []
    # negative controls: a marker without a twin, and one naming a test that does not exist
    fake = {"test_a.py": "@pytest.mark.slow\ndef test_big():\n    pass\n",
            "test_b.py": "@pytest.mark.slow  # fast twin: test_gone\ndef test_big():\n    pass\n",
            "test_c.py": "def test_small():\n    pass\n\n\n@pytest.mark.slow  # fast twin: test_small\ndef test_big():\n"}
    assert unnamed_twins(fake) == ["test_a.py:1", "test_b.py:1"]

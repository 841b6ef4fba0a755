"""Static checks of every notebook: valid JSON, no outputs, the skeleton of DESIGN.md."""
import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_skeleton(path):
    with open(path) as f:
        nb = json.load(f)
    name = os.path.basename(path)
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", name)
    cells = nb["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    for c in code:
        assert not c.get("outputs"), f"{name}: stored with outputs"
        assert c.get("execution_count") is None, f"{name}: stored with execution counts"
    first = _src(cells[0])
    assert cells[0]["cell_type"] == "markdown" and first.lstrip().startswith("#"), "title first"
    assert f"colab.research.google.com/github/colabkit/colabkit/blob/main/notebooks/{name}" in first, "Colab badge"
    setup = _src(code[0])
    assert 'IN_COLAB = "google.colab" in sys.modules' in setup
    assert "import colabkit" in setup and "format_env" in setup
    assert "torch" not in setup.split("pip")[-1].split("]")[0], "never reinstall torch in Colab"
    tagged = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{name}: exactly one cell tagged 'parameters'"
    assert "smoke_mode()" in _src(tagged[0])
    assert any("assert" in _src(c) for c in code), f"{name}: checks are asserts in cells"
    assert any("widgets" in _src(c) for c in code), f"{name}: an interactive section"
    assert any("takeaway" in _src(c).lower() for c in cells if c["cell_type"] == "markdown"), f"{name}: takeaways"
    assert nb.get("metadata", {}).get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_chart_passes_the_readability_audit(path):
    """Charts are shown with colabkit.plots.show, which asserts axis labels with units, a title and a legend
    for every colour (plots.audit) when the notebook runs; a bare plt.show() would skip that check."""
    with open(path) as f:
        code = "\n".join(_src(c) for c in json.load(f)["cells"] if c["cell_type"] == "code")
    assert "plt.show()" not in code and "plt.figure(" not in code, "show figures with colabkit.plots.show(fig)"
    draws = re.findall(r"plot_breakdown\(|pareto\(|plt\.subplots\(", code)
    assert len(re.findall(r"\bshow\(", code)) >= min(1, len(draws)), "a chart is drawn but never shown through show()"

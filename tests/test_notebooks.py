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


# ----- a question before each answer (issue 37) -----------------------------------------------------------
PREDICTION, GLOSSARY, EXERCISES = "**Your prediction:**", "**Words you will meet:**", "## Exercises"
# words a learner must not meet unexplained in what a notebook shows (the library's internals)
JARGON = ("T4 emulation", "sm75", "kMinBlockSize", "emulating_t4")


def lesson_problems(cells: list[dict]) -> list[str]:
    """What the learning scaffold of one notebook lacks: 1-3 prediction prompts, each right before a code cell
    (the cell that measures the answer); a glossary before the first numbered section; a closing Exercises
    section of 2-3 numbered items with no section after it; no internal jargon in markdown."""
    problems = []
    md = [(i, _src(c)) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    asks = [i for i, s in md if s.lstrip().startswith(PREDICTION)]
    if not 1 <= len(asks) <= 3:
        problems.append(f"{len(asks)} '{PREDICTION}' cells (1-3 wanted)")
    for i in asks:
        if i + 1 >= len(cells) or cells[i + 1]["cell_type"] != "code":
            problems.append(f"cell {i}: a prediction must come right before the code cell that answers it")
    sections = [i for i, s in md if re.match(r"##\s", s)]
    words = [i for i, s in md if s.lstrip().startswith(GLOSSARY)]
    if len(words) != 1 or (sections and words[0] > sections[0]):
        problems.append(f"one '{GLOSSARY}' glossary cell before the first section wanted, found at {words}")
    ex = [i for i, s in md if s.lstrip().startswith(EXERCISES)]
    if len(ex) != 1:
        problems.append(f"one '{EXERCISES}' section wanted, found {len(ex)}")
    else:
        items = re.findall(r"^\d+\.\s", dict(md)[ex[0]], flags=re.M)
        if not 2 <= len(items) <= 3:
            problems.append(f"'{EXERCISES}' has {len(items)} numbered exercises (2-3 wanted)")
        if [i for i in sections if i > ex[0]]:
            problems.append(f"'{EXERCISES}' must be the closing section")
    problems += [f"cell {i}: internal jargon {w!r}" for i, s in md for w in JARGON if w in s]
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_a_question_before_each_answer(path):
    with open(path) as f:
        cells = json.load(f)["cells"]
    assert not lesson_problems(cells), f"{os.path.basename(path)}: {lesson_problems(cells)}"


def test_lesson_problems_negative_controls():
    def cell(kind, src):
        return {"cell_type": kind, "source": src}
    good = [cell("markdown", "# t"), cell("code", "x"), cell("markdown", GLOSSARY + " a"), cell("markdown", "## 1. a"),
            cell("markdown", PREDICTION + " ?"), cell("code", "y"), cell("markdown", "## Takeaways"),
            cell("markdown", EXERCISES + "\n\n1. a\n2. b")]
    assert lesson_problems(good) == []
    no_ask = [c for c in good if not c["source"].startswith(PREDICTION)]
    assert "0 '**Your prediction:**' cells (1-3 wanted)" in lesson_problems(no_ask)
    ask_late = good[:4] + [good[4], good[6], good[5]] + good[7:]   # a prediction followed by markdown
    assert any("right before the code cell" in p for p in lesson_problems(ask_late))
    assert any("glossary" in p for p in lesson_problems(good[:2] + good[3:4] + good[2:3] + good[4:]))
    assert any("numbered exercises" in p for p in lesson_problems(good[:-1] + [cell("markdown", EXERCISES + "\n\n1. a")]))
    assert any("closing section" in p for p in lesson_problems(good + [cell("markdown", "## More")]))
    assert lesson_problems(good + [cell("markdown", "a T4 (T4 emulation is on) (sm75)")])[-2:] == [
        "cell 8: internal jargon 'T4 emulation'", "cell 8: internal jargon 'sm75'"]


def test_a_dropdown_lists_each_option_once():
    """09 listed gpt2-124m twice (its MODEL and the fixed list): choices_widget shows each option once."""
    pytest.importorskip("ipywidgets")
    from colabkit.widgets import choices_widget

    ui = choices_widget(lambda model: model, {"model": ["gpt2-124m", "gpt2-124m", "gpt2-350m"]}, button="go")
    drop = ui.children[0].children[0]
    assert list(drop.options) == ["gpt2-124m", "gpt2-350m"] and drop.value == "gpt2-124m"


def test_memory_comparisons_start_at_zero():
    """Issue 37: 04's memory-vs-K axis started above 0, so a 2x saving looked like 10x. Every chart that compares
    memory on a linear axis starts at 0: plot_lines with bytes, the shared-scale timelines, the comparison bars."""
    from colabkit.lesson import compare_bars
    from colabkit.plots import plot_lines, plot_timelines

    near = {"measured": ([1, 2, 4], [20 << 20, 18 << 20, 17 << 20])}   # matplotlib would start the axis near 17 MiB
    assert plot_lines(near, "K (count)", "memory", "t", unit="bytes").axes[0].get_ylim()[0] == 0
    assert plot_lines(near, "K (count)", "loss (nats)", "t").axes[0].get_ylim()[0] > 0       # not memory: autoscaled
    s = [{"step": 0, "phase": p, "phase_peak": b} for p, b in (("forward", 30 << 20), ("backward", 31 << 20))]
    assert plot_timelines({"a": s, "b": s}, title="t").axes[0].get_ylim()[0] == 0
    assert compare_bars({"baseline": 31 << 20, "fp16": 30 << 20}, "peak").axes[0].get_ylim()[0] == 0


def _overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of visible, non-empty text boxes of ``fig`` (titles, labels, ticks, annotations, legends) that overlap."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    from matplotlib.text import Text

    found = fig.findobj(Text)   # every Text artist once (a legend's TextArea wraps one of them)
    texts = [t for t in {id(t): t for t in found}.values() if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), Text.get_window_extent(t, r)) for t in texts]   # an annotation's text, not its arrow
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]


def _real_size_rows():
    """Rows shaped like the planner's for 09 at real size: every T4 candidate plan, with peaks and overheads
    clustered as the real ones are (plans sharing a precision and optimizer land on nearly the same point)."""
    from colabkit.estimate.planner import candidate_plans

    rows = []
    for i, p in enumerate(candidate_plans("t4")):
        peak = (6 << 30) * (0.5 if "fp16" in p else 1) * (0.6 if "checkpoint" in p else 1) * (0.7 if "8bit" in p else 1)
        over = (0.33 if "checkpoint" in p else 0) + (0.05 if "bit" in p else 0) - (0.4 if "fp16" in p else 0)
        rows.append({"plan": p, "peak_bytes": int(peak * (1 + 0.01 * (i % 3))), "overhead": over + 0.002 * (i % 4),
                     "fits": peak < (14 << 30)})
    return rows


def test_the_plan_chart_is_legible_at_real_size():
    """09 at real size labels every candidate plan (~28): no text of the chart is drawn over another."""
    from colabkit.estimate.planner import pareto
    from colabkit.lesson import plan_chart

    rows = _real_size_rows()
    assert len(rows) >= 20
    fig = plan_chart(rows, budget_bytes=14 << 30, title="plans: gpt2-350m, batch 4 x seq 1024 on a T4 (predicted)")
    assert _overlapping_texts(fig) == []
    listed = [t.get_text() for t in fig.texts if "\n" in t.get_text()][0]
    assert all(r["plan"] in listed for r in rows)                                   # every plan is named
    assert pareto(rows, budget_bytes=14 << 30).figure and _overlapping_texts(pareto(rows).figure)  # the old chart overlaps


def test_a_formula_far_from_the_estimate_says_why():
    """Issue 37: 05's formula (5.8 GiB) sat beside its estimate (4.7 GiB) without a word. side_by_side_table
    writes a reason under the table for a gap over 10% (naming what the formula leaves out), none within it."""
    from colabkit.compare import formula_gap, side_by_side_table

    at = {"params": 4 << 20, "grads": 0, "optimizer": 0, "activations": 30 << 20, "other": 2 << 20}
    est = lambda total, acts: {"peak_bytes": 36 << 20, "peak_phase": "forward", "at_peak": at,   # noqa: E731
                               "analytic": {"total": total, "weights": 4 << 20, "grads": 0, "optimizer": 0, "activations": acts}}
    assert formula_gap(est(38 << 20, 34 << 20), "compress:int8") is None                    # 6% apart: agrees
    why = formula_gap(est(48 << 20, 44 << 20), "compress:int8")                              # 33% apart
    assert why.startswith("formula 33% above the estimate: it counts activations as 44.0 MiB") and "int8" in why
    assert "int8" not in formula_gap(est(48 << 20, 44 << 20), "checkpoint")
    row = {"plan": "compress:int8", "measured_bytes": 1, "predicted_bytes": 36 << 20, "formula_bytes": 48 << 20,
           "verdict": "fits", "error": None, "measured_on": "m", "predicted_for": "gpt2-124m, 8x512, t4", "why": why}
    assert side_by_side_table([row]).splitlines()[-1] == f"why compress:int8: {why}"
    assert "why" not in side_by_side_table([{**row, "why": None}]).splitlines()[-1]


TECHNIQUE_NOTEBOOKS = ("02", "03", "04", "05", "06", "07", "08", "10", "11", "12", "15")
SHARED_SCALE = ("plot_timelines(", "plot_breakdown(", "compare_bars(", "plot_per_rank(")   # bars/lines from 0


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if os.path.basename(p)[:2] in TECHNIQUE_NOTEBOOKS],
                         ids=os.path.basename)
def test_a_technique_notebook_compares_on_one_scale(path):
    """Issue 37: each technique notebook shows baseline vs technique (or memory vs the knob) in one figure on a
    shared scale from 0, not a plot per plan with its own autoscaled axis."""
    with open(path) as f:
        code = "\n".join(_src(c) for c in json.load(f)["cells"] if c["cell_type"] == "code")
    assert any(fn in code for fn in SHARED_SCALE), f"{os.path.basename(path)}: no shared-scale comparison figure"


# What a notebook runs beyond colabkit[hf] needs its extra in the Colab install cell: 07 measures adam-mini and
# galore:R, whose packages (adam-mini, galore-torch) come with the optim extra.
NEEDS_EXTRA = {"07_optimizers.ipynb": {"hf", "optim"}}


def _installed_extras(code: str) -> set[str]:
    m = re.search(r"colabkit\[([a-z,]+)\] @ git\+", code)
    return set(m.group(1).split(",")) if m else set()


def test_each_notebook_installs_what_it_runs():
    """Colab gets only what a notebook's install cell asks for: 07 asked for colabkit[hf], so in Colab its first
    measurement of adam-mini stopped ("needs the adam-mini package"). Every notebook installs hf, 07 also optim;
    every extra named exists in pyproject.toml, and the notebooks extra (JupyterLab on your machine) holds every
    package of hf, optim and logging. Control: 07's old install cell misses optim."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for path in NOTEBOOKS:
        with open(path) as f:
            code = "\n".join(_src(c) for c in json.load(f)["cells"] if c["cell_type"] == "code")
        got = _installed_extras(code)
        assert got <= set(extras), (os.path.basename(path), got)
        assert NEEDS_EXTRA.get(os.path.basename(path), {"hf"}) <= got, (os.path.basename(path), got)
    name = lambda req: re.split(r"[<>=\[ ]", req)[0]  # noqa: E731
    assert {name(r) for k in ("hf", "optim", "logging") for r in extras[k]} <= {name(r) for r in extras["notebooks"]}
    old = '"colabkit[hf] @ git+https://github.com/colabkit/colabkit"'
    assert not NEEDS_EXTRA["07_optimizers.ipynb"] <= _installed_extras(old)

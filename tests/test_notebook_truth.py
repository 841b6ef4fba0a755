"""Notebooks whose words are their numbers (issue 23): static checks of every notebook, the negative
controls that show each check can fail, and the wiring of the executed-notebook checks.

Rules, each a test per notebook:

1. **No measured number in markdown.** A figure a run measures (memory, time, a ratio, a percentage)
   changes with the device and the run; typed into markdown it goes stale and can contradict the cell
   under it. Such figures are rendered from the run (``display(Markdown(...))``). The detector flags a
   number carrying a unit of memory (B, KiB..GiB, KB..TB, bytes), time (ms, s, min, h), a ratio (×, x),
   a percentage or a ZeRO Ψ, unless it is one of these, which are true whatever a run measures:

   - an *element size*: fewer than 32 bytes (a dtype, bytes per parameter, an int8 block's scale);
   - a *power-of-two ratio* (2×, 4×, 8×, 16×, 32×): the ratio of two data-type widths;
   - an *integer multiple of Ψ* (2Ψ, 16Ψ): the ZeRO paper's formulas; a measured 3.33Ψ is flagged;
   - the *value of a formula written before it*: ``(1 + 4/64) / 4 = 0.27×`` (the left of ``=``/``≈``
     holds digits and an operator; ``peak = 4.8 MiB`` is flagged);
   - a *quoted claim* under discussion, inside double quotes: ``the "98.8% less" figure``;
   - a *platform figure*: a memory size of a GPU profile in :data:`colabkit.env.GPU_PROFILES` (total,
     capacity, usable, host RAM, disk) written in GiB/GB/MiB, or one of :data:`PLATFORM_FIGURES` with its
     source. A parameter count ("a 1B model", "7B") is not bytes: ``B`` after a number needs a space.
2. **No code cell longer than 20 lines**: plotting, tables and widget wiring live in colabkit.plots /
   colabkit.widgets; cells are about the technique.
3. **Only public colabkit names are imported.** Public means: no path component or name starts with
   ``_``; ``from colabkit import n``: ``n`` is bound in ``colabkit/__init__.py`` (the API) or is a
   submodule; ``from colabkit.m import n``: ``n`` is in ``m.__all__`` when ``m`` defines one, else ``n``
   is defined by ``m`` itself (def, class, assignment; a package ``__init__`` also re-exports), or is a
   submodule. A name ``m`` merely imports from elsewhere is not ``m``'s API (PEP 8). Attribute chains
   ``colabkit.a.b`` follow the same rules while they name modules.
4. **No step time read off a measured run.** A ``measure``/``compare``/``bench_sharded`` record's step
   time is one plan's, timed alone (a few untracked steps after the tracked ones, or the tracked steps
   themselves with ``timing_steps=0``: the tracker's per-op Python work makes a gpt-tiny step 1.6x
   slower on a CPU). A notebook shows speed from :func:`colabkit.step_times` / :func:`colabkit.interleaved`
   (untracked, warmed up, interleaved against the peer). Checked by following, in the notebook's code,
   every name bound from such a call (and every name bound from those) to a ``["step_time_s"]`` read.

The executed checks (no image twice in one notebook, no "Failed to load" output) run inside nbval's own
run of each notebook (``notebooks/conftest.py``), so no notebook is executed twice; the last tests here
prove that hook fails a notebook that breaks them.
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
MAX_CELL_LINES = 20

_spec = importlib.util.spec_from_file_location("_notebook_hooks", os.path.join(ROOT, "notebooks", "conftest.py"))
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)


def _params():
    return [pytest.param(p, id=os.path.basename(p)) for p in NOTEBOOKS]


def _cells(path, kind):
    with open(path) as f:
        nb = json.load(f)
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] == kind:
            yield i, "".join(c["source"]) if isinstance(c["source"], list) else c["source"]


# ----- 1. measured numbers in markdown --------------------------------------------------------------
GiB, MiB = 1 << 30, 1 << 20
# Platform figures not derived from GPU_PROFILES, each with its source.
PLATFORM_FIGURES = {
    ("11", "GiB"): "host RAM a Colab VM leaves usable (DESIGN.md: about 11 GiB usable host RAM)",
    ("15", "GB"): "a T4's VRAM as Colab's resource panel rounds it",
    ("16", "GB"): "a T4's VRAM on its datasheet (16 GB GDDR6)",
}
_UNIT = (r"(?:[KMGT]iB|[KMGT]B|(?<= )B|bytes?|ms|µs|us|s|sec|seconds?|min|minutes?|h|hours?|%|[x×]|Ψ"
         r"|tokens/s|it/s|steps/s|samples/s|[GT]FLOPS)")
_NUMBER = re.compile(rf"(?<![\w.:/^-])([~≈+−-]?)(\d[\d,]*(?:\.\d+)?)\s?({_UNIT})(?![\w/])")
_BYTE_UNITS = {"B": 1, "byte": 1, "bytes": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40,
               "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _profile_figures() -> set[tuple[str, str]]:
    from colabkit.env import GPU_PROFILES

    figs = set()
    for prof in GPU_PROFILES.values():
        for key in ("total_bytes", "capacity_bytes", "usable_bytes", "host_ram_bytes", "disk_bytes"):
            v = prof.get(key)
            if not v:
                continue
            for fmt in ("{:.0f}", "{:.1f}", "{:.2f}"):
                figs |= {(fmt.format(v / GiB), "GiB"), (fmt.format(v / 1e9), "GB"), (fmt.format(v / MiB), "MiB")}
    return figs


PROFILE_FIGURES = _profile_figures()


def _in_quotes(text: str, start: int) -> bool:
    line_start = text.rfind("\n", 0, start) + 1
    return text.count('"', line_start, start) % 2 == 1 or text.count("“", line_start, start) > text.count("”", line_start, start)


def _formula_value(text: str, start: int) -> bool:
    """The number is what a formula to its left on the same line evaluates to."""
    line = text[text.rfind("\n", 0, start) + 1:start]
    m = re.search(r"[=≈]\s*$", line)
    if not m:
        return False
    lhs = line[:m.start()].rsplit(",", 1)[-1].rsplit(";", 1)[-1]
    return bool(re.search(r"\d", lhs) and re.search(r"[+\-*/×·^−]", lhs))


def measured_figures(markdown: str) -> list[str]:
    """The numbers in ``markdown`` that read as measurements (see the module docstring for what is exempt).

    >>> measured_figures("checkpointing peaks at 4.8 MiB for both plans (1.00×), 2.5 s per step, +0.01%")
    ['4.8 MiB', '1.00×', '2.5 s', '+0.01%']
    >>> measured_figures('16 bytes per parameter; int8 = (1 + 4/64) / 4 = 0.27×; 2× less; a 7B model; "3× on 2 GPUs"')
    []
    """
    text = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    hits = []
    for m in _NUMBER.finditer(text):
        sign, num, unit = m.groups()
        value = float(num.replace(",", ""))
        if unit in _BYTE_UNITS and value * _BYTE_UNITS[unit] < 32:
            continue                                     # an element size
        if unit in ("x", "×") and not sign.strip("+") and value in (2, 4, 8, 16, 32):
            continue                                     # a ratio of data-type widths
        if unit == "x" and re.match(r"\s*\d", text[m.end():]):
            continue                                     # a shape or product: 8 x 512
        if unit == "Ψ" and value.is_integer() and "." not in num:
            continue                                     # the ZeRO paper's formula terms
        if (num, unit) in PROFILE_FIGURES or (num, unit) in PLATFORM_FIGURES:
            continue                                     # a platform figure
        if _formula_value(text, m.start()) or _in_quotes(text, m.start()):
            continue
        hits.append(m.group(0).strip())
    return hits


@pytest.mark.parametrize("path", _params())
def test_no_measured_number_in_markdown(path):
    found = {i: figs for i, src in _cells(path, "markdown") if (figs := measured_figures(src))}
    assert not found, (f"{os.path.basename(path)}: markdown states measured figures {found} (cell: figures); render "
                       "them from the run with display(Markdown(...)) or colabkit.plots.show_markdown")


def test_the_figure_detector_flags_what_the_issue_found():
    # quoted from issue 23's list of prose that contradicted the cell under it
    assert measured_figures("03 checkpointing peaks at 4.8 MiB for both plans (1.00×)") == ["4.8 MiB", "1.00×"]
    assert measured_figures("fp16/fp32 step time 1.07× in one cell and 9.6× in another") == ["1.07×", "9.6×"]
    assert measured_figures("the table says 10.5 GiB") == ["10.5 GiB"]
    assert measured_figures("measured 0.01%") == ["0.01%"]
    assert measured_figures("it measured 3.33Ψ vs DDP's 2Ψ") == ["3.33Ψ"]
    assert measured_figures("offload:disk looks 44× faster") == ["44×"]
    assert measured_figures("peak = 4.8 MiB") == ["4.8 MiB"]          # '=' without a formula on its left
    # background that stays prose
    assert measured_figures("a free Colab T4 (15 GB, 2 vCPUs), accum:4, checkpoint:2, batch 8 x 512") == []
    assert measured_figures("capacity 14.74 GiB, usable 14.5 GiB") == []   # colabkit.env.GPU_PROFILES["t4"]
    assert measured_figures("1 byte per value + 4 bytes of scale per 64 values") == []


# ----- 2. code cell length --------------------------------------------------------------------------
@pytest.mark.parametrize("path", _params())
def test_no_code_cell_longer_than_20_lines(path):
    long = {i: n for i, src in _cells(path, "code") if (n := len(src.rstrip().splitlines())) > MAX_CELL_LINES}
    assert not long, f"{os.path.basename(path)}: code cells longer than {MAX_CELL_LINES} lines {long} (cell: lines)"


# ----- 3. public colabkit names only ----------------------------------------------------------------
def _module_file(mod: str) -> str | None:
    base = os.path.join(ROOT, *mod.split("."))
    for f in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(f):
            return f
    return None


def public_names(mod: str) -> set[str]:
    """What ``mod`` (a colabkit module) offers: ``__all__`` if it has one; else the names it defines at
    top level, plus, for a package ``__init__``, the names it imports (its re-exports)."""
    path = _module_file(mod)
    with open(path) as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    package = path.endswith("__init__.py")
    for node in tree.body:
        targets = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                return set(ast.literal_eval(node.value))
            targets = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        elif package and isinstance(node, (ast.Import, ast.ImportFrom)):
            targets = [(a.asname or a.name).split(".")[0] for a in node.names]
        names |= set(targets)
    return {n for n in names if not n.startswith("_")}


def _is_module(mod: str) -> bool:
    return _module_file(mod) is not None


def private_uses(code: str) -> list[str]:
    """Each import or attribute chain in ``code`` that reaches a non-public colabkit name.

    >>> private_uses("from colabkit.estimate import _table\\nimport colabkit\\ncolabkit._x")
    ['from colabkit.estimate import _table', 'colabkit._x']
    >>> private_uses("from colabkit.plots import show\\nfrom colabkit.estimate import check_as_gpu")
    []
    """
    lines = [ln for ln in code.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    tree = ast.parse("\n".join(lines))
    bad, aliases = [], {}

    def ok_name(mod: str, name: str) -> bool:
        return not name.startswith("_") and (name in public_names(mod) or _is_module(f"{mod}.{name}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "colabkit":
                    if any(p.startswith("_") for p in a.name.split(".")) or not _is_module(a.name):
                        bad.append(f"import {a.name}")
                    aliases[a.asname or "colabkit"] = a.name if a.asname else "colabkit"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "colabkit":
            mod = node.module
            if any(p.startswith("_") for p in mod.split(".")) or not _is_module(mod):
                bad.append(f"from {mod} import ...")
                continue
            for a in node.names:
                if not ok_name(mod, a.name):
                    bad.append(f"from {mod} import {a.name}")
                elif _is_module(f"{mod}.{a.name}"):
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not (isinstance(cur, ast.Name) and cur.id in aliases):
                continue
            mod = aliases[cur.id]
            for attr in reversed(chain):
                if not ok_name(mod, attr):
                    bad.append(f"{mod}.{attr}")
                    break
                if not _is_module(f"{mod}.{attr}"):
                    break                                # a function or class: its attributes are its own
                mod = f"{mod}.{attr}"
    return list(dict.fromkeys(bad))


@pytest.mark.parametrize("path", _params())
def test_only_public_colabkit_names(path):
    code = "\n".join(src for _, src in _cells(path, "code"))
    assert not private_uses(code), f"{os.path.basename(path)}: non-public colabkit names {private_uses(code)}"


def test_the_import_check_catches_private_names():
    assert private_uses("from colabkit.plots import _plt") == ["from colabkit.plots import _plt"]
    assert private_uses("from colabkit._private import x") == ["from colabkit._private import ..."]
    # fmt_bytes is colabkit.memory's, quickstart only imports it: not quickstart's API
    assert private_uses("from colabkit.quickstart import fmt_bytes") == ["from colabkit.quickstart import fmt_bytes"]
    assert private_uses("import colabkit.plots as cp\ncp._budget(None)") == ["colabkit.plots._budget"]
    assert private_uses("import colabkit\ncolabkit.plots.byte_unit(1)\ncolabkit.fmt_bytes(1)") == []
    assert private_uses("from colabkit import nonexistent") == ["from colabkit import nonexistent"]


# ----- 4. no step time from a tracked run -----------------------------------------------------------
TRACKED_RUNS = {"measure", "compare", "bench_sharded", "bench_ranks"}   # their records were timed under the tracker
STEP_TIME_KEYS = {"step_time_s", "step_time_tracked_s"}


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls(node) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def _roots(target) -> set[str]:
    """The names an assignment target binds: ``a``, ``a, b``, ``a[k]`` (binds into ``a``), ``a.x``."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_roots(t) for t in target.elts))
    if isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        return _roots(target.value)
    return set()


def tracked_step_times(code: str) -> list[str]:
    """``X["step_time_s"]`` reads whose ``X`` comes (through assignments, loops, comprehensions) from a
    tracked run's records."""
    tree = ast.parse(code)
    binds = []   # (names bound, the expression they come from)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            binds += [(_roots(t), n.value) for t in n.targets]
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            binds.append((_roots(n.target), n.value))
        elif isinstance(n, (ast.For, ast.comprehension)):
            binds.append((_roots(n.target), n.iter))
    tainted, grew = set(), True
    while grew:
        grew = False
        for names, value in binds:
            if names - tainted and (_calls(value) & TRACKED_RUNS or _names(value) & tainted):
                tainted |= names
                grew = True
    bad = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in STEP_TIME_KEYS
                and _names(n.value) & tainted):
            bad.append(ast.unparse(n))
    return bad


@pytest.mark.parametrize("path", _params())
def test_no_step_time_from_a_tracked_run(path):
    code = "\n".join(src for _, src in _cells(path, "code") if not src.lstrip().startswith(("%", "!")))
    assert not tracked_step_times(code), (f"{os.path.basename(path)}: step times read off tracked runs "
                                          f"{tracked_step_times(code)}: time with colabkit.step_times (untracked, interleaved)")


def test_the_tracked_time_check_follows_the_records():
    """Negative controls: notebook 15's takeaway before the fix, and the planner's predicted times (not tracked)."""
    before = ("records[plan] = measure(MODEL, plan)\nbase, chunk = records[plans[0]], records[plans[1]]\n"
              "md = f\"{chunk['step_time_s']:.2f} s\"")
    assert tracked_step_times(before) == ["chunk['step_time_s']"]
    assert tracked_step_times("rs = colabkit.compare(m, ps)\nfor r in rs:\n    print(r['step_time_s'])") == ["r['step_time_s']"]
    assert tracked_step_times("ranked = plans(M)\nfor r in ranked:\n    print(r['step_time_s'])") == []
    assert tracked_step_times("measured = measure(M, P)\nprint(measured['peak_bytes'])") == []


# ----- the executed checks: the nbval hook in notebooks/conftest.py ---------------------------------
def test_output_problems_negative_controls():
    import base64

    a, b = (base64.b64encode(x).decode() for x in (b"png a", b"png b"))
    seen: dict = {}
    img = lambda d: {"output_type": "display_data", "data": {"image/png": d, "text/plain": "<Figure>"}}
    assert hooks.output_problems([img(a), img(b)], seen, 1) == []
    assert hooks.output_problems([img(a)], seen, 4) == ["cell 4 shows the same image as cell 1 (a chart drawn twice)"]
    noisy = {"output_type": "stream", "name": "stderr", "text": "Failed to load /x/_C_cutlass.so: libcuda\n"}
    assert hooks.output_problems([noisy], seen, 5)[0].startswith("cell 5 prints third-party noise")


_HOOK_CELLS = ["from IPython.display import Image, display\n"
               "png = lambda tag: Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + tag, format='png')\n"
               "display(png(b'a'))",
               "display(png(b'b')); display(png(b'a'))",
               "import sys; print('Failed to load libfoo.so', file=sys.stderr)"]


@pytest.mark.slow  # fast twin: test_the_hook_fails_the_cells_that_draw_twice_in_process
def test_the_hook_fails_a_notebook_that_draws_twice(tmp_path):
    """nbval with the notebooks' conftest on a three-cell notebook: the same chart shown twice and a
    'Failed to load' line fail their cells; a distinct chart passes (the hook is wired, not only written)."""
    nb = {"nbformat": 4, "nbformat_minor": 5,  # a v4 notebook as nbformat.v4.new_notebook writes it
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": src} for i, src in enumerate(_HOOK_CELLS)]}
    (tmp_path / "99_check.ipynb").write_text(json.dumps(nb))
    (tmp_path / "conftest.py").write_text(open(os.path.join(ROOT, "notebooks", "conftest.py")).read())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                          "--nbval-current-env", "-rf", "99_check.ipynb"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert "1 passed" in out and "2 failed" in out, textwrap.shorten(out, 3000)
    assert "same image as cell 0" in out and "third-party noise" in out


def test_the_hook_fails_the_cells_that_draw_twice_in_process():
    """Fast twin of the nbval run above: the conftest's report hook, driven as pytest drives a hookwrapper,
    on the outputs the three cells produce (as nbval leaves them on its cell items, ``test_outputs``):
    the same chart again and the 'Failed to load' line fail their cells, a distinct chart passes."""
    import base64
    from types import SimpleNamespace

    def png(tag):
        return {"output_type": "display_data",
                "data": {"image/png": base64.b64encode(b"\x89PNG\r\n\x1a\n" + tag).decode(), "text/plain": "<Image>"}}
    outputs = [[png(b"a")], [png(b"b"), png(b"a")],
               [{"output_type": "stream", "name": "stderr", "text": "Failed to load libfoo.so\n"}]]
    notebook = SimpleNamespace()  # the cells' parent: the hook keeps the images seen so far on it
    reports = []
    for i, outs in enumerate(outputs):
        report = SimpleNamespace(passed=True, outcome="passed", longrepr=None)
        wrapper = hooks.pytest_runtest_makereport(SimpleNamespace(test_outputs=outs, parent=notebook, cell_num=i),
                                                  SimpleNamespace(when="call"))
        next(wrapper)
        with pytest.raises(StopIteration):
            wrapper.send(SimpleNamespace(get_result=lambda report=report: report))
        reports.append(report)
    assert [r.outcome for r in reports] == ["passed", "failed", "failed"]
    assert "same image as cell 0" in reports[1].longrepr and "third-party noise" in reports[2].longrepr


def test_output_problems_flag_our_own_noise():
    """Issue 37's noise, as the executed notebooks printed it, fails the cell; the clean version passes."""
    def stream(text):
        return {"output_type": "stream", "name": "stdout", "text": text}
    trainer_logs = "{'loss': 3.2101, 'grad_norm': 1.53, 'learning_rate': 0.001, 'epoch': 0.5}\n"
    assert hooks.output_problems([stream(trainer_logs)], {}, 3) == [
        "cell 3 prints noise: raw dict printed: \"" + trainer_logs.strip() + "\""]
    assert hooks.output_problems([{"output_type": "execute_result", "data": {"text/plain": "{'fp16': 0.25, 'fp32': 1.0}"}}],
                                 {}, 7)[0].startswith("cell 7 prints noise: raw dict")
    assert "raw dict printed" in hooks.output_problems([stream("max difference: {'fp16': '4.2e-06'}")], {}, 9)[0]
    assert "internal jargon 'T4 emulation'" in hooks.output_problems([stream("bf16: T4 emulation is on")], {}, 9)[0]
    for figure in ("saving -0.00% of the peak", "zero:1 vs baseline: -0% less", "ratio -0.0x"):
        assert "'-0.0' figure" in hooks.output_problems([stream(figure)], {}, 1)[0], figure
    twice = "No GPU attached: running on the CPU.\nshrinking the micro-batch to 4\nNo GPU attached: running on the CPU.\n"
    assert hooks.output_problems([stream(twice)], {}, 2) == [
        "cell 2 prints noise: printed twice: 'No GPU attached: running on the CPU.'"]
    clean = ("| step | loss |\n|---|---|\n|---|---|\n| 1 | -0.52 |\n512.0 KiB activations  forward  addmm\n"
             "512.0 KiB activations  forward  addmm\nsaving +0.00% of the peak; lr 1e-05; {x}\n"
             "No GPU attached: running on the CPU; a T4 (compute capability 7.5).\n")
    assert hooks.output_problems([stream(clean)], {}, 4) == []

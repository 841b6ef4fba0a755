"""Plots, one vocabulary for every notebook: a breakdown chart whose bars are the composition *at the
peak* (they sum to the measured peak) with each category's own peak marked, curves, timings, tables,
predicted memory against a GPU's capacity. The live plot (redrawn in place while training) is in
:mod:`colabkit.liveplot`, the units and colours both share in :mod:`colabkit.chartstyle`; both are
re-exported here.

Units scale with the data (B, KiB, MiB, GiB); the budget line is drawn only when it is on scale (else
named in the legend); titles say model, plan, batch x seq and device (:func:`run_title`). :func:`show`
checks a figure (axis labels with units, a title, a legend for every colour) before displaying it,
so a notebook cannot show a chart a learner cannot read.

>>> byte_unit(3 * 2**20)
('MiB', 1048576)
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import chartstyle as _style, liveplot as _live
from .gpu_results import gpu_column_title, gpu_peak
from .chartstyle import _budget, _colors_used, _in_notebook, _in_steps, _legend_colors, _plt  # noqa: F401
from .memory import CATEGORIES

# colabkit.plots stays the one place a notebook imports charts from: the live plot (colabkit.liveplot) and
# what every chart shares (colabkit.chartstyle) are this module's names too (assigned: public, not imported)
LivePlot, HOST_RAM_NOTE, draw_timeline, draw_categories, plot_timeline = (
    _live.LivePlot, _live.HOST_RAM_NOTE, _live.draw_timeline, _live.draw_categories, _live.plot_timeline)
PHASE_COLORS, CATEGORY_COLORS, UNITS, byte_unit, integer_ticks, audit, show = (
    _style.PHASE_COLORS, _style.CATEGORY_COLORS, _style.UNITS, _style.byte_unit, _style.integer_ticks, _style.audit,
    _style.show)


def run_title(model: str | None = None, plan: str | None = None, batch: int | None = None, seq: int | None = None,
              device: str | None = None, what: str = "") -> str:
    """``"what — model, plan, batch B x seq S, on device"`` from whichever parts are given.

    >>> run_title("gpt-tiny", "checkpoint", 8, 64, "cpu", what="memory")
    'memory — gpt-tiny, checkpoint, batch 8 x seq 64, on cpu'
    """
    parts = [p for p in (model, plan) if p]
    if batch and seq:
        parts.append(f"batch {batch} x seq {seq}")
    if device:
        parts.append(f"on {device}")
    body = ", ".join(parts)
    return f"{what} — {body}" if what and body else what or body


def value_ticks(ax, values: Sequence[float], axis: str = "x") -> None:
    """On a log axis, ticks exactly at ``values`` (the sizes that were measured), written plainly
    (``128``, ``1024``, not ``10^2``), and no minor labels to collide with them.

    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots(); ax.set_xscale("log", base=2); value_ticks(ax, [1, 2, 4])
    >>> [t.get_text() for t in ax.get_xticklabels()]
    ['1', '2', '4']
    """
    from matplotlib.ticker import NullFormatter, NullLocator

    a = ax.xaxis if axis == "x" else ax.yaxis
    vals = sorted(set(values))
    a.set_minor_locator(NullLocator())
    a.set_minor_formatter(NullFormatter())
    (ax.set_xticks if axis == "x" else ax.set_yticks)(vals, [f"{v:g}" for v in vals])


def byte_log_ticks(ax, lo: float, hi: float, axis: str = "y", most: int = 6) -> None:
    """A log axis of bytes with ticks at powers of two from ``lo`` to ``hi``, at most ``most`` of them
    (every 2nd, 4th ... power when the range is wide), labelled ``64.0 KiB``, ``1.0 MiB``: readable
    where matplotlib's own labels would read 10^5 or overlap.

    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots(); ax.set_yscale("log"); byte_log_ticks(ax, 3000, 2**20)
    >>> [t.get_text() for t in ax.get_yticklabels()]
    ['2.0 KiB', '8.0 KiB', '32.0 KiB', '128.0 KiB', '512.0 KiB', '1.0 MiB']
    """
    import math

    from matplotlib.ticker import NullFormatter, NullLocator

    from .memory import fmt_bytes

    e0, e1 = math.floor(math.log2(max(lo, 1))), math.ceil(math.log2(max(hi, 1)))
    stride = max(1, math.ceil((e1 - e0 + 1) / most))
    exps = list(range(e0, e1 + 1, stride))
    if exps[-1] < e1 and len(exps) < most:
        exps.append(e1)
    ticks = [2.0 ** e for e in exps]
    a = ax.yaxis if axis == "y" else ax.xaxis
    a.set_minor_locator(NullLocator())
    a.set_minor_formatter(NullFormatter())
    (ax.set_yticks if axis == "y" else ax.set_xticks)(ticks, [fmt_bytes(t) for t in ticks])


def plot_breakdown(records: Sequence[dict[str, Any]], budget_bytes: int | None = None, predicted: dict[str, float] | None = None,
                   path: str | None = None, title: str = "measured memory by category"):
    """One stacked bar per record: the categories *at the moment of the peak* (``at_peak``), so each
    bar's height is the measured peak; each category's own peak over the run (``breakdown``, which can
    fall in another phase) is a diamond in its colour beside the bar; an optional predicted total per
    plan (``{plan: bytes}``) is an x. Units follow the data."""
    plt = _plt()
    recs = [r for r in records if r.get("ok")]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(recs) + 2.5), 3.8))
    tops = [r["peak_bytes"] for r in recs] + [v for r in recs for v in (r.get("breakdown") or {}).values()]
    tops += list((predicted or {}).values())
    top = max(tops + [1])
    unit, size = byte_unit(top)
    for i, r in enumerate(recs):
        comp = r.get("at_peak") or r["breakdown"] or {}
        scale = r["peak_bytes"] / max(1, sum(comp.values()))  # CUDA: allocator peak vs tracked tensors
        bottom = 0.0
        for c in CATEGORIES:
            v = comp.get(c, 0) * scale / size
            ax.bar(i, v, bottom=bottom, width=0.6, color=CATEGORY_COLORS[c], label=f"{c} (at peak)" if i == 0 else None)
            bottom += v
        for j, c in enumerate(CATEGORIES):
            own = (r.get("breakdown") or {}).get(c, 0)
            ax.plot(i + 0.36 + 0.05 * j, own / size, "D", color=CATEGORY_COLORS[c], ms=4,
                    label="own peak of each category (diamonds)" if i == 0 and j == 0 else None)
        if predicted and r["plan"] in predicted:
            ax.plot(i, predicted[r["plan"]] / size, "x", color="k", ms=9, label="predicted peak" if i == 0 else None)
    _budget(ax, budget_bytes, top, size)
    ax.set_xticks(range(len(recs)), [r["plan"] for r in recs], rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("plan")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


# ----- charts and tables a notebook cell calls in one line ----------------------------------------
LINE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")
LINE_STYLES = ("-", "--", "-.", ":")
LINE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_lines(series: Mapping[str, Any], xlabel: str, ylabel: str, title: str, unit: str | None = None,
               log: str = "", styles: Mapping[str, dict] | None = None, integer_x: bool = True,
               figsize: tuple[float, float] = (6.4, 3.3)):
    """Curves that stay distinguishable where they lie on top of each other: each series gets its own
    colour, dash and marker, and later ones are drawn thinner over earlier ones (equal loss curves
    show as a thick line with a thin dashed one inside it).

    ``series`` maps a label to ``ys`` (x = 1, 2, ...: optimizer steps) or ``(xs, ys)``. ``unit="bytes"``
    scales y to one unit (B/KiB/MiB/GiB) named in the y label; otherwise put the unit in ``ylabel``.
    ``log`` is ``"x"``, ``"y"`` or ``"xy"``: a log x axis is ticked at the measured x values, a log
    byte axis at powers of two (:func:`value_ticks`, :func:`byte_log_ticks`). Counting x axes (steps,
    K) get whole-number ticks. ``styles`` overrides matplotlib keywords per label (e.g. a theory line
    ``{"color": "k", "ls": "--", "marker": ""}``). Returns the figure, for :func:`show`.

    >>> fig = plot_lines({"fp32": [3.0, 2.5], "fp16": [3.0, 2.6]}, "optimizer step", "loss (nats)", "loss")
    >>> audit(fig), [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    ([], ['fp32', 'fp16'])
    """
    plt = _plt()
    pts = {k: (v if isinstance(v, tuple) else (list(range(1, len(v) + 1)), v)) for k, v in series.items()}
    fig, ax = plt.subplots(figsize=figsize)
    ys_all = [y for _, ys in pts.values() for y in ys if y is not None]
    size = 1
    if unit == "bytes" and "y" in log:       # ticks carry the units (byte_log_ticks): values stay in bytes
        ylabel = f"{ylabel} (bytes, log scale)"
    elif unit == "bytes":
        name, size = byte_unit(max(ys_all + [1]))
        ylabel = f"{ylabel} ({name})"
    n = len(pts)
    for i, (label, (xs, ys)) in enumerate(pts.items()):
        kw = dict(color=LINE_COLORS[i % len(LINE_COLORS)], ls=LINE_STYLES[i % len(LINE_STYLES)],
                  marker=LINE_MARKERS[i % len(LINE_MARKERS)], ms=5 - 3 * i / max(1, n), lw=2.8 - 1.6 * i / max(1, n - 1 or 1),
                  markevery=max(1, len(xs) // 12), label=label, zorder=2 + i)
        kw.update((styles or {}).get(label, {}))
        ax.plot(xs, [None if y is None else y / size for y in ys], **kw)
    xs_all = sorted({x for xs, _ in pts.values() for x in xs})
    if "x" in log:
        ax.set_xscale("log", base=2)
        if len(xs_all) <= 12:
            value_ticks(ax, xs_all, "x")
    elif integer_x and all(float(x).is_integer() for x in xs_all):
        integer_ticks(ax)
    if "y" in log:
        ax.set_yscale("log", base=2)
        if unit == "bytes":
            byte_log_ticks(ax, min(y for y in ys_all if y > 0), max(ys_all))
    elif unit == "bytes":
        ax.set_ylim(bottom=0)                # memory compared on a linear axis: from 0, so ratios read true
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_timings(timings: Mapping[str, Any], title: str, what: str = "step time"):
    """Median time per call of each candidate (bars) with the fastest and slowest repeat (whiskers), from
    :func:`colabkit.interleaved` / :func:`colabkit.step_times`; the clock and device are in the title.

    >>> from colabkit.timing import Timing
    >>> fig = plot_timings({"a": Timing(0.01, 0.009, 0.012, [0.01] * 3)}, "step time")
    >>> audit(fig)
    []
    """
    plt = _plt()
    names = list(timings)
    meds = [timings[k].median for k in names]
    scale, unit = (1e3, "ms") if max(meds) < 1 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2.5), 3.2))
    lo = [(timings[k].median - timings[k].low) * scale for k in names]
    hi = [(timings[k].high - timings[k].median) * scale for k in names]
    ax.bar(range(len(names)), [m * scale for m in meds], width=0.6, color="#4c72b0",
           label=f"median of {timings[names[0]].repeats} repeats")
    ax.errorbar(range(len(names)), [m * scale for m in meds], yerr=[lo, hi], fmt="none", ecolor="k", capsize=4,
                label="fastest .. slowest repeat")
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_xlabel("plan")
    ax.set_ylabel(f"{what} ({unit})")
    t0 = timings[names[0]]
    ax.set_title(f"{title} — untracked, {t0.clock}, on {t0.device}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def results_table(records: Sequence[dict[str, Any]], timings: Mapping[str, Any] | None = None,
                  gpu: bool = True) -> str:
    """The measured records as a Markdown table: peak, peak ÷ the first record's (the baseline), each
    category's own peak, the peak's phase and the loss; with ``timings`` (untracked, interleaved: see
    :func:`colabkit.step_times`) a step-time column. Tracked step times are left out on purpose: they
    include the tracker's per-op overhead and say nothing about speed. With ``gpu`` (and a plan the shipped GPU
    run measured: :mod:`colabkit.gpu_results`), a last column with that run's peak of the same plan at its real
    size and its ratio to that run's baseline: the ratio to hold next to this table's own.

    >>> rec = {"plan": "baseline", "ok": True, "peak_bytes": 2048, "peak_phase": "backward", "loss": 2.5,
    ...        "breakdown": {c: 512 for c in CATEGORIES}}
    >>> print(results_table([rec], gpu=False).splitlines()[2])
    | baseline | 2.0 KiB | 1.00 | 512 B | 512 B | 512 B | 512 B | 512 B | backward | 2.5000 |
    >>> results_table([rec]).splitlines()[2].endswith("GiB (1.00) |")   # the H200's baseline, shipped
    True
    """
    from .memory import fmt_bytes

    base = next((r for r in records if r.get("ok")), None)
    head = ["plan", "peak", "÷ " + (base["plan"] if base else "first")] + list(CATEGORIES) + ["peak in", "loss"]
    if timings:
        t0 = next(iter(timings.values()))
        head.append(f"step time ({t0.device}, untracked)")
    on_gpu = gpu and gpu_column_title() is not None and any(gpu_peak(r["plan"]) for r in records)
    if on_gpu:
        head.append(gpu_column_title())
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        if not r.get("ok"):
            lines.append(f"| {r['plan']} | refused/failed: {r.get('error')} |" + " |" * (len(head) - 2))
            continue
        row = [r["plan"], fmt_bytes(r["peak_bytes"]), f"{r['peak_bytes'] / base['peak_bytes']:.2f}"]
        row += [fmt_bytes(r["breakdown"][c]) for c in CATEGORIES] + [r.get("peak_phase") or "-", f"{r['loss']:.4f}"]
        if timings:
            t = timings.get(r["plan"])
            row.append(f"{t.median * 1e3:.1f} ms ({t.low * 1e3:.1f}–{t.high * 1e3:.1f})" if t else "-")
        if on_gpu:
            g = gpu_peak(r["plan"])
            row.append(f"{fmt_bytes(g[0])} ({g[1]:.2f})" if g else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def phase_table(samples: Sequence[dict[str, Any]]) -> str:
    """A tracker's timeline as a Markdown table, one row per phase of each step: the phase's peak and
    each category alive as it ended (setup and end samples left out).

    >>> s = {"step": 0, "phase": "forward", "phase_peak": 4096, "categories": {c: 1024 for c in CATEGORIES}}
    >>> print(phase_table([s]).splitlines()[2])
    | 0 | forward | 4.0 KiB | 1.0 KiB | 1.0 KiB | 1.0 KiB | 1.0 KiB | 1.0 KiB |
    """
    from .memory import fmt_bytes

    lines = ["| step | phase | phase peak | " + " | ".join(CATEGORIES) + " |", "|" + "---|" * (3 + len(CATEGORIES))]
    for s in _in_steps(samples):
        cats = s.get("categories") or {}
        lines.append(f"| {s.get('step', 0)} | {s['phase']} | {fmt_bytes(s.get('phase_peak'))} | "
                     + " | ".join(fmt_bytes(cats.get(c)) for c in CATEGORIES) + " |")
    return "\n".join(lines)


def show_markdown(text: str) -> None:
    """Display Markdown in a notebook (a results table, a takeaway built from measured values); print it
    elsewhere."""
    if _in_notebook():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text)


# ---- notebooks 07-13 ----
# Charts several notebooks share: runs overlaid on one timeline, curves a reader can tell apart (colour,
# line style and marker all differ), readable log axes, a predicted breakdown against a GPU's capacity,
# and per-rank bars with the measurement next to the prediction.
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">")


def series_style(i: int) -> dict[str, Any]:
    """Colour, line style and marker of the i-th series: no two of the first 40 share all three, so
    curves that lie on top of each other stay distinguishable.

    >>> series_style(0), series_style(5)["linestyle"]
    ({'color': 'C0', 'linestyle': '-', 'marker': 'o'}, '--')
    """
    return {"color": f"C{i % 10}", "linestyle": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)]}


def integer_axis(axis) -> None:
    """Ticks only at whole numbers (steps, K, ranks, world sizes)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def phase_slots(samples: Sequence[dict]) -> tuple[list[float], list[float], list[str]]:
    """``(edges, peaks, phases)``: each training phase of ``samples`` as one slot, a step's phases side by
    side in equal slots of [step, step+1) in the order they ran; ``peaks`` is each phase's peak in bytes
    (len(edges) == len(peaks) + 1). The tracker's setup and end samples are not phases.

    >>> s = [{"step": 0, "phase": p, "phase_peak": b} for p, b in (("forward", 3), ("backward", 5), ("optimizer", 4))]
    >>> phase_slots(s + [{"step": 0, "phase": "end", "phase_peak": 9}])
    ([0.0, 0.3333333333333333, 0.6666666666666666, 1.0], [3, 5, 4], ['forward', 'backward', 'optimizer'])
    """
    rows = [s for s in samples if s.get("phase") in PHASE_COLORS]
    per_step: dict[int, int] = {}
    for s in rows:
        per_step[s.get("step", 0)] = per_step.get(s.get("step", 0), 0) + 1
    edges, seen = [], dict.fromkeys(per_step, 0)
    for s in rows:
        k = s.get("step", 0)
        edges.append(k + seen[k] / per_step[k])
        seen[k] += 1
    edges.append(float(max(per_step) + 1) if per_step else 0.0)
    peaks = [max(s.get("phase_peak") or 0, s.get("allocated_cuda") or 0, s.get("phase_peak_cuda") or 0) for s in rows]
    return [float(e) for e in edges], peaks, [s["phase"] for s in rows]


def _styled_legend(ax, handles, **kw) -> None:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, **kw)


def plot_timelines(runs: dict[str, Sequence[dict]], budget_bytes: int | None = None, title: str = ""):
    """Several runs' device memory on one timeline: each phase's peak as a step line per run (colour,
    line style and a marker at the slot's centre differ per run), the phases of the first run shaded.

    >>> s = [{"step": 0, "phase": p, "phase_peak": b} for p, b in (("forward", 3), ("backward", 5), ("optimizer", 4))]
    >>> fig = plot_timelines({"a": s, "b": s}, title="t"); audit(fig)
    []
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    slots = {name: phase_slots(samples) for name, samples in runs.items()}
    top = max([max(p, default=0) for _, p, _ in slots.values()] + [1])
    unit, size = byte_unit(top)
    handles, shaded = [], []
    edges0, _, phases0 = next(iter(slots.values()))
    for a, b, ph in zip(edges0, edges0[1:], phases0):
        ax.axvspan(a, b, color=PHASE_COLORS[ph], lw=0, zorder=0)
        if ph not in shaded:
            shaded.append(ph)
            handles.append(Patch(color=PHASE_COLORS[ph], label=f"{ph} phase"))
    for i, (name, (edges, peaks, _)) in enumerate(slots.items()):
        st = series_style(i)
        ax.stairs([p / size for p in peaks], edges, baseline=None, color=st["color"], linestyle=st["linestyle"], lw=1.6)
        centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        ax.plot(centres, [p / size for p in peaks], ls="none", marker=st["marker"], ms=4, color=st["color"])
        handles.append(Line2D([], [], lw=1.6, ms=4, label=name, **st))
    if budget_bytes:
        _budget(ax, budget_bytes, top, size)
        handles += [h for h in ax.get_legend_handles_labels()[0] if h.get_label().startswith("budget")]
    ax.set_ylim(bottom=0)
    integer_axis(ax.xaxis)
    ax.set_xlabel("optimizer step (each step's phases side by side)")
    ax.set_ylabel(f"device memory, peak in phase ({unit})")
    ax.set_title(title or "device memory by phase", fontsize=9)
    _styled_legend(ax, handles)
    fig.tight_layout()
    return fig


def _log_axis(axis, values: Sequence[float]) -> None:
    """A log axis a reader can read: at most 8 distinct data values become the ticks, written plainly
    (256, 1024, 0.5), with no minor-tick labels crowding them; otherwise decades only."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    vals = sorted({float(v) for v in values if v and v > 0})
    if 1 < len(vals) <= 8:
        axis.set_major_locator(FixedLocator(vals))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_locator(NullLocator())
    else:
        axis.set_major_locator(LogLocator(base=10, numticks=8))
        axis.set_minor_formatter(NullFormatter())


def line_chart(ax, series: dict[str, Any], xlabel: str, ylabel: str, title: str = "", log: str = "",
               integer_x: bool = False, ticks_at_data: bool = True, styles: dict[str, int] | None = None,
               marks: dict[str, float] | None = None) -> None:
    """Draw ``series`` (label -> y values at x = 1, 2, ... or an ``(xs, ys)`` pair; None values skipped)
    into ``ax``, each in its own colour, line style and marker (``styles``: label -> :func:`series_style`
    index, so a label looks the same in every panel). ``log``: "x", "y" or "xy"; a log x axis is ticked
    at the data's x values (when ``ticks_at_data``), written plainly. ``marks``: label -> x of a dotted
    vertical line (an event: "killed here")."""
    all_x: list[float] = []
    for i, (label, data) in enumerate(series.items()):
        i = (styles or {}).get(label, i)
        xs, ys = data if isinstance(data, tuple) else (list(range(1, len(data) + 1)), data)
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        all_x += [x for x, _ in pts]
        ax.plot([x for x, _ in pts], [y for _, y in pts], lw=1.4, ms=4, label=label, **series_style(i))
    for label, x in (marks or {}).items():
        ax.axvline(x, color="0.4", ls=":", lw=1.2, label=label)
    if "x" in log:
        ax.set_xscale("log")
        if ticks_at_data:
            _log_axis(ax.xaxis, all_x)
    if "y" in log:
        ax.set_yscale("log")
        _log_axis(ax.yaxis, [])
    if integer_x and "x" not in log:
        integer_axis(ax.xaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def charts(*panels: dict[str, Any], width: float = 5.5, height: float = 3.6):
    """One figure with a :func:`line_chart` per panel (each a dict of its arguments), side by side; a
    label keeps its colour, line style and marker across the panels.

    >>> fig = charts(dict(series={"a": [3, 2, 1]}, xlabel="step (count)", ylabel="loss (nats)", title="t"))
    >>> audit(fig)
    []
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
    labels = list(dict.fromkeys(label for panel in panels for label in panel["series"]))
    for ax, panel in zip(axes[0], panels):
        line_chart(ax, **{"styles": {label: i for i, label in enumerate(labels)}, **panel})
    fig.tight_layout()
    return fig


def plot_estimates(estimates: Sequence[dict[str, Any]], title: str = ""):
    """Predicted memory at the peak of each estimate as one horizontal bar: the categories at the peak,
    then what the GPU adds (its overheads, hatched), against the capacity the estimates were judged by
    (their own ``budget_bytes``: one source for the line and the verdict). The verdict ends each bar."""
    from matplotlib.patches import Patch

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 0.7 * len(estimates) + 1.6))
    budget = estimates[0]["budget_bytes"]
    top = max([budget] + [r["resources"]["device"]["need"] if "resources" in r else r["peak_bytes"] for r in estimates])
    unit, size = byte_unit(top)
    for i, r in enumerate(estimates):
        left = 0.0
        for c in [c for c in CATEGORIES if r["at_peak"][c]]:
            ax.barh(i, r["at_peak"][c] / size, left=left, color=CATEGORY_COLORS[c])
            left += r["at_peak"][c] / size
        extra = sum((r.get("overheads") or {}).values()) / size
        ax.barh(i, extra, left=left, color="#bbbbbb", hatch="//")
        ax.text(left + extra, i, f" {r.get('verdict') or ('fits' if r.get('fits') else 'does not fit')}",
                va="center", fontsize=8)
    profile = (estimates[0].get("device") or "").upper()
    ax.axvline(budget / size, color="k", ls="--", lw=1)
    ax.set_yticks(range(len(estimates)), [f"{r['model']}\n{r['plan']}" for r in estimates], fontsize=8)
    ax.set_ylabel("model and plan (names)")
    ax.set_xlim(0, top / size * 1.25)
    ax.set_xlabel(f"predicted memory at the peak ({unit})")
    ax.set_title(title or f"will it fit? predicted for a {profile}", fontsize=9)
    handles = [Patch(color=CATEGORY_COLORS[c], label=c) for c in CATEGORIES if any(r["at_peak"][c] for r in estimates)]
    handles += [Patch(facecolor="#bbbbbb", hatch="//", label="GPU overheads"),
                plt.Line2D([], [], color="k", ls="--", lw=1, label=f"{profile} capacity {budget / size:.2f} {unit}")]
    _styled_legend(ax, handles)
    fig.tight_layout()
    return fig


def plot_per_rank(measured: dict[str, dict[str, int]], predicted: dict[str, dict[str, int]],
                  title: str = "per-rank memory: measured next to predicted"):
    """For each stage (or run) two stacked bars side by side — measured (solid) and predicted (hatched) —
    of the categories of one rank, so where the prediction misses is visible per category."""
    from matplotlib.patches import Patch

    plt = _plt()
    names = list(measured)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(names) + 2.5), 3.8))
    top = max(sum(b.values()) for b in [*measured.values(), *predicted.values()]) or 1
    unit, size = byte_unit(top)
    for i, name in enumerate(names):
        for dx, src, hatch in ((-0.2, measured, None), (0.2, predicted, "//")):
            if name not in src:
                continue
            bottom = 0.0
            for c in CATEGORIES:
                v = src[name].get(c, 0) / size
                if v:  # an empty category draws nothing (and needs no legend entry)
                    ax.bar(i + dx, v, width=0.38, bottom=bottom, color=CATEGORY_COLORS[c], hatch=hatch, edgecolor="white")
                bottom += v
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("stage (left bar measured, right bar predicted)")
    ax.set_ylabel(f"one rank's memory, categories stacked ({unit})")
    ax.set_title(title, fontsize=9)
    shown = [c for c in CATEGORIES if any(b.get(c) for b in [*measured.values(), *predicted.values()])]
    handles = [Patch(color=CATEGORY_COLORS[c], label=c) for c in shown]
    handles += [Patch(facecolor="white", edgecolor="k", label="measured"),
                Patch(facecolor="white", edgecolor="k", hatch="//", label="predicted")]
    _styled_legend(ax, handles)
    fig.tight_layout()
    return fig

"""What a lesson shows beside its measurements: a score of an answer against the wanted one, the loss
curve of a fine-tune, one comparison figure on a shared scale from 0, the planner's plans with labels that
never overlap, and numbers written without noise (no "-0.00", no raw dicts).

These sit on top of :mod:`colabkit.plots` (the figures pass its :func:`~colabkit.plots.audit`).

>>> answer_score("Two small matrices", "Two small matrices per layer")
0.6428571428571429
>>> signed(-0.0001, "{:+.2f}%")
'+0.00%'
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .memory import fmt_bytes
from .plots import _plt, byte_unit


def answer_score(answer: str, wanted: str) -> float:
    """The share of ``wanted``'s characters that ``answer`` has at the same position (0..1): a greedy
    answer that starts right scores high, a fluent but wrong one about 0.

    >>> answer_score("", "abc"), answer_score("abc", "abc"), answer_score("xbc", "abcd")
    (0.0, 1.0, 0.5)
    """
    if not wanted:
        raise ValueError("answer_score needs a non-empty wanted answer")
    return sum(a == w for a, w in zip(answer, wanted)) / len(wanted)


def mean_score(answers: Mapping[str, str], wanted: Mapping[str, str], chars: int | None = None) -> float:
    """The mean :func:`answer_score` over the prompts of ``answers``; ``chars`` cuts each wanted answer
    to the length that was generated.

    >>> mean_score({"q": "ab", "r": "zz"}, {"q": "ab", "r": "xy"})
    0.5
    """
    if not answers:
        raise ValueError("mean_score needs at least one answer")
    return sum(answer_score(a, wanted[p][:chars]) for p, a in answers.items()) / len(answers)


def signed(value: float, fmt: str = "{:+.1f}") -> str:
    """``fmt`` applied to ``value`` with a rounded-away sign dropped: a change that rounds to zero is
    written as zero, never ``-0.0``.

    >>> signed(-0.04), signed(-0.06), signed(-0.001, "{:.0%}")
    ('+0.0', '-0.1', '0%')
    """
    text = fmt.format(value)
    if not any(ch in "123456789" for ch in text):   # rounds to zero: no sign left over
        return fmt.format(0.0)
    return text


def before_after_table(before: Mapping[str, str], after: Mapping[str, str], wanted: Mapping[str, str],
                       chars: int | None = None) -> str:
    """A Markdown table: each prompt, the answer before and after fine-tuning, the wanted answer and the
    score of each (:func:`answer_score`), with the means in the last row.

    >>> print(before_after_table({"q": "xx"}, {"q": "ab"}, {"q": "ab"}).splitlines()[2])
    | q | `xx` | 0.00 | `ab` | 1.00 | `ab` |
    """
    rows = ["| prompt | before | score | after | score | wanted |", "|---|---|---|---|---|---|"]
    for p in before:
        w = wanted[p][:chars]
        rows.append(f"| {p} | `{before[p]}` | {answer_score(before[p], w):.2f} | `{after[p]}` | "
                    f"{answer_score(after[p], w):.2f} | `{w}` |")
    rows.append(f"| **mean** | | {mean_score(before, wanted, chars):.2f} | | {mean_score(after, wanted, chars):.2f} | |")
    return "\n".join(rows)


def loss_curve(losses: Sequence[float], title: str, window: int = 5):
    """The loss per optimizer step with the means of the first and the last ``window`` steps drawn as
    dashed lines; y from 0. Returns the figure, for :func:`colabkit.plots.show`.

    >>> from colabkit.plots import audit
    >>> audit(loss_curve([3.0, 2.5, 2.0, 1.0, 0.8, 0.7], "fine-tuning", window=2))
    []
    """
    if len(losses) < 2 * window:
        raise ValueError(f"loss_curve needs at least {2 * window} steps to compare the first and last {window}")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, color="#4c72b0", marker="o", ms=3, lw=1.5, label="loss of the step")
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    ax.hlines(first, 1, window, colors="#c44e52", linestyles="--", lw=2, label=f"mean of the first {window}")
    ax.hlines(last, len(losses) - window + 1, len(losses), colors="#55a868", linestyles="--", lw=2,
              label=f"mean of the last {window}")
    ax.set_ylim(0, max(losses) * 1.08)
    ax.set_xlabel("optimizer step (count)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def compare_bars(values: Mapping[str, float], title: str, ylabel: str = "peak memory",
                 budget_bytes: int | None = None):
    """One comparison figure: a bar per run (baseline first), bytes on one shared y axis from 0, each
    bar labelled with its value and its ratio to the first. Returns the figure.

    >>> from colabkit.plots import audit
    >>> audit(compare_bars({"baseline": 8 << 20, "checkpoint": 5 << 20}, "peak"))
    []
    """
    if not values:
        raise ValueError("compare_bars needs at least one run")
    plt = _plt()
    names = list(values)
    top = max(list(values.values()) + [budget_bytes or 0])
    unit, size = byte_unit(top)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(names) + 3.0), 3.2))
    base = values[names[0]]
    colors = ["#8c8c8c"] + ["#4c72b0"] * (len(names) - 1)
    ax.bar(range(len(names)), [values[n] / size for n in names], width=0.6, color=colors)
    for i, n in enumerate(names):
        ax.annotate(f"{fmt_bytes(values[n])}\n{values[n] / base:.2f}x" if base else fmt_bytes(values[n]),
                    (i, values[n] / size), ha="center", va="bottom", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color="#8c8c8c", label=f"{names[0]} (the reference)")]
    if len(names) > 1:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="#4c72b0", label="with the technique"))
    if budget_bytes:
        handles.append(ax.axhline(budget_bytes / size, color="#c44e52", ls="--", lw=1.2, label="budget"))
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylim(0, top / size * 1.25)
    ax.set_xlabel("run")
    ax.set_ylabel(f"{ylabel} ({unit})")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def table(rows: Sequence[Mapping[str, Any]], formats: Mapping[str, str] | None = None) -> str:
    """Dicts as a Markdown table (the keys of the first row are the columns), instead of printing raw
    dicts; ``formats`` maps a column to a format string ("{:.3f}"), bytes columns ending in ``_bytes``
    are written with :func:`~colabkit.memory.fmt_bytes`.

    >>> print(table([{"step": 1, "loss": 2.345678, "peak_bytes": 2048}], {"loss": "{:.3f}"}))
    | step | loss | peak |
    |---|---|---|
    | 1 | 2.346 | 2.0 KiB |
    """
    if not rows:
        return ""
    cols = list(rows[0])
    heads = [c[: -len("_bytes")] if c.endswith("_bytes") else c for c in cols]

    def cell(c: str, v: Any) -> str:
        if v is None:
            return "-"
        if c.endswith("_bytes"):
            return fmt_bytes(v)
        if formats and c in formats:
            return signed(v, formats[c]) if isinstance(v, float) else formats[c].format(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _free_spot(ax, renderer, text, placed: list, anchor_px: tuple[float, float], rings: int = 10) -> bool:
    """Move ``text`` (an annotation at a data point) to the first offset around its point, in growing rings,
    where its box overlaps no box in ``placed`` and stays inside the axes; returns whether one was found."""
    import math

    from matplotlib.text import Text

    inside = ax.get_window_extent(renderer)
    for ring in range(rings + 1):
        for k in range(8 if ring else 1):
            a = 2 * math.pi * k / 8
            r = 8 + 11 * ring
            text.set_position((r * math.cos(a), r * math.sin(a)))
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer).expanded(1.08, 1.15)   # the number, not its leader line
            if (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1
                    and not any(box.overlaps(b) for b in placed)):
                placed.append(box)
                return True
    return False


def plan_chart(rows: Sequence[Mapping[str, Any]], budget_bytes: int | None = None, title: str = ""):
    """The planner's rows (:func:`colabkit.plans`) as predicted peak against predicted step-time overhead,
    legible at any number of plans: each point is numbered, the number is placed where it overlaps no other
    label (in rings around its point, with a leader line when moved), and the numbers are named in a list
    beside the axes. Green fits, red does not; the budget is a dotted line; y from 0.

    >>> from colabkit.plots import audit
    >>> rows = [{"plan": "baseline", "peak_bytes": 3 << 30, "overhead": 0.0, "fits": True},
    ...         {"plan": "checkpoint", "peak_bytes": 2 << 30, "overhead": 0.16, "fits": True}]
    >>> audit(plan_chart(rows, budget_bytes=14 << 30, title="plans"))
    []
    """
    pts = [r for r in rows if r.get("peak_bytes") and r.get("overhead") is not None]
    if not pts:
        raise ValueError("plan_chart needs rows with a predicted peak and overhead (from colabkit.plans)")
    plt = _plt()
    from matplotlib.lines import Line2D

    n = len(pts)
    fig = plt.figure(figsize=(10.5, max(4.2, 0.19 * n + 1.6)))
    ax = fig.add_axes([0.08, 0.13, 0.52, 0.78])
    top = max([r["peak_bytes"] for r in pts] + [budget_bytes or 0])
    unit, size = byte_unit(top)
    xs = [r["overhead"] * 100 for r in pts]
    ys = [r["peak_bytes"] / size for r in pts]
    colors = ["#55a868" if r["fits"] else "#c44e52" for r in pts]
    ax.scatter(xs, ys, c=colors, s=22, zorder=3)
    if budget_bytes:
        ax.axhline(budget_bytes / size, color="0.4", ls=":", lw=1.2)
    pad = max(1.0, (max(xs) - min(xs)) * 0.12)
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_ylim(0, top / size * 1.15)
    ax.set_xlabel("predicted step-time overhead vs the plain step (%)")
    ax.set_ylabel(f"predicted peak ({unit})")
    ax.set_title(title or "plans: predicted memory vs step time", fontsize=9)
    renderer = fig.canvas.get_renderer()
    placed = [ax.title.get_window_extent(renderer)]
    for i, (x, y) in enumerate(zip(xs, ys), 1):
        t = ax.annotate(str(i), (x, y), xytext=(0, 0), textcoords="offset points", fontsize=7, zorder=4,
                        arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=2))
        if not _free_spot(ax, renderer, t, placed, (x, y)):
            t.remove()                                    # no room: the number stays in the list only
    names = "\n".join(f"{i:>2}  {r['plan']}" for i, r in enumerate(pts, 1))
    fig.text(0.62, 0.91, names, va="top", ha="left", fontsize=7, family="monospace")
    handles = [Line2D([], [], ls="none", marker="o", color=c, label=label)
               for c, label, kind in (("#55a868", "fits", True), ("#c44e52", "does not fit", False))
               if any(bool(r["fits"]) == kind for r in pts)]   # an entry only for what the chart shows
    if budget_bytes:
        handles.append(Line2D([], [], color="0.4", ls=":", label="budget"))
    ax.legend(handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(1.02, 0.0), frameon=False)
    return fig

"""What every colabkit chart shares, live or static: byte units that scale with the data, the colours
of phases and categories, the budget line, whole-number ticks, and the matplotlib backend (Agg without a
notebook), and the readability check every figure passes before a notebook shows it (:func:`audit`,
:func:`show`). :mod:`colabkit.liveplot` and :mod:`colabkit.plots` both draw with these.

>>> byte_unit(3 * 2**20), CATEGORY_COLORS["other"]
(('MiB', 1048576), '#8c8c8c')
"""
from __future__ import annotations

from typing import Sequence


PHASE_COLORS = {"forward": "#cfe8ff", "backward": "#ffe0c2", "optimizer": "#d9f2d0", "eval": "#eeeeee"}
CATEGORY_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
                   "other": "#8c8c8c"}
UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def byte_unit(top: float) -> tuple[str, int]:
    """The largest unit in which ``top`` bytes is at least 1 (B/KiB/MiB/GiB): ``(name, bytes)``."""
    return next(((u, s) for u, s in UNITS if top >= s), UNITS[-1])


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and "IPKernelApp" in ip.config
    except Exception:  # no IPython: headless
        return False


def _plt():
    import matplotlib

    if not _in_notebook():
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _budget(ax, budget_bytes: int | None, top: float, size: int) -> None:
    """The budget as a dashed line when it is on scale (within 4x the data), else only in the legend."""
    if not budget_bytes:
        return
    unit, usize = byte_unit(budget_bytes)
    label = f"budget {budget_bytes / usize:.1f} {unit}"
    if budget_bytes <= 4 * top:
        ax.axhline(budget_bytes / size, color="k", ls="--", lw=1, label=label)
    else:
        ax.plot([], [], color="k", ls="--", lw=1, label=label + " (off scale)")


def _in_steps(samples: Sequence[dict]) -> list[dict]:
    """The samples taken inside steps: not the tracker's "setup" (building the model) nor its "end"
    (after the last step), which would otherwise take a slot of a step of their own."""
    return [s for s in samples if s.get("phase") not in ("setup", "end")]


def integer_ticks(ax, axis: str = "x") -> None:
    """Ticks only at whole numbers on an axis that counts (steps, K, blocks): no 0.5 steps.

    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots(); _ = ax.plot([0, 1, 2], [1, 2, 3]); integer_ticks(ax); fig.canvas.draw()
    >>> all(float(t).is_integer() for t in ax.get_xticks())
    True
    """
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


# ----- the readability check every notebook figure passes -------------------------------------
_UNIT_WORDS = ("(B)", "(KiB)", "(MiB)", "(GiB)", "(s)", "(%)", "(x)", "(ms)", "(bytes", "(tokens", "(steps", "(count",
               "(loss", "(sequence", "(N)", "(rank", "(relative")


def _colors_used(ax) -> set[str]:
    """Colours of the data artists of an axes (lines with data, bars, areas, scatter points)."""
    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_hex

    used: set[str] = set()
    for line in ax.get_lines():
        if len(line.get_xdata()):  # empty lines exist only to carry a legend entry
            # a markers-only line (error-bar caps) shows its marker colour, not its line colour
            markers_only = line.get_linestyle() in ("None", "", " ")
            used.add(to_hex(line.get_markeredgecolor() if markers_only else line.get_color()))
    for patch in ax.patches:
        if patch.get_visible():
            used.add(to_hex(patch.get_facecolor()))
    for coll in ax.collections:
        # lines (error bars, vlines) are drawn in their edge colour; areas and markers in their face colour
        fc = coll.get_edgecolor() if isinstance(coll, LineCollection) else coll.get_facecolor()
        if len(fc):
            used.add(to_hex(fc[0]))
    return used


def _legend_colors(ax) -> set[str]:
    from matplotlib.colors import to_hex

    leg = ax.get_legend()
    out: set[str] = set()
    if leg is None:
        return out
    for h in leg.legend_handles:
        for getter in ("get_color", "get_facecolor"):
            c = getattr(h, getter, lambda: None)()
            if c is None or isinstance(c, str) and c == "none" or not isinstance(c, str) and len(c) == 0:
                continue
            if not isinstance(c, str) and len(c) and hasattr(c[0], "__len__"):  # an array of RGBA rows
                c = c[0]
            out.add(to_hex(c))
    return out


def audit(fig) -> list[str]:
    """What makes ``fig`` hard to read: an axes without x/y labels, no unit in parentheses on either
    axis label, no title (axes or figure), or a colour drawn that no legend names. [] when fine.

    >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    >>> fig, ax = plt.subplots(); _ = ax.plot([0, 1], [0, 1], color="red")
    >>> audit(fig)[:2]
    ['axes 0: no x label', 'axes 0: no title']
    """
    problems = []
    suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
    axes = [ax for ax in fig.axes if ax.get_visible()]
    twins = {id(b) for a in axes for b in axes if a is not b and a.bbox.bounds == b.bbox.bounds and axes.index(b) > axes.index(a)}
    legend_colors = set().union(*[_legend_colors(ax) for ax in axes]) if axes else set()
    for k, ax in enumerate(axes):
        if not (ax.lines or ax.patches or ax.collections or ax.images):
            continue
        if id(ax) not in twins:
            if not ax.get_xlabel():
                problems.append(f"axes {k}: no x label")
            if not ax.get_title() and not suptitle:
                problems.append(f"axes {k}: no title")
        ylabel = ax.get_ylabel()
        if not ylabel:
            problems.append(f"axes {k}: no y label")
        elif "(" not in ylabel and "(" not in ax.get_xlabel():  # the value axis names its unit (x for barh)
            problems.append(f"axes {k}: y label {ylabel!r} has no unit in parentheses")
        missing = _colors_used(ax) - legend_colors
        if missing:
            problems.append(f"axes {k}: colours {sorted(missing)} are not in any legend")
    return problems


def show(fig=None) -> None:
    """Check ``fig`` with :func:`audit` (an AssertionError names what a reader could not read), then
    display it once: how every notebook shows a chart.

    Returns None on purpose: a cell ending in ``show(fig)`` would otherwise display the returned figure a
    second time (IPython shows a cell's last value); keep your own reference to ``fig`` to inspect it."""
    plt = _plt()
    fig = fig if fig is not None else plt.gcf()
    problems = audit(fig)
    assert not problems, "unreadable figure: " + "; ".join(problems)
    if _in_notebook():
        from IPython.display import display

        display(fig)
        plt.close(fig)

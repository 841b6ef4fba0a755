"""The live memory plot, redrawn in place while training: device memory by phase (the within-phase peak,
CUDA's reserved, host RAM on its own axis) beside each category's memory, phases shaded and named.

The live plot needs no widget manager: in a notebook it updates one display handle in place; without
IPython it only keeps the data and ``save()`` writes the PNG.

>>> lp = LivePlot(budget_bytes=2**30)
>>> lp.update({"t": 0.0, "step": 0, "phase": "forward", "allocated": 2**20, "phase_peak": 2**20,
...            "reserved": None, "host_rss": None})
>>> len(lp.samples), byte_unit(3 * 2**20)
(1, ('MiB', 1048576))
"""
from __future__ import annotations

import time
from typing import Sequence

from .chartstyle import CATEGORY_COLORS, PHASE_COLORS, _budget, _in_notebook, _in_steps, _plt, byte_unit, integer_ticks
from .env import T4_USABLE_BYTES
from .memory import CATEGORIES


def _x(samples: Sequence[dict]) -> tuple[list[float], float, str]:
    """Positions in optimizer steps and the width of one slot: step k is (k, k+1] cut into as many equal
    slots as the busiest step has samples (one sample per phase boundary), sample j of step k at
    k + j/slots. Every step uses the same slots, so an unfinished last step (a live plot mid-step) or a
    step with an extra phase does not stretch its phases over the whole step."""
    per_step: dict[int, int] = {}
    for s in samples:  # (the caller drops the tracker's "setup" and "end" samples: not part of a step)
        per_step[s.get("step", 0)] = per_step.get(s.get("step", 0), 0) + 1
    slots = max(per_step.values(), default=1)
    seen: dict[int, int] = {}
    xs = []
    for s in samples:
        k = s.get("step", 0)
        seen[k] = seen.get(k, 0) + 1
        xs.append(k + seen[k] / slots)
    return xs, 1.0 / slots, "optimizer step (its phases side by side)"


def _phase_bands(ax, samples: Sequence[dict], xs: list[float], width: float) -> None:
    """Shade each sample's slot (x - width, x] by the phase that ended at its right edge (a sample is
    taken as a phase ends), and name each phase used once in the legend."""
    used = []
    for s, x in zip(samples, xs):
        color = PHASE_COLORS.get(s.get("phase"))
        if color:
            ax.axvspan(x - width, x, color=color, lw=0, zorder=0, label=f"{s['phase']} phase" if s["phase"] not in used else None)
            if s["phase"] not in used:
                used.append(s["phase"])


HOST_RAM_NOTE = ("host RAM (right axis): resident memory of this whole process\n"
                 "(Python, libraries, data loading; on a CPU run also the model)")


def draw_timeline(ax, samples: Sequence[dict], budget_bytes: int | None = T4_USABLE_BYTES, title: str = "") -> None:
    """Device memory over time: the within-phase peak (and CUDA's reserved), phases shaded and named
    in the legend, the budget when on scale, host RAM (RSS) on a second axis in its own units with
    room above it. Each value holds over the phase that ended at its sample (a step line drawn from the
    start of the first phase, so the first forward is drawn too)."""
    samples = _in_steps(samples) or list(samples)
    xs, width, xlabel = _x(samples)
    _phase_bands(ax, samples, xs, width)
    alloc = [max(s.get("phase_peak") or 0, s.get("allocated_cuda") or 0, s.get("phase_peak_cuda") or 0) for s in samples]
    reserved = [s.get("reserved") or 0 for s in samples]
    top = max(alloc + reserved + [1])
    unit, size = byte_unit(top)
    x0 = [xs[0] - width] + xs  # the leading point: the first phase's interval starts one slot earlier
    ax.step(x0, [alloc[0] / size] + [a / size for a in alloc], where="pre", color="#c44e52", lw=1.8,
            label="allocated (peak in phase)")
    if any(reserved):
        ax.step(x0, [reserved[0] / size] + [r / size for r in reserved], where="pre", color="#4c72b0", lw=1.2,
                label="reserved (CUDA cache)")
    _budget(ax, budget_bytes, top, size)
    drawn_budget = bool(budget_bytes) and budget_bytes <= 4 * top
    ax.set_ylim(0, 1.15 * max(top, budget_bytes if drawn_budget else 0) / size)
    ax.set_xlim(x0[0], xs[-1])
    integer_ticks(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or "device memory by phase", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    rss = [s.get("host_rss") or 0 for s in samples]
    if any(rss):
        hunit, hsize = byte_unit(max(rss))
        ax2 = ax.twinx()
        ax2.step(x0, [rss[0] / hsize] + [r / hsize for r in rss], where="pre", color="#8172b2", lw=1.6, label=HOST_RAM_NOTE)
        ax2.set_ylabel(f"host RAM, process RSS ({hunit})", color="#8172b2")
        ax2.set_ylim(0, 1.25 * max(rss) / hsize)  # headroom: the line is not clipped by the frame
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.2 if any(rss) else 1.01, 1.0), fontsize=7)


def draw_categories(ax, samples: Sequence[dict], budget_bytes: int | None = None, title: str = "") -> None:
    """Memory over time by category as stacked areas (parameters flat, activations rising in forward
    and falling in backward, gradients appearing, optimizer state from the first step), phases shaded.
    Samples are taken at phase boundaries, so each area steps from one boundary to the next."""
    rows = [s for s in _in_steps(samples) if s.get("categories")]
    if not rows:
        raise ValueError("no per-category samples: track with categories=True (the default)")
    xs, width, xlabel = _x(rows)
    _phase_bands(ax, rows, xs, width)
    top = max(sum(s["categories"].values()) for s in rows) or 1
    unit, size = byte_unit(top)
    # each boundary's value holds over the phase that ended there (step="pre"), from one slot earlier
    xs = [xs[0] - width] + xs
    ys = [[s["categories"][c] / size for s in rows[:1] + rows] for c in CATEGORIES]
    ax.stackplot(xs, ys, colors=[CATEGORY_COLORS[c] for c in CATEGORIES], labels=list(CATEGORIES), step="pre",
                 alpha=0.9, zorder=2)
    _budget(ax, budget_bytes, top, size)
    ax.set_ylim(0, 1.1 * top / size)
    ax.set_xlim(xs[0], xs[-1])
    integer_ticks(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title or "memory by category over time", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def plot_timeline(samples: Sequence[dict], budget_bytes: int | None = None, title: str = "", categories: bool = True):
    """A tracker's timeline (``tracker.timeline``, or the samples a live plot collected) as one figure:
    device memory by phase (:func:`draw_timeline`) and, when the samples carry categories, the stacked
    categories beside it (:func:`draw_categories`). Returns the figure, for :func:`show`."""
    plt = _plt()
    two = categories and any(s.get("categories") for s in _in_steps(samples))
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(14 if two else 8, 3.3), squeeze=False)
    draw_timeline(axes[0][0], samples, budget_bytes, title)
    if two:
        draw_categories(axes[0][1], samples, None, "by category" + (f" — {title}" if title else ""))
    fig.tight_layout()
    return fig


class LivePlot:
    """Memory plot redrawn in place during training; pass ``live_plot=LivePlot()`` to ``train``
    (or ``on_sample=lp.update`` to a tracker). ``save(path)`` writes a PNG (works headless).
    With ``categories=True`` a second panel stacks the categories over time; ``widget=True`` redraws
    inside its own ``ipywidgets.Output`` (for a plot shown inside another widget, e.g. a picker).

    Redraws are throttled so drawing never dominates the run it watches: at most one per ``every_s``
    seconds and at most one per four times the last draw's duration (a busy shared CPU draws slowly);
    ``close()`` draws only when samples arrived since the last draw, so no picture is shown twice.
    """

    def __init__(self, budget_bytes: int | None = T4_USABLE_BYTES, every_s: float = 0.5, title: str = "",
                 display: bool | None = None, categories: bool = True, widget: bool = False):
        self.budget_bytes = budget_bytes
        self.every_s = every_s
        self.title = title
        self.categories = categories
        self.samples: list[dict] = []
        self._display = _in_notebook() if display is None else display
        # widget=True: redraw inside an ipywidgets.Output (clear + display). Use it when the plot is shown
        # inside another widget's Output (a picker's): a display handle's update does not reach in there.
        self.widget = widget
        self._handle = None
        self._last = 0.0        # when the last draw ended (perf_counter)
        self._cost = 0.0        # how long the last draw took, s
        self._drawn = 0         # samples in the last picture drawn

    def update(self, sample: dict) -> None:
        self.samples.append(sample)
        if self._display and time.perf_counter() - self._last >= max(self.every_s, 4 * self._cost):
            self.redraw()

    def figure(self):
        return plot_timeline(self.samples, self.budget_bytes, self.title, self.categories)

    def redraw(self) -> None:
        """Draw the current samples into the notebook's display handle (created on first call)."""
        start = time.perf_counter()
        if not self._display or not self.samples:
            self._last = start
            return
        from IPython.display import display

        fig = self.figure()
        if self.widget:
            if self._handle is None:
                import ipywidgets

                self._handle = ipywidgets.Output()
                display(self._handle)
            with self._handle:
                from IPython.display import clear_output

                clear_output(wait=True)
                display(fig)
        elif self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)
        _plt().close(fig)
        self._drawn = len(self.samples)
        self._last = time.perf_counter()
        self._cost = self._last - start

    def close(self) -> None:
        """Final redraw with every sample (none when the last picture already had them all)."""
        if len(self.samples) != self._drawn:
            self.redraw()

    def save(self, path: str) -> str:
        fig = self.figure()
        fig.savefig(path, dpi=110)
        _plt().close(fig)
        return path

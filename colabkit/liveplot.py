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


PHASE_STEPS = 4   # up to this many steps, each phase has a slot of its own; more: one slot per step
MAX_SLOTS = 12    # more steps than this: a slot per group of steps, so a long run stays readable
ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "eval": "eval"}


def _slots(samples: Sequence[dict]) -> tuple[list[tuple[float, float, str | None, list[dict]]], str]:
    """``([(x0, x1, phase, samples)], x label)``: where each slot of the x axis (in optimizer steps) starts
    and ends and the samples it shows. While a run has at most :data:`PHASE_STEPS` steps each sample (a
    phase) is a slot of its own (:func:`_x`'s equal slots); a longer run gets one slot per step, or per
    group of steps past :data:`MAX_SLOTS`, whose values are the peaks over its phases (``phase`` None).

    >>> s = [{"step": k, "phase": p} for k in range(30) for p in ("forward", "backward", "optimizer")]
    >>> slots, label = _slots(s); len(slots), slots[0][:3], label
    (10, (0, 3, None), 'optimizer step (peak over each 3 steps)')
    """
    steps = sorted({s.get("step", 0) for s in samples})
    if len(steps) <= PHASE_STEPS:
        xs, width, label = _x(samples)
        return [(x - width, x, s.get("phase"), [s]) for s, x in zip(samples, xs)], label
    per = -(-len(steps) // MAX_SLOTS)  # steps per slot
    groups: dict[int, list[dict]] = {}
    for s in samples:
        groups.setdefault((s.get("step", 0) - steps[0]) // per, []).append(s)
    slots = [(steps[0] + g * per, steps[0] + (g + 1) * per, None, rows) for g, rows in sorted(groups.items())]
    return slots, ("optimizer step (peak over each step's phases)" if per == 1 else
                   f"optimizer step (peak over each {per} steps)")


def _phase_bands(ax, slots) -> None:
    """Shade each phase's slot in its colour and name each phase used once in the legend (slots of
    several phases, in a long run, are not shaded)."""
    used = []
    for x0, x1, phase, _ in slots:
        color = PHASE_COLORS.get(phase)
        if color:
            ax.axvspan(x0, x1, color=color, lw=0, zorder=0, label=f"{phase} phase" if phase not in used else None)
            if phase not in used:
                used.append(phase)


def _legend_outside(ax, handles=None, labels=None, x: float = 1.01) -> None:
    """The legend to the right of the axes, outside the data (``x`` in axes widths, past a twin axis's labels)."""
    args = (handles, labels) if handles is not None else ()
    ax.legend(*args, loc="upper left", bbox_to_anchor=(x, 1.0), fontsize=7, borderaxespad=0.0)


HOST_RAM_NOTE = ("host RAM (right axis):\nresident memory of this whole process\n"
                 "(Python, libraries, data;\non a CPU also the model)")


def draw_timeline(ax, samples: Sequence[dict], budget_bytes: int | None = T4_USABLE_BYTES, title: str = "") -> None:
    """Device memory over time: the within-phase peak (and CUDA's reserved), phases shaded and named
    in the legend, the budget when on scale, host RAM (RSS) on a second axis in its own units with
    room above it. Each value holds over the phase that ended at its sample (a step line drawn from the
    start of the first phase, so the first forward is drawn too); a long run shows each step's (or group
    of steps') peak instead (:func:`_slots`)."""
    samples = _in_steps(samples) or list(samples)
    slots, xlabel = _slots(samples)
    _phase_bands(ax, slots)

    def peak(key):  # each slot's largest value of key(sample)
        return [max(key(s) for s in rows) for _, _, _, rows in slots]

    alloc = peak(lambda s: max(s.get("phase_peak") or 0, s.get("allocated_cuda") or 0, s.get("phase_peak_cuda") or 0))
    reserved = peak(lambda s: s.get("reserved") or 0)
    top = max(alloc + reserved + [1])
    unit, size = byte_unit(top)
    x0 = [slots[0][0]] + [x1 for _, x1, _, _ in slots]  # the leading point: where the first slot starts
    in_what = "phase" if slots[0][2] is not None or len(slots) == 1 else "step"
    ax.step(x0, [alloc[0] / size] + [a / size for a in alloc], where="pre", color="#c44e52", lw=1.8,
            label=f"allocated (peak in {in_what})")
    if any(reserved):
        ax.step(x0, [reserved[0] / size] + [r / size for r in reserved], where="pre", color="#4c72b0", lw=1.2,
                label="reserved (CUDA cache)")
    _budget(ax, budget_bytes, top, size)
    drawn_budget = bool(budget_bytes) and budget_bytes <= 4 * top
    ax.set_ylim(0, 1.15 * max(top, budget_bytes if drawn_budget else 0) / size)
    ax.set_xlim(x0[0], x0[-1])
    integer_ticks(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or f"device memory by {in_what}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    rss = peak(lambda s: s.get("host_rss") or 0)
    if any(rss):
        hunit, hsize = byte_unit(max(rss))
        ax2 = ax.twinx()
        ax2.step(x0, [rss[0] / hsize] + [r / hsize for r in rss], where="pre", color="#8172b2", lw=1.6, label=HOST_RAM_NOTE)
        ax2.set_ylabel(f"host RAM, process RSS ({hunit})", color="#8172b2")
        ax2.set_ylim(0, 1.25 * max(rss) / hsize)  # headroom: the line is not clipped by the frame
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    _legend_outside(ax, handles, labels, x=1.16 if any(rss) else 1.01)


def category_peaks(samples: Sequence[dict]) -> tuple[list[tuple[float, float, str | None, list[dict]]], list[dict[str, int]]]:
    """The slots of :func:`_slots` and, for each, every category's peak within it in bytes: the tracker's
    ``category_peaks`` of each phase (its peak during the phase, replayed with final categories; ``other``
    included), the largest over the phases of a slot that holds several. Samples without them (an old
    timeline) fall back to the categories live at the phase's end."""
    rows = [s for s in _in_steps(samples) if s.get("category_peaks") or s.get("categories")]
    if not rows:
        raise ValueError("no per-category samples: track with categories=True (the default)")
    slots, _ = _slots(rows)
    peaks = [{c: max((s.get("category_peaks") or s["categories"]).get(c, 0) for s in group) for c in CATEGORIES}
             for _, _, _, group in slots]
    return slots, peaks


def draw_categories(ax, samples: Sequence[dict], budget_bytes: int | None = None, title: str = "") -> None:
    """Each category's peak within each phase (``other`` included), as the tracker measured it: one group
    of bars per phase, a bar per category (parameters level, activations peaking in forward and backward,
    gradients and temporaries in backward, optimizer state from the first step). A long run groups by
    step, or by several steps (:func:`_slots`). Peaks of different categories can fall at different
    moments of a phase, so the bars are side by side, not stacked."""
    slots, peaks = category_peaks(samples)
    top = max(max(p.values()) for p in peaks) or 1
    unit, size = byte_unit(top)
    n = len(CATEGORIES)
    for j, c in enumerate(CATEGORIES):
        ax.bar([x0 + (x1 - x0) * (0.1 + 0.8 * (j + 0.5) / n) for x0, x1, _, _ in slots],
               [p[c] / size for p in peaks], width=[(x1 - x0) * 0.8 / n for x0, x1, _, _ in slots],
               color=CATEGORY_COLORS[c], label=c, zorder=2)
    _budget(ax, budget_bytes, top, size)
    ax.set_ylim(0, 1.1 * top / size)
    ax.set_xlim(slots[0][0], slots[-1][1])
    centres = [(x0 + x1) / 2 for x0, x1, _, _ in slots]
    if slots[0][2] is not None:  # a slot per phase: name it, and the step under its first phase
        first = {}
        for i, (_, _, _, (s,)) in enumerate(slots):
            first.setdefault(s.get("step", 0), i)
        names = [ABBR.get(ph, ph) + (f"\nstep {s.get('step', 0)}" if first[s.get("step", 0)] == i else "")
                 for i, (_, _, ph, (s,)) in enumerate(slots)]
        ax.set_xticks(centres, names, fontsize=7)
        ax.set_xlabel("phase of each optimizer step")
    else:
        ax.set_xticks(centres, [f"{x0:g}" if x1 - x0 == 1 else f"{x0:g}–{x1 - 1:g}" for x0, x1, _, _ in slots],
                      fontsize=7)
        ax.set_xlabel("optimizer step" if slots[0][1] - slots[0][0] == 1 else "optimizer steps (grouped)")
    what = "phase" if slots[0][2] is not None else "step"
    ax.set_ylabel(f"peak within the {what} ({unit})")
    ax.set_title(title or f"each category's peak in each {what}", fontsize=9)
    _legend_outside(ax)


def plot_timeline(samples: Sequence[dict], budget_bytes: int | None = None, title: str = "", categories: bool = True):
    """A tracker's timeline (``tracker.timeline``, or the samples a live plot collected) as one figure:
    device memory by phase (:func:`draw_timeline`) and, when the samples carry categories, each
    category's peak in each phase beside it (:func:`draw_categories`). Returns the figure, for :func:`show`."""
    plt = _plt()
    two = categories and any(s.get("categories") for s in _in_steps(samples))
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(14 if two else 8, 3.6), squeeze=False)
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

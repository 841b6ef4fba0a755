"""Plots: a live memory plot redrawn in place while training (Colab, Jupyter, or headless to a PNG)
and static charts of a timeline and of plans side by side.

The live plot needs no widget manager: in a notebook it updates one display handle in place; without
IPython it only keeps the data and ``save()`` writes the PNG.

>>> lp = LivePlot(budget_bytes=2**30)
>>> lp.update({"t": 0.0, "step": 0, "phase": "forward", "allocated": 2**20, "phase_peak": 2**20,
...            "reserved": None, "host_rss": None})
>>> len(lp.samples)
1
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from .env import GiB, T4_USABLE_BYTES
from .memory import CATEGORIES

PHASE_COLORS = {"forward": "#cfe8ff", "backward": "#ffe0c2", "optimizer": "#d9f2d0", "eval": "#eeeeee"}
CATEGORY_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52", "other": "#8c8c8c"}


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


def draw_timeline(ax, samples: Sequence[dict], budget_bytes: int | None = T4_USABLE_BYTES, title: str = "") -> None:
    """Allocated (within-phase peak) and reserved device memory against the sample index, each phase
    shaded, the budget as a dashed line (named in the legend when it is far off scale); host RSS on
    a second axis. Units follow the data (MiB or GiB)."""
    xs = list(range(len(samples)))
    for i, s in enumerate(samples):
        color = PHASE_COLORS.get(s["phase"])
        if color:
            ax.axvspan(i - 1, i, color=color, lw=0)
    alloc = [max(s.get("phase_peak") or 0, s.get("allocated_cuda") or 0, s.get("phase_peak_cuda") or 0) for s in samples]
    reserved = [s.get("reserved") or 0 for s in samples]
    top = max(alloc + reserved + [1])
    unit, size = ("GiB", GiB) if top >= GiB / 2 else ("MiB", 2**20)
    ax.plot(xs, [a / size for a in alloc], color="#c44e52", lw=1.8, label="allocated (phase peak)")
    if any(reserved):
        ax.plot(xs, [r / size for r in reserved], color="#4c72b0", lw=1.2, label="reserved")
    if budget_bytes:
        if budget_bytes <= 4 * top:
            ax.axhline(budget_bytes / size, color="k", ls="--", lw=1, label=f"budget {budget_bytes / GiB:.1f} GiB")
        else:
            ax.plot([], [], color="k", ls="--", lw=1, label=f"budget {budget_bytes / GiB:.1f} GiB (off scale)")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sample (phase boundary)")
    ax.set_ylabel(f"device memory, {unit}")
    ax.set_title(title or "memory by phase (blue forward, orange backward, green optimizer)", fontsize=9)
    if any(s.get("host_rss") for s in samples):
        ax2 = ax.twinx()
        ax2.plot(xs, [(s.get("host_rss") or 0) / GiB for s in samples], color="#8172b2", lw=1, ls=":", label="host RSS")
        ax2.set_ylabel("host RSS, GiB", color="#8172b2")
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    else:
        ax.legend(loc="upper left", fontsize=7)


class LivePlot:
    """Memory plot redrawn in place during training; pass ``live_plot=LivePlot()`` to ``train``
    (or ``on_sample=lp.update`` to a tracker). ``save(path)`` writes a PNG (works headless).

    ``show_budget``: the T4's usable bytes by default, so the line shows what a T4 would allow.
    """

    def __init__(self, budget_bytes: int | None = T4_USABLE_BYTES, every_s: float = 0.5, title: str = "",
                 display: bool | None = None):
        self.budget_bytes = budget_bytes
        self.every_s = every_s
        self.title = title
        self.samples: list[dict] = []
        self._display = _in_notebook() if display is None else display
        self._handle = None
        self._last = 0.0

    def update(self, sample: dict) -> None:
        self.samples.append(sample)
        if self._display and time.perf_counter() - self._last >= self.every_s:
            self.redraw()

    def figure(self):
        plt = _plt()
        fig, ax = plt.subplots(figsize=(8, 3.2))
        draw_timeline(ax, self.samples, self.budget_bytes, self.title)
        fig.tight_layout()
        return fig

    def redraw(self) -> None:
        """Draw the current samples into the notebook's display handle (created on first call)."""
        self._last = time.perf_counter()
        if not self._display:
            return
        from IPython.display import display

        fig = self.figure()
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)
        _plt().close(fig)

    def close(self) -> None:
        """Final redraw with every sample."""
        self.redraw()

    def save(self, path: str) -> str:
        fig = self.figure()
        fig.savefig(path, dpi=110)
        _plt().close(fig)
        return path


def plot_breakdown(records: Sequence[dict[str, Any]], budget_bytes: int | None = None, predicted: dict[str, float] | None = None,
                   path: str | None = None, title: str = "measured memory by category"):
    """Stacked bars of each record's breakdown (each category's own peak) with its measured total
    peak as a marker, and an optional predicted total per plan (``{plan: bytes}``) as an ×."""
    plt = _plt()
    recs = [r for r in records if r.get("ok")]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(recs) + 2), 3.6))
    for i, r in enumerate(recs):
        bottom = 0.0
        for c in CATEGORIES:
            v = (r["breakdown"] or {}).get(c, 0) / GiB
            ax.bar(i, v, bottom=bottom, color=CATEGORY_COLORS[c], label=c if i == 0 else None)
            bottom += v
        ax.plot(i, r["peak_bytes"] / GiB, "k_", ms=28, mew=2, label="measured peak" if i == 0 else None)
        if predicted and r["plan"] in predicted:
            ax.plot(i, predicted[r["plan"]] / GiB, "x", color="k", ms=9, label="predicted" if i == 0 else None)
    if budget_bytes:
        ax.axhline(budget_bytes / GiB, color="k", ls="--", lw=1, label="budget")
    ax.set_xticks(range(len(recs)), [r["plan"] for r in recs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig

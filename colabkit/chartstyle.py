"""What every colabkit chart shares, live or static: byte units that scale with the data, the colours
of phases and categories, the budget line, whole-number ticks, and the matplotlib backend (Agg without a
notebook). :mod:`colabkit.liveplot` and :mod:`colabkit.plots` both draw with these.

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

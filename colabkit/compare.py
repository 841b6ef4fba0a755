"""Measure several plans on the same model and put them side by side, relative to the first.

>>> recs = compare("gpt-tiny", ["baseline"], batch=2, seq=16, steps=1)
>>> "baseline" in comparison_table(recs)
True
"""
from __future__ import annotations

from typing import Any, Sequence

from .memory import CATEGORIES, fmt_bytes
from .train import measure


def compare(model: Any, plans: Sequence[str], batch: int = 8, seq: int = 128, steps: int = 2,
            device: str | None = None, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """One :func:`colabkit.measure` record per plan, same model, data and seed."""
    return [measure(model, p, batch=batch, seq=seq, steps=steps, device=device, seed=seed, **kwargs) for p in plans]


def comparison_table(records: Sequence[dict[str, Any]]) -> str:
    """Peak, each category, step time and loss, with ratios to the first record."""
    base = records[0]
    head = f"{'plan':<30} {'peak':>10} {'x base':>7} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'step s':>7} {'loss':>7}"
    lines = [head]
    for r in records:
        if not r["ok"]:
            lines.append(f"{r['plan']:<30} refused/failed: {r['error']}")
            continue
        ratio = r["peak_bytes"] / base["peak_bytes"] if base.get("ok") else float("nan")
        cats = " ".join(f"{fmt_bytes(r['breakdown'][c]):>11}" for c in CATEGORIES)
        lines.append(f"{r['plan']:<30} {fmt_bytes(r['peak_bytes']):>10} {ratio:>7.2f} {cats} {r['step_time_s']:>7.3f} {r['loss']:>7.4f}")
    return "\n".join(lines)

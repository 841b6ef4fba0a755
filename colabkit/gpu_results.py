"""Figures measured on a lent GPU, shipped with colabkit so notebooks can show them beside their own.

``gpu_results.json`` (package data) is made by ``benchmarks/device_results.py`` from the committed
``benchmarks/results/cuda-<gpu>-t4emu-<date>.json``: per plan, the peak allocated, the estimate beside it and the
untracked step time, at one model and size (gpt2-124m, batch 8 x seq 512, on an H200 under T4 emulation, 2026-11-27).

>>> gpu_peak("baseline")[1], gpu_peak("no-such-plan")
(1.0, None)
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any


@functools.lru_cache(maxsize=1)
def gpu_results() -> dict[str, Any] | None:
    """The packaged summary, or None where colabkit was installed without it."""
    try:
        return json.loads(resources.files("colabkit").joinpath("gpu_results.json").read_text())
    except (FileNotFoundError, OSError, ValueError):
        return None


def gpu_peak(plan: str) -> tuple[int, float] | None:
    """(peak bytes, the peak ÷ that run's baseline peak) of ``plan`` as the GPU run measured it; None where it did
    not (a plan it refused, did not reach, or never had)."""
    r = gpu_results()
    if not r or plan not in r["plans"] or "baseline" not in r["plans"]:
        return None
    peak = r["plans"][plan]["peak_bytes"]
    return peak, round(peak / r["plans"]["baseline"]["peak_bytes"], 4)


def gpu_column_title() -> str | None:
    """The column's title: where, when and at what size, in a learner's words, e.g. 'measured on an NVIDIA H200
    capped to a T4's memory, 2026-11-27 (gpt2-124m, 8 × 512): peak (÷ its baseline)'."""
    r = gpu_results()
    if not r:
        return None
    capped = " capped to a T4's memory" if "T4" in r["label"] else ""
    return (f"measured on an {r['gpu']}{capped}, {r['date']} ({r['model']}, {r['batch']} × {r['seq']}): "
            "peak (÷ its baseline)")

"""Calibration on the user's own GPU: measure what the estimate can only assume, store it as a device
profile that later estimates on that machine use, and say how far off the estimate was.

:func:`calibrate` (``python -m colabkit calibrate``) needs a CUDA GPU. It measures

- the CUDA context: device memory in use minus what PyTorch's allocator reserved, after three real steps
  (so the kernels a training step loads are in it);
- the allocator's slack: ``max_memory_reserved`` over ``max_memory_allocated`` of each step;
- three small real training steps (``measure``), compared with :func:`~colabkit.estimate.estimate`.

:func:`fit` turns such a measurement into a profile (pure arithmetic, tested on the CPU from
``tests/data/``); :func:`~colabkit.estimate.overheads.save_profile` stores it under
``$COLABKIT_PROFILE_DIR`` or ``~/.cache/colabkit/profiles/<gpu>.json``.

>>> m = {"gpu": "Tesla T4", "capacity_bytes": 15827000000, "context_bytes": 300 * 2**20, "libraries": ["torch", "cublas"],
...      "steps": [{"allocated_peak": 100 * 2**20, "reserved_peak": 104 * 2**20}], "date": "2026-11-22"}
>>> fit(m)["fragmentation"]
0.04
"""
from __future__ import annotations

import datetime
import statistics
from typing import Any

import torch

from ..env import GPU_PROFILES, profile_for
from ..memory import fmt_bytes
from ..train import measure
from . import overheads as _overheads
from .predict import estimate
from .speed import fit_host, measure_host, measure_host_update

# Three small real steps: the baseline, a half-precision plan with recomputation, a larger batch.
CASES = [("gpt2-124m", "baseline", 1, 256), ("gpt2-124m", "fp16+checkpoint", 2, 256), ("gpt-small", "baseline", 4, 256)]


def allocator_peak(prof) -> int:
    """torch's own accounting of a run's peak: the running sum of the allocator's ``[memory]`` events
    (+alloc, -free) recorded by ``torch.profiler.profile(profile_memory=True)``; on the CPU the reference
    the tracker is checked against (on a GPU, ``torch.cuda.max_memory_allocated``).

    >>> from torch.profiler import profile
    >>> with profile(profile_memory=True) as prof:
    ...     a = torch.ones(1000); b = torch.ones(1000); del a, b
    >>> allocator_peak(prof)
    8000
    """
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


class NoGPUError(ValueError):
    """Calibration measures a GPU; there is none here."""


def _read_device() -> dict[str, int]:
    """The CUDA figures calibration needs, in bytes (the only CUDA-only code here)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"total": total, "free": free, "reserved": torch.cuda.memory_reserved(),
            "allocated": torch.cuda.memory_allocated()}


def measure_device(cases=CASES) -> dict[str, Any]:
    """Run the calibration measurements on this machine's GPU; the raw measurement (a dict like
    ``tests/data/calibration_t4_constructed.json``)."""
    if not torch.cuda.is_available():
        raise NoGPUError("calibrate needs a CUDA GPU (none is attached). In Colab: Runtime -> Change runtime type "
                         "-> T4 GPU; then run `python -m colabkit calibrate` again.")
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()  # the context with cuBLAS loaded
    first = _read_device()
    steps = []
    for model, plan, batch, seq in cases:
        torch.cuda.empty_cache()
        r = measure(model, plan, batch=batch, seq=seq, steps=2, device="cuda")
        if not r["ok"]:
            raise RuntimeError(f"calibration step {model} {plan} failed: {r['error']}")
        # the tracker resets CUDA's peak counters at each phase: its report folds them over the steps
        steps.append({"model": model, "plan": plan, "batch": batch, "seq": seq,
                      "allocated_peak": int(r["peak_bytes"]), "reserved_peak": int(r["peak_reserved_bytes"])})
    last = _read_device()
    host = measure_host("cuda")  # after the memory figures: its tiny models add nothing to them
    host_update = measure_host_update(device="cuda")  # offload:optimizer's step, on this host's CPU (wall time)
    name = torch.cuda.get_device_name()
    return {"gpu": name, "capability": list(torch.cuda.get_device_capability()),
            "capacity_bytes": int(torch.cuda.get_device_properties(0).total_memory),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(),
            "context_bare_bytes": first["total"] - first["free"] - first["reserved"],
            "context_bytes": last["total"] - last["free"] - last["reserved"],
            "libraries": ["torch", "cublas"], "steps": steps, "host": host, "host_update_bytes_per_s": host_update,
            "note": "measured by colabkit calibrate; context = mem_get_info's used minus memory_reserved "
                    "(other processes on the GPU would count too)"}


def fit(m: dict[str, Any]) -> dict[str, Any]:
    """The device profile a measurement gives: the context after the steps (uncertainty: 10%, at least
    16 MiB: later runs may load other kernels), the fragmentation as the mean of
    reserved/allocated - 1 over the steps (uncertainty: their spread, at least 1%), the capacity CUDA reports.
    """
    ratios = [s["reserved_peak"] / s["allocated_peak"] - 1 for s in m["steps"]]
    frag = round(statistics.mean(ratios), 4)
    spread = (max(ratios) - min(ratios)) if len(ratios) > 1 else frag / 2
    ctx = int(m["context_bytes"])
    ctx_u = max(16 * 2**20, ctx // 10)
    prof = {"gpu": m["gpu"], "date": m["date"], "torch": m.get("torch"), "capacity_bytes": int(m["capacity_bytes"]),
            "context_bytes": ctx, "context_uncertainty": int(ctx_u), "libraries": list(m["libraries"]),
            "fragmentation": frag, "fragmentation_uncertainty": round(max(0.01, spread), 4),
            "source": m.get("note", "")}
    if m.get("host"):  # the step time's host terms (speed.fit_host), which the datasheet cannot give
        prof["speed"] = fit_host(m["host"])
    if m.get("host_update_bytes_per_s"):
        prof.setdefault("speed", {})["host_bytes_per_s"] = float(m["host_update_bytes_per_s"])
    return prof


def compare(m: dict[str, Any], key: str, calibration: dict | bool) -> list[dict[str, Any]]:
    """Estimate each measured step on profile ``key`` (with ``calibration``: a fitted profile, or False
    for the uncalibrated terms) next to the measurement: allocated peak (the tensors' peak plus the cuBLAS
    workspaces, which the caching allocator holds), and device in use (context + reserved) against the need."""
    rows = []
    for s in m["steps"]:
        e = estimate(s["model"], s["plan"], batch=s["batch"], seq=s["seq"], gpu=key, calibration=calibration)
        used = int(m["context_bytes"]) + s["reserved_peak"]
        need = e["resources"]["device"]["need"]
        alloc = e["peak_bytes"] + e["overheads"]["cublas_workspace"]  # the workspaces come from the caching allocator
        rows.append({"model": s["model"], "plan": s["plan"], "batch": s["batch"], "seq": s["seq"],
                     "estimate_allocated": alloc, "measured_allocated": s["allocated_peak"],
                     "allocated_error": (alloc - s["allocated_peak"]) / s["allocated_peak"],
                     "estimate_need": need, "measured_used": used, "need_error": (need - used) / used,
                     "uncertainty": e["resources"]["device"]["uncertainty"]})
    return rows


def calibrate(measurement: dict[str, Any] | None = None, key: str | None = None, store: bool = True) -> dict[str, Any]:
    """Measure this GPU (or take a recorded ``measurement``), fit and store its device profile, and
    report the estimate's error before and after calibration.

    On a machine without a GPU and no ``measurement`` it raises :class:`NoGPUError` (the CLI exits 2).
    """
    m = measurement if measurement is not None else measure_device()
    key = key or profile_for(m["gpu"])
    if key is None:
        raise ValueError(f"no GPU profile matches {m['gpu']!r}: known {', '.join(GPU_PROFILES)}; pass key=")
    prof = fit(m)
    before = compare(m, key, False)
    after = compare(m, key, prof)
    path = _overheads.save_profile(key, prof) if store else None
    return {"gpu": m["gpu"], "profile": key, "stored": str(path) if path else None, "fitted": prof,
            "capacity_vs_profile": m["capacity_bytes"] - GPU_PROFILES[key]["capacity_bytes"],
            "before": before, "after": after}


def calibration_table(r: dict[str, Any]) -> str:
    """The readable report of :func:`calibrate`."""
    f = r["fitted"]
    lines = [f"{r['gpu']} -> profile {r['profile']}" + (f", stored in {r['stored']}" if r["stored"] else ""),
             f"capacity {fmt_bytes(f['capacity_bytes'])} ({r['capacity_vs_profile'] / 2**20:+.0f} MiB vs the profile); "
             f"CUDA context {fmt_bytes(f['context_bytes'])}; reserved beyond allocated {f['fragmentation']:.1%}",
             f"{'model':<10} {'plan':<16} {'b':>2} {'alloc est':>10} {'measured':>10} {'err':>6}   "
             f"{'need before':>11} {'after':>10} {'in use':>10} {'err before':>10} {'after':>6}"]
    for b, a in zip(r["before"], r["after"]):
        lines.append(f"{b['model']:<10} {b['plan']:<16} {b['batch']:>2} {fmt_bytes(b['estimate_allocated']):>10} "
                     f"{fmt_bytes(b['measured_allocated']):>10} {b['allocated_error']:>+6.1%}   "
                     f"{fmt_bytes(b['estimate_need']):>11} {fmt_bytes(a['estimate_need']):>10} "
                     f"{fmt_bytes(b['measured_used']):>10} {b['need_error']:>+10.1%} {a['need_error']:>+6.1%}")
    return "\n".join(lines)

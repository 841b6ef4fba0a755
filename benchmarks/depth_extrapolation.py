"""Depth extrapolation against full traces, over a matrix of GPT shapes x plans x batch shapes.

A GPT deeper than 3 layers is estimated from traces at 2 and 3 layers (colabkit.estimate.trace._affine):
each segment's peak (embedding, first block, last block, head; in forward and in backward) is affine in
depth, and a phase's peak is the largest segment's at the asked depth. The reference is the full trace of
the whole model (``full_trace()``: every step op by op, nothing extrapolated or cached). The same matrix is
run a second time with segment labels off (each phase's peak the line through its peaks at 2 and 3 layers,
the method before 2026-11-27) to show what the segments change.

    python benchmarks/depth_extrapolation.py [--out benchmarks/results/depth-extrapolation-cpu]

Writes ``<out>.md`` and ``<out>.json``; about 4 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys

os.environ.setdefault("COLABKIT_TRACE_CACHE", "off")  # every answer traced here, none read from disk
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import colabkit  # noqa: E402
from colabkit.estimate.trace import full_trace  # noqa: E402
from colabkit.memory import CATEGORIES  # noqa: E402

trace_mod = importlib.import_module("colabkit.estimate.trace")  # the package exports a function named trace

MODELS = ["gpt:5x128", "gpt:6x64:v2048", "gpt:4x256"]
PLANS = ["baseline", "fused-step", "checkpoint", "fp16", "fp16+checkpoint", "adamw4bit+fused-step",
         "checkpoint+adamw8bit+fused-step", "lora:8", "qlora:4", "adafactor", "sgd", "lion", "offload:optimizer",
         "compress:int8", "chunked-ce", "accum:2", "adam-mini", "galore:8", "attention:math"]
SIZES = [(2, 32), (1, 128), (8, 64)]


def errors(fast: dict, ref: dict) -> dict[str, float]:
    """The peak's relative error, the largest of each category's own peak, and the largest change of a
    category at the peak as a fraction of the peak."""
    peak = ref["peak_bytes"]
    return {"peak": abs(fast["peak_bytes"] - peak) / peak,
            "own": max(abs(fast["breakdown"][c] - ref["breakdown"][c]) / ref["breakdown"][c]
                       for c in CATEGORIES if ref["breakdown"][c]),
            "at_peak": max(abs(fast["at_peak"][c] - ref["at_peak"][c]) for c in CATEGORIES) / peak,
            "phase": fast["peak_phase"] != ref["peak_phase"]}


def run(segments: bool, refs: dict) -> list[dict]:
    real = trace_mod._label_segments
    if not segments:
        trace_mod._label_segments = lambda model, tracker: None
    rows = []
    try:
        for m in MODELS:
            for p in PLANS:
                for b, s in SIZES:
                    trace_mod._CACHE.clear()
                    key = (m, p, b, s)
                    if key not in refs:
                        try:
                            with full_trace():
                                refs[key] = colabkit.estimate(m, p, batch=b, seq=s, gpu="t4")
                        except colabkit.PlanError:  # refused for this batch (accum:2 at batch 1): not a case
                            refs[key] = None
                    if refs[key] is None:
                        continue
                    fast = colabkit.estimate(m, p, batch=b, seq=s, gpu="t4")
                    rows.append({"model": m, "plan": p, "batch": b, "seq": s, **errors(fast, refs[key])})
    finally:
        trace_mod._label_segments = real
    return rows


def summary(rows: list[dict]) -> dict:
    worst = max(rows, key=lambda r: r["peak"])
    return {"cases": len(rows), "peak_over_0.5%": sum(r["peak"] > 0.005 for r in rows),
            "at_peak_over_0.5%": sum(r["at_peak"] > 0.005 for r in rows),
            "own_over_0.5%": sum(r["own"] > 0.005 for r in rows), "phase_differs": sum(r["phase"] for r in rows),
            "worst": worst}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "depth-extrapolation-cpu"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    refs: dict = {}
    results = {"segments": run(True, refs), "phase lines": run(False, refs)}
    date = datetime.date.today().isoformat()
    head = (f"Depth extrapolation against full traces — {platform.processor() or platform.machine()}, {date}; "
            f"torch {torch.__version__}; T4 profile; {len(MODELS)} GPT shapes × {len(PLANS)} plans × "
            f"{len(SIZES)} batch shapes (batch × seq {', '.join(f'{b}×{s}' for b, s in SIZES)})")
    lines = [head, "", "| method | cases | peak off > 0.5% | categories at the peak moved > 0.5% of it | "
             "a category's own peak off > 0.5% | peak phase differs | worst peak error |", "|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        s = summary(rows)
        w = s["worst"]
        lines.append(f"| {name} | {s['cases']} | {s['peak_over_0.5%']} | {s['at_peak_over_0.5%']} | {s['own_over_0.5%']} | "
                     f"{s['phase_differs']} | {100 * w['peak']:.2f}% ({w['model']}, {w['plan']}, {w['batch']}×{w['seq']}) |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"date": date, "torch": torch.__version__, "results": results}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

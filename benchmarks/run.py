"""Measure every plan token (alone and in the usual combinations) on one model, with the
estimator's prediction next to each measurement; write JSON and a markdown table.

On a GPU pass ``--t4`` to cap the process to a T4's usable memory and refuse bf16/flash, so the
figures approximate a free Colab T4. On a CPU the offload tokens are refused (nothing to offload
to) and show as such.

    python benchmarks/run.py --device cpu --model gpt:8x256 --batch 8 --seq 128 --steps 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import colabkit
from colabkit.memory import CATEGORIES, fmt_bytes

PLANS = [
    "baseline", "fp16", "checkpoint", "accum:4", "compress:int8", "attention:math", "attention:efficient",
    "adamw8bit", "paged-adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "adam-mini", "galore:32", "sgd",
    "fused-step", "offload:disk",
    "offload:optimizer", "offload:activations", "offload:params", "lora:8", "qlora:8",
    "fp16+checkpoint", "checkpoint+adamw8bit", "fp16+checkpoint+adamw8bit",
    "checkpoint+adamw4bit+fused-step", "qlora:8+checkpoint",
]


def run(model: str, plans: list[str], batch: int, seq: int, steps: int, device: str | None) -> dict:
    results = []
    for plan in plans:
        rec = colabkit.measure(model, plan, batch=batch, seq=seq, steps=steps, device=device)
        if rec["ok"]:
            gpu = "t4" if colabkit.env()["emulating_t4"] else None
            est = colabkit.estimate(model, plan, batch=batch, seq=seq, gpu=gpu, device=None if gpu else rec["device"])
            rec["estimate_peak_bytes"] = est["peak_bytes"]
            rec["estimate_error"] = (est["peak_bytes"] - rec["peak_bytes"]) / rec["peak_bytes"]
        results.append(rec)
        print(f"{plan:<40} {'ok' if rec['ok'] else rec['error'][:80]}", file=sys.stderr)
    info = colabkit.env()
    info["date"] = datetime.date.today().isoformat()
    return {"env": info, "model": model, "batch": batch, "seq": seq, "steps": steps, "results": results}


def markdown(data: dict) -> str:
    env = data["env"]
    dev = env["gpu"] or f"CPU ({os.cpu_count()} cores)"
    emu = " with T4 emulation" if env.get("emulating_t4") else ""
    lines = [f"`{data['model']}`, batch {data['batch']} × seq {data['seq']}, {data['steps']} steps — measured on "
             f"{dev}{emu}, torch {env['torch']}, {env['date']}", "",
             "| plan | peak | × baseline | " + " | ".join(CATEGORIES) + " | loss | estimate error |",
             "|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|"]
    base = next((r for r in data["results"] if r["plan"] == "baseline" and r["ok"]), None)
    for r in data["results"]:
        if not r["ok"]:
            lines.append(f"| `{r['plan']}` | refused: {r['error'].split(': ', 1)[-1][:90]} |" + " |" * (3 + len(CATEGORIES)))
            continue
        ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "-"
        cats = " | ".join(fmt_bytes(r["breakdown"][c]) for c in CATEGORIES)
        err = f"{r['estimate_error']:+.1%}" if "estimate_error" in r else "-"
        lines.append(f"| `{r['plan']}` | {fmt_bytes(r['peak_bytes'])} | {ratio} | {cats} | {r['loss']:.4f} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt:8x256")
    p.add_argument("--plan", action="append", help="plans to run (default: every token and the usual combinations)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--t4", action="store_true", help="emulate a T4 on a bigger GPU")
    p.add_argument("--out", default=None, help="JSON path (the markdown table goes next to it as .md)")
    args = p.parse_args(argv)
    if args.t4:
        colabkit.emulate_t4()
    data = run(args.model, args.plan or PLANS, args.batch, args.seq, args.steps, args.device)
    table = markdown(data)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

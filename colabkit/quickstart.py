"""The quickstart as a function and a headless job: environment, memory anatomy of a model (the
bytes-per-parameter formula next to the measured breakdown), a short training with the live plot.

``python -m colabkit.quickstart --out report`` writes report/report.md, report.json and
live_plot.png on whatever device is here (tiny sizes in smoke mode).

>>> rows = anatomy_table(measure("gpt-tiny", batch=2, seq=16, steps=1))
>>> [r[0] for r in rows][:3]
['params', 'grads', 'optimizer']
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .env import default_device, env, format_env, smoke_mode
from .memory import CATEGORIES, fmt_bytes
from .plots import LivePlot
from .train import measure, train

# Bytes per parameter that fp32 AdamW training keeps: weights, gradients, two moments.
FP32_ADAMW_BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}


def anatomy_table(record: dict[str, Any]) -> list[tuple[str, int, int | None, str]]:
    """Rows (category, measured bytes, predicted bytes or None, formula) for a baseline record."""
    p = record["params"]
    rows = []
    for c in CATEGORIES:
        per = FP32_ADAMW_BYTES_PER_PARAM.get(c)
        formula = f"{per} B x {p:,} params" if per else ("forward-pass peak (measured)" if c == "activations" else "temporaries")
        rows.append((c, record["breakdown"][c], per * p if per else None, formula))
    return rows


def format_anatomy(record: dict[str, Any]) -> str:
    lines = [f"{'category':<12} {'measured':>11} {'formula':>11}  how", "-" * 60]
    for c, measured, predicted, formula in anatomy_table(record):
        lines.append(f"{c:<12} {fmt_bytes(measured):>11} {fmt_bytes(predicted):>11}  {formula}")
    lines.append(f"{'peak':<12} {fmt_bytes(record['peak_bytes']):>11}")
    return "\n".join(lines)


def sizes(smoke: bool | None = None) -> dict[str, Any]:
    """Model and run sizes for this device: tiny in smoke mode, GPT-2 small on a GPU."""
    smoke = smoke_mode() if smoke is None else smoke
    if smoke:
        return {"model": "gpt-tiny", "batch": 8, "seq": 64, "steps": 30, "lr": 3e-3}
    return {"model": "gpt2-124m", "batch": 8, "seq": 512, "steps": 100, "lr": 6e-4}


def run(out_dir: str = "report", smoke: bool | None = None) -> dict[str, Any]:
    """The quickstart, headless: returns the results and writes them into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    s = sizes(smoke)
    device = default_device()
    info = env()
    record = measure(s["model"], "baseline", batch=s["batch"], seq=s["seq"], steps=2, device=device)
    if not record["ok"]:
        raise RuntimeError(record["error"])
    plot = LivePlot(display=False, title=f"{s['model']} baseline, batch {s['batch']} x seq {s['seq']} on {device}")
    run_ = train(s["model"], steps=s["steps"], batch=s["batch"], seq=s["seq"], lr=s["lr"], device=device,
                 live_plot=plot, progress=False)
    png = plot.save(os.path.join(out_dir, "live_plot.png"))
    result = {"env": info, "sizes": s, "anatomy": record,
              "training": {"losses": run_["losses"], "step_times": run_["step_times"], "report": run_["report"]}}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    md = [
        "# colabkit quickstart report", "", "## Environment", "```", format_env(info), "```", "",
        f"## Memory anatomy: {s['model']}, batch {s['batch']}, seq {s['seq']}, fp32 AdamW", "```",
        format_anatomy(record), "```", "",
        f"## Training: {s['steps']} steps", "",
        f"loss {run_['losses'][0]:.3f} -> {run_['losses'][-1]:.3f}; "
        f"mean step {sum(run_['step_times']) / len(run_['step_times']):.3f} s; "
        f"peak {fmt_bytes(run_['report']['peak_bytes'])}", "", f"![live plot]({os.path.basename(png)})", "",
    ]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(md))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colabkit.quickstart", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="report")
    args = p.parse_args(argv)
    result = run(args.out)
    print(format_env(result["env"]))
    print()
    print(format_anatomy(result["anatomy"]))
    print(f"\nwrote {args.out}/report.md, report.json, live_plot.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

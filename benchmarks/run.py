"""Measure every plan token (alone and in the usual combinations) on one model, with the
estimator's prediction next to each measurement; write JSON and a markdown table.

On a GPU pass ``--t4`` to cap the process to a T4's usable memory and refuse bf16/flash, so the
figures approximate a free Colab T4 (memory transfers to a T4, time does not). On a CPU the offload
tokens are refused (nothing to offload to) and show as such. Each record carries the measured peak
(allocated; on CUDA also reserved), the step time (untracked on CUDA), the loss after ``--steps`` steps
and its difference from the baseline's, the estimator's peak prediction (a T4's under ``--t4``) and its
step-time prediction with the profile of the device present (``step_profile``), each with its error.
``--budget-s`` stops starting plans once that many seconds are spent: the rest show as not run.

    python benchmarks/run.py --device cpu --model gpt:8x256 --batch 8 --seq 128 --steps 2
    python benchmarks/run.py --device cuda --t4 --model gpt2-124m --batch 8 --seq 512 --steps 3 --out r.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

import colabkit
from colabkit.env import profile_for
from colabkit.memory import CATEGORIES, fmt_bytes

PLANS = [
    "baseline", "fp16", "checkpoint", "accum:4", "compress:int8", "attention:math", "attention:efficient",
    "adamw8bit", "paged-adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "adam-mini", "galore:32", "sgd",
    "fused-step", "offload:disk", "chunked-ce",
    "offload:optimizer", "offload:activations", "offload:params", "lora:8", "qlora:8",
    "bf16", "fp16+attention:flash",  # refused where the GPU has neither (a T4, or T4 emulation): shown as refusals
    # (flash has fp16/bf16 kernels only: alone, in fp32, it is refused on any GPU)
    "fp16+checkpoint", "checkpoint+adamw8bit", "fp16+checkpoint+adamw8bit",
    "checkpoint+adamw4bit+fused-step", "qlora:8+checkpoint", "fp16+checkpoint+chunked-ce",
]
NEAREST_PROFILE = "h100"  # step-time profile for a GPU colabkit has none of (e.g. a B200: said so in the record)


def step_profile(device: str) -> tuple[str | None, str]:
    """The speed profile to predict ``device``'s step time with, and where it came from: the GPU present's
    (``env.profile_for``), the nearest (:data:`NEAREST_PROFILE`) for a GPU without one, None for the CPU."""
    if device != "cuda":
        return None, "this CPU (measured throughput)"
    name = torch.cuda.get_device_name(0)
    key = profile_for(name)
    return (key, f"{key} profile ({name})") if key else (NEAREST_PROFILE, f"no profile for {name}: {NEAREST_PROFILE}'s used")


def _predictions(rec: dict, model: str, plan: str, batch: int, seq: int, emulating: bool) -> dict:
    """The estimator's figures next to a measured record: peak and device need (a T4's when emulating one,
    else the device's own), their errors, and the step time on the device present's profile."""
    cuda = rec["device"].startswith("cuda")
    gpu = "t4" if emulating else None
    est = colabkit.estimate(model, plan, batch=batch, seq=seq, gpu=gpu, device=None if gpu else rec["device"].split()[0])
    out = {"estimate_peak_bytes": est["peak_bytes"],
           "estimate_error": (est["peak_bytes"] - rec["peak_bytes"]) / rec["peak_bytes"]}
    if cuda and gpu:  # max_memory_allocated counts cuBLAS' workspaces (the caching allocator holds them)
        ov = est.get("overheads", {})
        pred = est["peak_bytes"] + ov.get("cublas_workspace", 0)
        out.update(estimate_allocated_bytes=pred, estimate_error=(pred - rec["peak_bytes"]) / rec["peak_bytes"],
                   estimate_uncertainty_bytes=est["resources"]["device"]["uncertainty"], verdict_t4=est["verdict"])
        if rec.get("peak_reserved_bytes"):  # the device need less the CUDA context: what the allocator reserves
            need = est["resources"]["device"]["need"] - ov.get("cuda_context", 0)
            out.update(estimate_reserved_bytes=need,
                       estimate_reserved_error=(need - rec["peak_reserved_bytes"]) / rec["peak_reserved_bytes"])
    if gpu:
        out["estimate_step_time_t4_s"] = est["step_time_s"]  # a prediction only: a T4's time is not measured here
    key, source = step_profile("cuda" if cuda else "cpu")
    st = colabkit.predict_step_time(model, plan, batch, seq, gpu=key)  # key None: this CPU
    out.update(estimate_step_time_s=st["step_time_s"], estimate_step_time_uncertainty=st.get("uncertainty"),
               step_profile=source, step_time_error=(st["step_time_s"] - rec["step_time_s"]) / rec["step_time_s"])
    return out


def run(model: str, plans: list[str], batch: int, seq: int, steps: int, device: str | None,
        budget_s: float | None = None, on_record=None) -> dict:
    """Measure each plan (see the module docstring); ``on_record(results so far)`` after each one."""
    results, t0 = [], time.perf_counter()
    emulating = colabkit.env()["emulating_t4"]
    for plan in plans:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            results.append({"plan": plan, "ok": False, "not_run": True,
                            "error": f"not run: the time budget of {budget_s:g} s was spent"})
            continue
        t1 = time.perf_counter()
        # steps timed untracked on every device (on a CPU measure times none by default): the step-time table
        on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
        rec = colabkit.measure(model, plan, batch=batch, seq=seq, steps=steps, device=device, timing_steps=1 if on_cpu else None)
        if rec["ok"]:
            try:
                rec.update(_predictions(rec, model, plan, batch, seq, emulating))
            except Exception as e:  # noqa: BLE001  (an estimator crash is a finding: recorded, the sweep goes on)
                rec["estimate_failed"] = f"{type(e).__name__}: {e}"
        rec["wall_s"] = round(time.perf_counter() - t1, 2)
        results.append(rec)
        if on_record:
            on_record(results)
        print(f"{plan:<40} {'ok' if rec['ok'] else rec['error'][:80]} ({rec['wall_s']} s)", file=sys.stderr)
    base = next((r for r in results if r["plan"] == "baseline" and r["ok"]), None)
    for r in results:
        if base and r["ok"]:
            r["loss_vs_baseline"] = r["loss"] - base["loss"]
    info = colabkit.env()
    info["date"] = datetime.date.today().isoformat()
    return {"env": info, "model": model, "batch": batch, "seq": seq, "steps": steps, "results": results,
            "wall_s": round(time.perf_counter() - t0, 1)}


def _pct(r: dict, key: str) -> str:
    return f"{r[key]:+.1%}" if r.get(key) is not None else "-"


def markdown(data: dict) -> str:
    env = data["env"]
    dev = env["gpu"] or f"CPU ({os.cpu_count()} cores)"
    emu = " with T4 emulation" if env.get("emulating_t4") else ""
    cuda = any(r.get("peak_reserved_bytes") for r in data["results"])
    lines = [f"`{data['model']}`, batch {data['batch']} × seq {data['seq']}, {data['steps']} steps — measured on "
             f"{dev}{emu}, torch {env['torch']}, {env['date']}", "",
             "| plan | peak | × baseline | " + " | ".join(CATEGORIES) + " | loss | estimate error |"
             + (" reserved | reserved error |" if cuda else ""),
             "|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|" + ("---|---|" if cuda else "")]
    base = next((r for r in data["results"] if r["plan"] == "baseline" and r["ok"]), None)
    for r in data["results"]:
        if not r["ok"]:
            what = "not run" if r.get("not_run") else "refused"
            lines.append(f"| `{r['plan']}` | {what}: {r['error'].split(': ', 1)[-1][:90]} |"
                         + " |" * (3 + len(CATEGORIES) + 2 * cuda))
            continue
        ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "-"
        cats = " | ".join(fmt_bytes(r["breakdown"][c]) for c in CATEGORIES)
        res = (f" {fmt_bytes(r['peak_reserved_bytes']) if r.get('peak_reserved_bytes') else '-'} | "
               f"{_pct(r, 'estimate_reserved_error')} |") if cuda else ""
        lines.append(f"| `{r['plan']}` | {fmt_bytes(r['peak_bytes'])} | {ratio} | {cats} | {r['loss']:.4f} | "
                     f"{_pct(r, 'estimate_error')} |{res}")
    timed = [r for r in data["results"] if r["ok"] and r.get("estimate_step_time_s")]
    if timed:
        t4 = any("estimate_step_time_t4_s" in r for r in timed)
        lines += ["", f"Step time (steps run untracked after the measured ones), predicted with {timed[0]['step_profile']}; loss after "
                  f"{data['steps']} steps against the baseline's"
                  + ("; a T4's step time is predicted only (T4 emulation caps memory, not speed)" if t4 else ""), "",
                  "| plan | measured step | predicted step | error | loss − baseline |" + (" predicted on a T4 |" if t4 else ""),
                  "|---|---|---|---|---|" + ("---|" if t4 else "")]
        for r in timed:
            lines.append(f"| `{r['plan']}` | {r['step_time_s'] * 1e3:.1f} ms | {r['estimate_step_time_s'] * 1e3:.1f} ms | "
                         f"{_pct(r, 'step_time_error')} | {r.get('loss_vs_baseline', 0):+.4f} |"
                         + (f" {r['estimate_step_time_t4_s'] * 1e3:.0f} ms |" if t4 else ""))
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
    p.add_argument("--budget-s", type=float, default=None, help="start no plan after this many seconds")
    args = p.parse_args(argv)
    if args.t4:
        colabkit.emulate_t4()

    def save(data: dict) -> None:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)

    def partial(results: list[dict]) -> None:  # a crash or a kill later still leaves the plans measured so far
        info = colabkit.env()
        info["date"] = datetime.date.today().isoformat()
        save({"env": info, "model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps,
              "results": results, "partial": True})

    data = run(args.model, args.plan or PLANS, args.batch, args.seq, args.steps, args.device, args.budget_s,
               on_record=partial if args.out else None)
    table = markdown(data)
    print(table)
    if args.out:
        save(data)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

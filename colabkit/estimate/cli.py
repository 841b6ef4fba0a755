"""The ``estimate``, ``plan`` and ``largest`` subcommands (registered by ``colabkit.__main__``)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..memory import CATEGORIES, fmt_bytes
from .auto import choose
from .calibrate import calibrate, calibration_table
from .planner import largest, pareto, plans
from .predict import estimate


def _sizes(r: dict) -> str:
    """The header's batch: a sharded run's is per rank (``estimate`` returns the rank's micro-batch) and global.

    >>> _sizes({"batch": 1, "seq": 128, "plan": "zero:3", "world_size": 2, "device": "t4x2"})
    'batch 2 (1 per rank)  seq 128  on t4x2, each of 2 ranks'
    >>> _sizes({"batch": 4, "seq": 64, "plan": "checkpoint", "world_size": 1, "device": "t4"})
    'batch 4  seq 64  on t4'
    """
    ws = r.get("world_size", 1)
    if ws > 1 and "zero:" in r["plan"]:
        return f"batch {r['batch'] * ws} ({r['batch']} per rank)  seq {r['seq']}  on {r['device']}, each of {ws} ranks"
    return f"batch {r['batch']}  seq {r['seq']}  on {r['device']}" + (f", each of {ws} processes" if ws > 1 else "")


def _table(r: dict) -> str:
    per = " per rank" if r.get("world_size", 1) > 1 else ""
    lines = [f"{r['model']}  plan {r['plan']}  {_sizes(r)}",
             f"predicted peak{per} {fmt_bytes(r['peak_bytes'])} of {fmt_bytes(r['budget_bytes'])}   "
             f"host RAM {fmt_bytes(r['host_bytes'])}",
             f"verdict: {r['verdict'].upper()} (decided by {r['decided_by']}, margin {fmt_bytes(r['margin_bytes'])})",
             *(f"  {n:<8} need {fmt_bytes(v['need']):>10} of {fmt_bytes(v['budget']):>10}: {v['verdict']}"
               for n, v in r["resources"].items()),
             f"{'category':<12} {'own peak':>10} {'at peak':>10}"]
    lines += [f"{c:<12} {fmt_bytes(r['breakdown'][c]):>10} {fmt_bytes(r['at_peak'][c]):>10}" for c in CATEGORIES]
    if "overhead_terms" in r:  # GPU profile: what the GPU adds to the tensors' peak
        lines.append(f"{'overhead':<20} {'bytes':>10} {'+-':>9}  grows with model")
        lines += [f"{n:<20} {fmt_bytes(t['nbytes']):>10} {fmt_bytes(t['uncertainty']):>9}  {'yes' if t['scales'] else 'no'}"
                  for n, t in r["overhead_terms"].items()]
        if r.get("collective_slack_bytes"):  # zero:2/3: buffers the communication thread may free late
            lines.append(f"{'late collectives':<20} {fmt_bytes(0):>10} {fmt_bytes(r['collective_slack_bytes']):>9}  yes")
        d = r["resources"]["device"]
        lines.append(f"{'device need':<20} {fmt_bytes(d['need']):>10} {fmt_bytes(d['uncertainty']):>9}  "
                     "(tensors' peak + overheads; sources: --json overhead_terms)")
    if "step_time" in r:  # colabkit.estimate.speed
        s = r["step_time"]
        lines.append(f"predicted step {r['step_time_s']:.3g} s +-{s['uncertainty']:.0%}, {r['tokens_per_s']:,.0f} tokens/s ("
                     + ", ".join(f"{k} {v:.2g} s" for k, v in s["terms"].items()) + f"); {s['source']}")
    if "analytic" in r:
        a = r["analytic"]
        lines.append(f"formula: {a['bytes_per_param']:.1f} B/param + activations {a['activation_formula']} "
                     f"= {fmt_bytes(a['total'])} ({a['error_vs_trace']:+.0%} vs the trace)")
    return "\n".join(lines + r["notes"])


def _need(r: dict) -> str:
    """``need +- uncertainty`` of the device (peak plus the GPU's overheads), or '' without a GPU profile."""
    d = (r.get("resources") or {}).get("device")
    return f"{fmt_bytes(d['need'])} +-{fmt_bytes(d['uncertainty'])}" if d and d["uncertainty"] else ""


def _plans_table(rows: list[dict]) -> str:
    lines = [f"{'verdict':<12} {'tensors peak':>12} {'device need +- uncertainty':>26} {'step time':>9} {'s/step':>8} "
             f"{'tokens/s':>9}  plan"]
    for r in rows:
        verdict = r.get("verdict") or ("fits" if r["fits"] else "does not fit")
        if r.get("error"):
            lines.append(f"{'refused':<12} {'':>12} {'':>26} {'':>9} {'':>8} {'':>9}  {r['plan']}: {r['error']}")
            continue
        lines.append(f"{verdict:<12} {fmt_bytes(r['peak_bytes']):>12} {_need(r):>26} {(r['overhead'] or 0):>+9.0%} "
                     f"{r['step_time_s']:>8.3g} {r.get('tokens_per_s') or 0:>9,.0f}  {r['plan']}")
    lines.append("tensors peak: predicted peak of the run's tensors; device need: that plus the GPU's overheads (CUDA "
                 "context, workspace, fragmentation), +- their uncertainty; step time: predicted time per step "
                 "relative to baseline's (+33% = a third slower, -40% = 40% faster), s/step and tokens/s from the counted FLOPs "
                 "and bytes (colabkit.estimate.speed). Predictions, nothing allocated.")
    return "\n".join(lines)


def _largest_table(r: dict) -> str:
    where = f"on {r['gpu'] or 'cpu'}, seq {r['seq']}, batch {r['batch']}"
    if r["model"] is None:
        return "\n".join([f"nothing fits plan {r['plan']} {where}: {r['why']}", *r["suggestions"]])
    d = (r.get("resources") or {}).get("device") or {}
    need = (f"{fmt_bytes(d['need'])} +- {fmt_bytes(d['uncertainty'])}" if d.get("uncertainty")
            else fmt_bytes(d.get("need", r["peak_bytes"])))
    return "\n".join([
        f"{'plan':<34} {'largest model':<22} {'parameters':>10} {'device need +- uncertainty':>28}  verdict",
        f"{r['plan']:<34} {r['model']:<22} {r['params'] / 1e9:>8.2f} B {need:>28}  {r.get('verdict') or 'fits'}",
        f"{where}, budget {fmt_bytes(r['budget_bytes'])}: the tensors' peak plus the GPU's overheads; 'tight' fits only "
        "inside the overheads' uncertainty. A prediction, nothing allocated."])


def _check_seq(model: Any, seq: int) -> None:
    """A sequence longer than the model's context is refused here as in ``train`` (presets and hub models)."""
    from ..models import hub_config
    from ..train import check_context

    check_context(model, seq)
    if isinstance(model, str) and model.startswith("hf:"):  # (your own FILE.py:FN model: its own checks)
        cfg = hub_config(model[3:])
        n = next((v for k in ("max_position_embeddings", "n_positions") if isinstance(v := getattr(cfg, k, None), int)), None)
        if n is not None and seq > n:
            raise ValueError(f"seq {seq} is longer than the model's context ({model}: {n} positions): use seq <= {n}")


def _what_fits(plan: str, seq: int, batch: int, gpu: str | None, device: str | None) -> list[str]:
    """What would fit when nothing does: the longest power-of-two sequence with this plan, and the first
    plan (this one plus checkpointing, fp16, offloaded activations) that fits at this sequence."""
    from ..plan import Plan, PlanError

    tips = []
    s = 1 << (seq - 1).bit_length() - 1 if seq > 1 else 0
    while s >= 16:
        r = largest(plan, seq=s, batch=batch, gpu=gpu, device=device)
        if r["model"]:
            tips.append(f"  --seq {s} with plan {plan}: up to {r['model']} ({r['params'] / 1e9:.2f} B parameters)")
            break
        s //= 2
    own = [t for t in Plan.parse(plan).tokens if t != "baseline"]
    tried = []
    for extra in (["checkpoint"], ["fp16", "checkpoint"], ["fp16", "checkpoint", "offload:activations"]):
        try:
            p = str(Plan.parse(list(dict.fromkeys(own + extra))))
        except PlanError:
            continue
        if p == plan or p in tried:
            continue
        tried.append(p)
        r = largest(p, seq=seq, batch=batch, gpu=gpu, device=device)
        if r["model"]:
            tips.append(f"  plan {p} at seq {seq}: up to {r['model']} ({r['params'] / 1e9:.2f} B parameters)")
            break
    else:
        if tried:
            tips.append(f"  (at seq {seq} none of {', '.join(tried)} fits either)")
    return ["what would fit:", *tips] if tips else ["nothing smaller fits either: use a GPU with more memory"]


def _args(p, plan=True, model=True) -> None:
    if model:
        p.add_argument("--model", default="gpt2-124m", help="preset, gpt:LxD, llama:LxD, hf:<id> or your own model as FILE.py:FN (default gpt2-124m)")
    if plan:
        p.add_argument("--plan", default="baseline", help="one plan: tokens joined by '+', or auto: the fastest predicted to fit (default baseline)")
    p.add_argument("--batch", type=int, default=1, help="sequences per optimizer step, over all ranks with --world-size "
                   "(default 1; raised to one per rank)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--gpu", default="t4", help="GPU profile to predict for: t4, t4x2, p100, l4, a100, a100-80gb, h100, h200 (default t4)")
    p.add_argument("--device", default=None, choices=["cpu"], help="predict a CPU run instead (how CI checks against bench)")


def register_cli(subcommand) -> None:
    """Add the ``estimate``, ``plan``, ``largest`` and ``calibrate`` subcommands with the CLI's ``subcommand`` decorator
    (called by ``colabkit.__main__.main``; importing the CLI from here would load it twice under -m)."""
    from ..train import check_sizes

    def estimate_args(p):
        _args(p)
        p.add_argument("--world-size", type=int, default=1, help="per-rank bytes of a zero:1|2|3 plan on N ranks")

    @subcommand("estimate", "predicted peak memory of a run, without allocating it", estimate_args, _table)
    def _estimate(args):
        check_sizes(args.batch, args.seq, 1)
        _check_seq(args.model, args.seq)
        plan = args.plan
        if plan.strip() == "auto":  # the fastest plan predicted to fit, said with why
            choice = choose(args.model, args.batch, args.seq, gpu=args.gpu, device=args.device)
            print(f"colabkit: {choice['why']}", file=sys.stderr)
            plan = choice["plan"]
        return estimate(args.model, plan, batch=args.batch, seq=args.seq, gpu=args.gpu, device=args.device,
                        world_size=args.world_size)

    def plan_args(p):
        _args(p, plan=False)
        p.add_argument("--chart", default=None, metavar="PNG", help="save the Pareto chart (memory vs overhead)")

    @subcommand("plan", "the plans that fit, cheapest step first", plan_args, _plans_table)
    def _plan(args):
        check_sizes(args.batch, args.seq, 1)
        _check_seq(args.model, args.seq)
        rows = plans(args.model, args.batch, args.seq, args.gpu, args.device)
        if args.chart:
            import matplotlib

            matplotlib.use("Agg")
            ax = pareto(rows, budget_bytes=next((r["budget_bytes"] for r in rows if r.get("budget_bytes")), None))
            ax.figure.savefig(args.chart, dpi=120, bbox_inches="tight")
        return [{k: r.get(k) for k in ("plan", "fits", "verdict", "peak_bytes", "host_bytes", "overhead", "step_time_s",
                                       "tokens_per_s", "breakdown", "overheads", "resources", "error")} for r in rows]

    def largest_args(p):
        _args(p, model=False)
        p.add_argument("--model", help=argparse.SUPPRESS)  # taken only to say what to run instead

    @subcommand("largest", "the largest GPT-shaped model that fits a plan (exit 1 when nothing does)",
                largest_args, _largest_table)
    def _largest(args):
        if args.model is not None:  # the same question about that model, with the options given
            same = f"--model {args.model} --batch {args.batch} --seq {args.seq} " + \
                (f"--device {args.device}" if args.device else f"--gpu {args.gpu}")
            raise ValueError(f"largest takes no --model: it searches GPT shapes for the largest that fits the plan. "
                             f"To ask about {args.model}: python -m colabkit plan {same} (every plan, fits or not) "
                             f"or python -m colabkit estimate {same} --plan {args.plan}")
        check_sizes(args.batch, args.seq, 1)
        gpu = None if args.device == "cpu" else args.gpu
        r = largest(args.plan, seq=args.seq, batch=args.batch, gpu=args.gpu, device=args.device)
        r.update(gpu=gpu, seq=args.seq, batch=args.batch, ok=r["model"] is not None)
        if r["model"] is None:
            r["why"] = (f"even the smallest GPT ({r.get('smallest')}) needs {fmt_bytes(r['peak_bytes'])} of "
                        f"{fmt_bytes(r['budget_bytes'])}")
            r["suggestions"] = _what_fits(r["plan"], args.seq, args.batch, args.gpu, args.device)
        return r

    def calibrate_args(p):
        p.add_argument("--measurement", default=None, metavar="JSON",
                       help="fit a recorded measurement instead of measuring this GPU")
        p.add_argument("--profile", default=None, help="GPU profile key (default: the one matching the GPU's name)")
        p.add_argument("--no-store", action="store_true", help="do not store the fitted profile")

    @subcommand("calibrate", "measure this GPU's overheads and store a profile later estimates use (GPU only)",
                calibrate_args, calibration_table)
    def _calibrate(args):
        import json

        m = None
        if args.measurement:
            with open(args.measurement) as f:
                m = json.load(f)
        return calibrate(m, key=args.profile, store=not args.no_store)

"""The ``estimate``, ``plan`` and ``largest`` subcommands (registered by ``colabkit.__main__``)."""
from __future__ import annotations

from ..memory import CATEGORIES, fmt_bytes
from .calibrate import calibrate, calibration_table
from .planner import largest, pareto, plans
from .predict import estimate


def _table(r: dict) -> str:
    lines = [f"{r['model']}  plan {r['plan']}  batch {r['batch']}  seq {r['seq']}  on {r['device']}",
             f"predicted peak {fmt_bytes(r['peak_bytes'])} of {fmt_bytes(r['budget_bytes'])}   "
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
        d = r["resources"]["device"]
        lines.append(f"{'device need':<20} {fmt_bytes(d['need']):>10} {fmt_bytes(d['uncertainty']):>9}  "
                     "(tensors' peak + overheads; sources: --json overhead_terms)")
    if "analytic" in r:
        a = r["analytic"]
        lines.append(f"formula: {a['bytes_per_param']:.1f} B/param + activations {a['activation_formula']} "
                     f"= {fmt_bytes(a['total'])} ({a['error_vs_trace']:+.0%} vs the trace)")
    return "\n".join(lines + r["notes"])


def _need(r: dict) -> str:
    """``need +- uncertainty`` of the device (peak plus the GPU's overheads), or '' without a GPU profile."""
    d = (r.get("resources") or {}).get("device")
    return f"need {fmt_bytes(d['need'])} +-{fmt_bytes(d['uncertainty'])}" if d and d["uncertainty"] else ""


def _args(p, plan=True, model=True) -> None:
    if model:
        p.add_argument("--model", default="gpt2-124m")
    if plan:
        p.add_argument("--plan", default="baseline")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--gpu", default="t4")
    p.add_argument("--device", default=None, choices=["cpu"])


def register_cli(subcommand) -> None:
    """Add the ``estimate``, ``plan``, ``largest`` and ``calibrate`` subcommands with the CLI's ``subcommand`` decorator
    (called by ``colabkit.__main__.main``; importing the CLI from here would load it twice under -m)."""

    def estimate_args(p):
        _args(p)
        p.add_argument("--world-size", type=int, default=1, help="per-rank bytes of a zero:1|2|3 plan on N ranks")

    @subcommand("estimate", "predicted peak memory of a run, without allocating it", estimate_args, _table)
    def _estimate(args):
        return estimate(args.model, args.plan, batch=args.batch, seq=args.seq, gpu=args.gpu, device=args.device,
                        world_size=args.world_size)

    def plan_args(p):
        _args(p, plan=False)
        p.add_argument("--chart", default=None, metavar="PNG", help="save the Pareto chart (memory vs overhead)")

    @subcommand("plan", "the plans that fit, cheapest step first", plan_args,
                lambda rows: "\n".join(f"{r.get('verdict') or ('fits' if r['fits'] else 'does not fit'):<12} "
                                       f"{fmt_bytes(r['peak_bytes']):>10} {_need(r):>22} "
                                       f"{(r['overhead'] or 0):+7.0%}  {r['plan']}" for r in rows))
    def _plan(args):
        rows = plans(args.model, args.batch, args.seq, args.gpu, args.device)
        if args.chart:
            import matplotlib

            matplotlib.use("Agg")
            ax = pareto(rows, budget_bytes=next((r["budget_bytes"] for r in rows if r.get("budget_bytes")), None))
            ax.figure.savefig(args.chart, dpi=120, bbox_inches="tight")
        return [{k: r.get(k) for k in ("plan", "fits", "verdict", "peak_bytes", "host_bytes", "overhead", "step_time_s",
                                       "breakdown", "overheads", "resources", "error")} for r in rows]

    @subcommand("largest", "the largest GPT-shaped model that fits a plan", lambda p: _args(p, model=False),
                lambda r: f"{r['model']}: {r['params'] / 1e9:.2f}B params, peak {fmt_bytes(r['peak_bytes'])} "
                          f"of {fmt_bytes(r['budget_bytes'])}")
    def _largest(args):
        return largest(args.plan, seq=args.seq, batch=args.batch, gpu=args.gpu, device=args.device)


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

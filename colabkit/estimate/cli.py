"""The ``estimate``, ``plan`` and ``largest`` subcommands (registered by ``colabkit.__main__``)."""
from __future__ import annotations

from ..memory import CATEGORIES, fmt_bytes
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
    if "analytic" in r:
        a = r["analytic"]
        lines.append(f"formula: {a['bytes_per_param']:.1f} B/param + activations {a['activation_formula']} "
                     f"= {fmt_bytes(a['total'])} ({a['error_vs_trace']:+.0%} vs the trace)")
    return "\n".join(lines + r["notes"])


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
    """Add the ``estimate``, ``plan`` and ``largest`` subcommands with the CLI's ``subcommand`` decorator
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
                lambda rows: "\n".join(f"{'fits' if r['fits'] else 'no  '} {fmt_bytes(r['peak_bytes']):>10} "
                                       f"{(r['overhead'] or 0):+7.0%}  {r['plan']}" for r in rows))
    def _plan(args):
        rows = plans(args.model, args.batch, args.seq, args.gpu, args.device)
        if args.chart:
            import matplotlib

            matplotlib.use("Agg")
            ax = pareto(rows, budget_bytes=next((r["budget_bytes"] for r in rows if r.get("budget_bytes")), None))
            ax.figure.savefig(args.chart, dpi=120, bbox_inches="tight")
        return [{k: r.get(k) for k in ("plan", "fits", "peak_bytes", "host_bytes", "overhead", "step_time_s",
                                       "breakdown", "error")} for r in rows]

    @subcommand("largest", "the largest GPT-shaped model that fits a plan", lambda p: _args(p, model=False),
                lambda r: f"{r['model']}: {r['params'] / 1e9:.2f}B params, peak {fmt_bytes(r['peak_bytes'])} "
                          f"of {fmt_bytes(r['budget_bytes'])}")
    def _largest(args):
        return largest(args.plan, seq=args.seq, batch=args.batch, gpu=args.gpu, device=args.device)


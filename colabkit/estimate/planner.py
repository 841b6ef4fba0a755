"""The planner: which plans fit, cheapest step first (:func:`plans`), the largest GPT-shaped model a
plan fits (:func:`largest`), and the OOM guard's suggestion (:func:`suggest`).

>>> ranked = plans("gpt-tiny", batch=2, seq=16, candidates=["baseline"])
>>> ranked[0]["fits"], ranked[0]["overhead"]
(True, 0.0)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch

from ..env import GPU_PROFILES
from ..models import GPT2_VOCAB, GPTConfig, gpt_config
from ..oom import register_suggester
from ..plan import REGISTRY, Context, Plan, PlanError
from .predict import estimate
from .speed import HOST_BYTES_PER_S
from .as_gpu import _as_t4, check_as_gpu
from .trace import gpt_builder

GiB = 1024**3


# Step-time cost model, as a fraction of the plain step's compute (sources in brackets):
COST = {
    "checkpoint": 0.33,   # one more forward = 1/3 of forward+backward FLOPs [Chen et al. 2016]
    "adamw8bit": 0.05,    # blockwise 8-bit update; bitsandbytes reports parity to a few % [Dettmers 2022]
    "paged-adamw8bit": 0.05,
    "adamw4bit": 0.10,    # assumed: pure-torch quantize/dequantize of both moments each step
    "lion8bit": 0.05, "lion": 0.0, "adafactor": 0.05, "sgd": 0.0, "adamw": 0.0,
    "fused-step": 0.02,   # assumed: per-parameter step launches inside backward
    "compress": 0.10,     # assumed: quantize on save, dequantize on use
    "accum": 0.02,        # per extra micro-batch: launch overhead, smaller matmuls
    "fp16": -0.40,        # T4 tensor cores: 65 vs 8.1 TFLOPS peak; ~1.5-2x in practice [Micikevicius 2018]
}
PCIE_BYTES_PER_S = 12e9   # T4: PCIe 3.0 x16, 15.75 GB/s theoretical, ~12 GB/s pinned copies
T4_FLOPS = {"fp32": 8.1e12 * 0.5, "fp16": 65e12 * 0.25}  # peak x assumed utilisation


def step_time(result: dict[str, Any]) -> float:
    """Predicted seconds per optimizer step on a T4: 6*N*tokens FLOPs at an assumed utilisation, the
    cost-model fractions above, PCIe transfers for offload (optimizer: gradients down + weights up,
    8 B/param; params: fetched in forward and backward; activations: down and up) and the host's step."""
    plan = Plan.parse(result["plan"])
    tokens = result["batch"] * result["seq"]
    base = 6 * result["params"] * tokens / T4_FLOPS["fp32"]
    t = base
    for name, value in plan.values:
        if name == "accum":
            t += base * COST["accum"] * (value - 1)
        elif name == "checkpoint":
            t += base * COST["checkpoint"] / (1 if value is True else int(value))
        elif name in COST:
            t += base * COST[name]
    t += base * COST.get(plan.optimizer, 0.0) * (plan.optimizer not in dict(plan.values))
    offload = plan.get("offload") or ()
    n = result.get("trainable_params") or result["params"]
    moved = (8 * n if "optimizer" in offload else 0) + 2 * result.get("host_bytes", 0) * (
        ("params" in offload) + ("activations" in offload)) / max(1, len(offload))
    host_step = 28 * n / HOST_BYTES_PER_S if "optimizer" in offload else 0.0  # fp32 AdamW: 28 B/param (speed)
    return t + moved / PCIE_BYTES_PER_S + host_step


def candidate_plans(profile: str | None = "t4") -> list[str]:
    """Combinations of precision x checkpoint x optimizer x fused-step x offload that the registry has."""
    pick = lambda *toks: [t for t in toks if t == "" or t.split(":")[0] in REGISTRY]  # noqa: E731
    out = []
    for prec in pick("", "fp16"):
        for ck in pick("", "checkpoint"):
            for opt in pick("", "adamw8bit", "adamw4bit"):
                for fused in pick("", "fused-step"):
                    for off in (pick("", "offload:optimizer") if profile else [""]):
                        toks = [t for t in (prec, ck, opt, fused, off) if t]
                        try:
                            p = Plan.parse(toks or "baseline")
                            with _as_t4(GPU_PROFILES.get(profile or "")):
                                if profile:
                                    check_as_gpu(p)
                                else:
                                    p.check(Context(device=torch.device("cpu")))
                        except PlanError:
                            continue
                        out.append(str(p))
    return out


def plans(model_fn, batch: int = 1, seq: int = 1024, gpu: str | None = "t4", device: str | None = None,
          candidates: Iterable[str] | None = None, budget_bytes: int | None = None,
          inputs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Estimate every candidate plan; the ones that fit come first, cheapest step first. ``model_fn`` and
    ``inputs`` as :func:`~colabkit.estimate.estimate` takes them.

    >>> ranked = plans("gpt-tiny", batch=2, seq=16, candidates=["baseline"])
    >>> ranked[0]["fits"], ranked[0]["overhead"]
    (True, 0.0)
    """
    rows = []
    cfg = None
    if isinstance(model_fn, str) and inputs is None:
        try:
            cfg = gpt_config(model_fn)
            cfg = replace(cfg, block_size=max(cfg.block_size, seq))
        except ValueError:  # another family: traced whole
            cfg = None
    for p in candidates or candidate_plans(None if device == "cpu" else gpu):
        try:
            r = (_fast_estimate(cfg, p, batch, seq, gpu, device, budget_bytes) if cfg is not None
                 else estimate(model_fn, p, batch=batch, seq=seq, gpu=gpu, device=device, budget_bytes=budget_bytes,
                               inputs=inputs))
            r["plan"] = p
        except PlanError as e:
            rows.append({"plan": p, "fits": False, "error": str(e), "peak_bytes": None, "overhead": None})
            continue
        r["step_time_s"] = r.get("step_time_s") or step_time(r)  # speed.py's prediction; the cost model otherwise
        rows.append(r)
    ok = [r for r in rows if r.get("step_time_s") is not None]
    base = next((r["step_time_s"] for r in ok if r["plan"] == "baseline"),
                6 * ok[0]["params"] * batch * seq / T4_FLOPS["fp32"] if ok else 1.0)
    for r in ok:
        r["overhead"] = r["step_time_s"] / base - 1
    return sorted(rows, key=lambda r: (not r["fits"], r["overhead"] if r["overhead"] is not None else 9e9))


def pareto(rows: list[dict[str, Any]], ax=None, budget_bytes: int | None = None, title: str = ""):
    """Memory vs step-time overhead of each plan, the Pareto front joined, the budget as a line."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    pts = [(r["peak_bytes"] / GiB, r["overhead"], r["plan"], r["fits"]) for r in rows if r.get("peak_bytes")]
    for m, o, name, fits in pts:
        ax.scatter(o * 100, m, color="tab:green" if fits else "tab:red")
        ax.annotate(name, (o * 100, m), fontsize=7)
    front, best = [], float("inf")
    for m, o, _, _ in sorted(pts, key=lambda p: (p[1], p[0])):
        if m < best:
            front.append((o * 100, m))
            best = m
    if front:
        ax.plot(*zip(*front), "k--", lw=1, label="Pareto front")
    if budget_bytes:
        ax.axhline(budget_bytes / GiB, color="gray", ls=":", label="budget")
    ax.set_xlabel("predicted step-time overhead vs baseline (%)")
    ax.set_ylabel("predicted peak (GiB)")
    for fits, color, label in ((True, "tab:green", "fits"), (False, "tab:red", "does not fit")):
        if any(p[3] == fits for p in pts):  # a legend entry only for markers the chart shows
            ax.scatter([], [], color=color, label=label)
    ax.set_title(title or "plans: predicted memory vs step-time cost", fontsize=9)
    ax.legend(fontsize=8)
    return ax


# ----- the largest model that fits ------------------------------------------------------------
def gpt2_shape(n_embd: int, vocab: int = GPT2_VOCAB, block: int = 1024) -> GPTConfig:
    """A GPT-2-family shape for a width: depth grows with width like 124M (12x768) .. 1.5B (48x1600)
    .. GPT-3 2.7B (32x2560) — here L = round(n_embd / 64 * 0.75) clamped to [12, 48] — 64-wide heads."""
    L = max(12, min(48, round(n_embd / 64 * 0.75)))
    return GPTConfig(n_layer=L, n_embd=n_embd, n_head=max(1, n_embd // 64), vocab_size=vocab, block_size=block)


def _fast_estimate(cfg: GPTConfig, plan: str, batch: int, seq: int, gpu: str | None, device: str | None,
                   budget_bytes: int | None = None) -> dict:
    """Estimate a deep GPT from traces at depths 2 and 3: every block is the same, so each phase's peak
    (forward, backward, optimizer step) is affine in depth; the largest at depth L is the step's peak
    (:func:`.trace._affine`; the traces are cached, so plans that share one trace it once).
    Checked against full traces over several depths and plans by the tests."""
    out = estimate(gpt_builder(cfg), plan, batch=batch, seq=seq, gpu=gpu, device=device, budget_bytes=budget_bytes)
    out["model"] = f"gpt:{cfg.n_layer}x{cfg.n_embd}:v{cfg.vocab_size}"
    return out


def largest(plan: Plan | str = "baseline", seq: int = 1024, batch: int = 1, gpu: str | None = "t4",
            device: str | None = None, vocab: int = GPT2_VOCAB, budget_bytes: int | None = None) -> dict[str, Any]:
    """The largest GPT-2-shaped model (:func:`gpt2_shape`, widths in steps of 64) whose estimated
    peak fits the budget under ``plan``: a bisection over widths with the estimator.

    >>> largest("baseline", seq=64, gpu="t4", budget_bytes=2**30)["params"] > 1e7   # 1 GiB of the T4 profile
    True
    """
    plan = str(Plan.parse(plan))
    cache: dict[int, dict] = {}

    def at(width: int) -> dict:
        if width not in cache:
            cache[width] = _fast_estimate(gpt2_shape(width, vocab, max(seq, 1024)), plan, batch, seq, gpu, device,
                                          budget_bytes)
        return cache[width]

    lo, hi = 1, 2  # in units of 64: find hi that does not fit
    if not at(64 * lo)["fits"]:
        r = at(64 * lo)
        return {"params": 0, "model": None, "peak_bytes": r["peak_bytes"], "budget_bytes": r["budget_bytes"],
                "plan": plan, "note": f"even {r['model']} does not fit", "smallest": r["model"],
                "verdict": r.get("verdict"), "resources": r.get("resources")}
    while at(64 * hi)["fits"]:
        lo, hi = hi, hi * 2
        if hi > 1024:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(64 * mid)["fits"] else (lo, mid)
    r = at(64 * lo)
    return {"params": r["params"], "model": r["model"], "peak_bytes": r["peak_bytes"],
            "budget_bytes": r["budget_bytes"], "plan": plan, "host_bytes": r["host_bytes"],
            "verdict": r.get("verdict"), "resources": r.get("resources")}


def suggest(model: str | Any, batch: int, seq: int, gpu: str | None = "t4", device: str | None = None,
            budget_bytes: int | None = None, candidates: list[str] | None = None) -> dict[str, Any] | None:
    """The cheapest plan (by the cost model) whose estimate fits ``budget_bytes``; None if none does.
    The OOM guard (:mod:`colabkit.oom`) calls it through :func:`colabkit.oom.register_suggester`.

    >>> suggest("gpt-tiny", 2, 16, candidates=["baseline"])["plan"]
    'baseline'
    """
    rows = plans(model, batch=batch, seq=seq, gpu=gpu, device=device, candidates=candidates, budget_bytes=budget_bytes)
    fit = [r for r in rows if r["fits"]]
    return {k: fit[0].get(k) for k in ("plan", "peak_bytes", "overhead", "breakdown")} if fit else None


register_suggester(suggest)

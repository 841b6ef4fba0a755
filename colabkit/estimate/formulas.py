"""The textbook formulas shown next to the trace, and the host/GPU split of offloaded state.
"""
from __future__ import annotations

import math
from typing import Any

from ..memory import fmt_bytes
from ..models import gpt_config  # noqa: F401  (doctest)
from ..plan import REGISTRY, Plan
from ..techniques.chunked_ce import auto_chunk, logits_bytes
from ..techniques.offload import pinned_bytes  # the host-RAM guard's rounding: one rule for both
from ..techniques.optimizers import state_bytes_per_param


def analytic(cfg: Any, plan: Plan | str, batch: int, seq: int, trainable_params: int | None = None) -> dict[str, Any]:
    """Bytes per parameter for the plan and activations ~ s*b*h*(34 + 5*a*s/h) per layer
    (Korthikanti et al. 2022, 2-byte activations; x2 in fp32; the 5*a*s/h attention-matrix term is
    gone with a fused SDPA kernel; ``checkpoint`` keeps 2*s*b*h per layer plus one layer recomputed).

    >>> a = analytic(gpt_config("gpt2-124m"), "baseline", 1, 1024)
    >>> a["bytes_per_param"]
    16.0
    """
    plan = Plan.parse(plan)

    n = cfg.n_params if hasattr(cfg, "n_params") else trainable_params or 0
    trainable = trainable_params if trainable_params is not None else n
    try:
        opt = state_bytes_per_param(plan.optimizer_token) if plan.optimizer in REGISTRY else 8.0
    except ValueError:  # shape-dependent state (galore): AdamW's 8 B/param as the bound; the trace has the figure
        opt = 8.0
    half = "fp16" in plan or "bf16" in plan
    b = batch // plan.get("accum", 1) or 1
    s, h, L, a, V = seq, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size
    scale = 1.0 if half else 2.0  # the formula counts 2-byte activations
    per_layer = s * b * h * 34 * scale  # fused attention: no S x S term
    formula = "s*b*h*34" + ("" if half else " x2 (fp32)")
    if "attention" in plan and plan.get("attention") == "math":
        per_layer += s * b * h * 5 * a * s / h * scale
        formula = "s*b*h*(34 + 5*a*s/h)" + ("" if half else " x2 (fp32)")
    every = plan.get("checkpoint")
    if every:
        every = 1 if every is True else int(every)
        acts = (L / every) * 2 * s * b * h * scale + per_layer + (L - L / every) * per_layer
        formula += "; checkpoint: 2*s*b*h per checkpointed layer + 1 layer recomputed"
    else:
        acts = L * per_layer
    logits = b * s * V * (2 + 4 + 4 if half else 4 + 4)  # logits, fp32 copy for the loss, its grad
    if "chunked-ce" in plan:  # one chunk's logits at a time, one log-sum-exp per row
        logits = logits_bytes(b * s, V, plan.get("chunked-ce") or auto_chunk(b * s, V, h), half)
    weights = 4 * n + (2 * n if half else 0)  # fp32 master (+ autocast's fp16 copies)
    grads = 4 * trainable
    state = opt * trainable
    offload = plan.get("offload") or ()
    if "optimizer" in offload:  # state on the host; gradients leave one at a time
        state, grads = 0, 4 * V * h
    if "params" in offload:  # two blocks' weights on the GPU
        weights = weights * min(1.0, 2 / L)
    if "activations" in offload:
        acts = acts / L
    if "fused-step" in plan:  # gradients never coexist: about the largest matrix (the embedding)
        grads = 4 * V * h
    total = weights + grads + state + acts + logits
    return {"bytes_per_param": (weights + grads + state) / max(n, 1), "weights": weights, "grads": grads,
            "optimizer": state, "activations": acts + logits, "activations_per_layer": per_layer,
            "activation_formula": formula, "total": total}


def _host_split(br: dict[str, int], at: dict[str, int], offload: frozenset, trainable_shapes: list, L: int,
                notes: list[str]) -> tuple[dict, dict, int]:
    """Move offloaded categories to host RAM: what the GPU keeps is one staging tensor (optimizer),
    two blocks of weights (params: current + prefetch), one block of saved activations. Pinned host
    tensors (master weights, gradient buffers, streamed weights) count with CUDA's power-of-two rounding."""
    br, at, host = dict(br), dict(at), 0
    biggest = 4 * max((math.prod(s) for s in trainable_shapes), default=0)
    n_train = sum(math.prod(s) for s in trainable_shapes)
    pinned = sum(pinned_bytes(4 * math.prod(s)) for s in trainable_shapes)  # one pinned fp32 copy of each
    for what in sorted(offload):
        cat = {"optimizer": "optimizer", "params": "params", "activations": "activations"}[what]
        keep = {"optimizer": 0, "params": br["params"] * min(1.0, 2 / max(L, 1)),
                "activations": br["activations"] / max(L, 1)}[what]
        moved = br[cat] - int(keep)
        if what == "params" and n_train:  # each streamed weight is a pinned host tensor
            moved_host = int(moved * pinned / (4 * n_train))
        else:
            moved_host = moved
        host += moved_host
        at[cat] = max(0, at[cat] - moved)
        br[cat] = int(keep)
        extra = ""
        if what == "optimizer":  # HostOptimizer: pinned fp32 master + gradient buffer per tensor; each gradient
            host += 2 * pinned   # leaves the GPU as soon as it is complete (about one tensor at a time)
            at["grads"], br["grads"] = min(at["grads"], biggest), min(br["grads"], biggest)
            extra = (f"; host also holds pinned fp32 master weights and gradient buffers ({fmt_bytes(2 * pinned)}, "
                     f"{fmt_bytes(8 * n_train)} before CUDA's power-of-two pinned rounding)")
        notes.append(f"offload:{what}: {fmt_bytes(moved)} moved to host RAM as {fmt_bytes(moved_host)} "
                     f"(GPU keeps {fmt_bytes(keep)}){extra}")
    return br, at, host

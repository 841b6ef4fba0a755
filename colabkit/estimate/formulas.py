"""The textbook formulas shown next to the trace, and the host/GPU split of offloaded state.
"""
from __future__ import annotations

import math
from typing import Any

from ..device import pinned_bytes  # the host-RAM guard's rounding: one rule for both
from ..memory import fmt_bytes
from ..models import gpt_config  # noqa: F401  (doctest)
from ..plan import REGISTRY, Plan
from ..techniques.chunked_ce import auto_chunk, logits_bytes
from ..techniques.optimizers import state_bytes_per_param


def analytic(cfg: Any, plan: Plan | str, batch: int, seq: int, trainable_params: int | None = None,
             trainable_shapes: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Bytes per parameter for the plan and activations ~ s*b*h*(34 + 5*a*s/h) per layer
    (Korthikanti et al. 2022, 2-byte activations; x2 in fp32; the 5*a*s/h attention-matrix term is
    gone with a fused SDPA kernel; ``checkpoint`` keeps 2*s*b*h per layer plus one layer recomputed).
    The optimizer's state per parameter is its formula's for each trainable shape where they are given
    (Adafactor's factored moments are rows + columns per matrix; the quantized optimizers keep small tensors
    in fp32), else one rate for every parameter.

    >>> a = analytic(gpt_config("gpt2-124m"), "baseline", 1, 1024)
    >>> a["bytes_per_param"]
    16.0
    """
    plan = Plan.parse(plan)

    n = cfg.n_params if hasattr(cfg, "n_params") else trainable_params or 0
    trainable = trainable_params if trainable_params is not None else n
    try:
        if plan.optimizer not in REGISTRY:
            opt = 8.0
        elif trainable_shapes:  # each tensor's own rate, averaged over the trainable parameters
            sizes = [math.prod(sh) for sh in trainable_shapes]
            opt = sum(k * state_bytes_per_param(plan.optimizer_token, tuple(sh)) for k, sh in zip(sizes, trainable_shapes)) \
                / max(sum(sizes), 1)
        else:
            opt = state_bytes_per_param(plan.optimizer_token)
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
                notes: list[str], block_shapes: list | None = None, phase: str | None = None,
                grads_streamed: bool = False, blocks_done: bool = False) -> tuple[dict, dict, int]:
    """Move offloaded categories to host RAM (``phase``: the phase these figures are of; None: the whole step).

    * ``optimizer``: the state and the step's temporaries (the update runs on the host) leave; each gradient
      leaves as soon as it is complete (about one tensor at a time); the host holds a pinned fp32 master and
      gradient buffer per tensor.
    * ``params``: the transformer blocks' weights (``block_shapes``), their gradients (streamed to pinned host
      buffers in backward) and their optimizer state (updated in place on the host) leave; the GPU keeps
      everything else, plus in forward/backward two blocks' weights (current + prefetch) and one block's
      gradients in flight. Without ``block_shapes``: all trainable weights counted as blocks.
      ``grads_streamed``: the trace already moved each block gradient to the host once complete
      (``trace.block_grads_to_host``), so the figures' gradients are the GPU's: kept as they are.
      ``blocks_done``: the figures are of a moment after every block's backward (no block in flight).
    * ``activations``: one block of saved activations stays.

    Pinned host tensors count with CUDA's power-of-two rounding."""
    br, at, host = dict(br), dict(at), 0
    biggest = 4 * max((math.prod(s) for s in trainable_shapes), default=0)
    n_train = sum(math.prod(s) for s in trainable_shapes)
    pinned = sum(pinned_bytes(4 * math.prod(s)) for s in trainable_shapes)  # one pinned fp32 copy of each
    blocks = trainable_shapes if block_shapes is None else block_shapes
    n_block = sum(math.prod(s) for s in blocks)
    share = n_block / n_train if n_train else 0.0  # the blocks' part of each per-parameter category
    for what in sorted(offload):
        extra = ""
        if what == "params":
            in_flight = 0 if phase == "optimizer" or blocks_done else 1
            keep_w = 1 - share + share * in_flight * min(1.0, 2 / max(L, 1))
            keep_g = 1.0 if grads_streamed else 1 - share + share * in_flight / max(L, 1)
            moved = state = 0
            for cat, frac in (("params", keep_w), ("grads", keep_g), ("optimizer", 1 - share)):
                m = br[cat] - int(br[cat] * frac)
                moved += m
                state = m if cat == "optimizer" else state
                at[cat] = max(0, at[cat] - m)
                br[cat] = int(br[cat] * frac)
            # on the host: pinned block weights and gradient buffers, and the blocks' (pageable) optimizer state
            moved_host = 2 * sum(pinned_bytes(4 * math.prod(s)) for s in blocks) + state
            host += moved_host
            keep = br["params"]
        else:
            cat = what
            keep = 0 if what == "optimizer" else br["activations"] / max(L, 1)
            moved = br[cat] - int(keep)
            host += moved
            moved_host = moved
            at[cat] = max(0, at[cat] - moved)
            br[cat] = int(keep)
        if what == "optimizer":  # HostOptimizer: pinned fp32 master + gradient buffer per tensor; each gradient
            host += 2 * pinned   # leaves the GPU as soon as it is complete (about one tensor at a time)
            at["grads"], br["grads"] = min(at["grads"], biggest), min(br["grads"], biggest)
            if phase == "optimizer":  # the update and its temporaries run on the host
                at["grads"] = at["other"] = 0
            extra = (f"; host also holds pinned fp32 master weights and gradient buffers ({fmt_bytes(2 * pinned)}, "
                     f"{fmt_bytes(8 * n_train)} before CUDA's power-of-two pinned rounding)")
        notes.append(f"offload:{what}: {fmt_bytes(moved)} moved to host RAM as {fmt_bytes(moved_host)} "
                     f"(GPU keeps {fmt_bytes(keep)}){extra}")
    return br, at, host

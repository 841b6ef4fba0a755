"""Per-rank bytes of the ZeRO stages (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5) applied to a single-process trace.

With Ψ parameters, K bytes of optimizer state per parameter and N_d ranks, each rank holds:

=========  ===========  ===========  =============
stage      parameters   gradients    optimizer
=========  ===========  ===========  =============
none       P            G            K·Ψ
zero:1     P            G            K·Ψ / N_d
zero:2     P            G / N_d      K·Ψ / N_d
zero:3     P / N_d      G / N_d      K·Ψ / N_d
=========  ===========  ===========  =============

(P = 2Ψ and G = 2Ψ in the paper's fp16 setting, 4Ψ each in fp32; here P, G and K·Ψ are the traced
categories, so any precision or optimizer is covered.) Activations are the trace of one rank's
micro-batch (batch / N_d). FSDP2's zero:2 keeps its parameter shard *and* the gathered full copy
from forward to the end of backward, so its parameter peak is P·(1 + 1/N_d); the paper's P assumes
the shard is not kept. Communication per step (the paper's section 7): 2Ψ elements for stages 1
and 2 (reduce-scatter + all-gather, as DDP's all-reduce), 3Ψ for stage 3 (one more all-gather).

>>> zero_per_rank({"params": 400, "grads": 400, "optimizer": 800, "activations": 50, "other": 0}, 3, 2)
{'params': 200, 'grads': 200, 'optimizer': 400, 'activations': 50, 'other': 0}
"""
from __future__ import annotations

from ..plan import Plan, PlanError

SHARDED = {1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def zero_per_rank(breakdown: dict[str, int], stage: int | None, world_size: int) -> dict[str, int]:
    """One rank's categories under ZeRO ``stage`` on ``world_size`` ranks, from a single-process
    breakdown traced at the per-rank micro-batch (stage None: unchanged)."""
    out = dict(breakdown)
    if not stage or world_size < 2:
        return out
    for c in SHARDED[stage]:
        out[c] = -(-breakdown[c] // world_size)
    if stage == 2:  # FSDP2: shard kept next to the gathered parameters during forward/backward
        out["params"] = breakdown["params"] + -(-breakdown["params"] // world_size)
    return out


def comm_elements(params: int, stage: int | None, world_size: int) -> int:
    """Elements each rank sends per optimizer step (ring collectives, the ZeRO paper's 2Ψ / 3Ψ times
    (N_d-1)/N_d).

    >>> comm_elements(1000, 3, 2)
    1500
    """
    if world_size < 2:
        return 0
    per = 3 if stage == 3 else 2
    return per * params * (world_size - 1) // world_size


def for_rank(plan: Plan, batch: int, world_size: int) -> tuple[Plan, int, int | None]:
    """The single-process plan and micro-batch to trace for one rank of a sharded run, and its stage."""
    stage = plan.get("zero")
    if world_size < 2 or stage is None:
        if stage is not None:
            raise PlanError(f"zero:{stage} is per rank of a sharded run: give world_size >= 2 (--world-size 2)")
        return plan, batch, None
    if batch % world_size:
        raise PlanError(f"batch {batch} does not split over {world_size} ranks: use a batch divisible by {world_size}")
    rest = [t for t in plan.tokens if t.partition(":")[0] != "zero"]
    return Plan.parse(rest or "baseline"), batch // world_size, stage

"""What a GPU profile changes in a trace: the profile looked up by name, the plan traced on the CPU (offload
and attention tokens split off), capability checks answered as that GPU would, SDPA kept as its kernel keeps.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from ..env import GPU_PROFILES, env as _env_report, t4_rules
from ..plan import Context, Plan, PlanError

# Tokens whose effect is a GPU/host split: traced without them on the CPU, applied analytically.
_OFFLOAD = "offload"


def _profile(gpu: str | None, device: str | None) -> dict[str, Any] | None:
    if device == "cpu" or gpu is None:
        return None
    if gpu.lower() not in GPU_PROFILES:
        raise ValueError(f"unknown GPU profile {gpu!r}: use one of {', '.join(GPU_PROFILES)}, or device='cpu'")
    return GPU_PROFILES[gpu.lower()]


def _as_t4(profile: dict | None):
    """While checking a plan for a GPU profile, answer capability questions as that GPU would."""
    return t4_rules(profile is not None and not profile["native_bf16"])


def _split_gpu_tokens(plan: Plan, profile: dict | None) -> tuple[Plan, frozenset]:
    """On a GPU profile, the plan traced on the CPU: offload tokens removed (applied analytically) except
    ``offload:activations``, traced as it runs through the CPU twin (its pack/unpack and the copies back, which no
    per-category rule reproduces: the rule was 15% under on an H200 and 20-57% over the twin, 2026-11-27);
    ``paged-`` optimizers traced unpaged (same state; paging acts only under pressure), ``offload:params``
    traced with ``checkpoint`` (it recomputes every block in backward from the block's input), and an
    attention backend token removed (the CPU's fused SDPA kernel, like T4's efficient one, keeps no S x S).
    Returns the traced plan and the offload kinds left to the analytic split."""
    offload = frozenset(plan.get(_OFFLOAD) or ()) - {"activations"}
    if profile is None:
        return plan, frozenset()
    keep = []
    for tok in plan.tokens:
        if tok.startswith("offload:") and tok != "offload:activations" or tok in ("attention:efficient",
                                                                                  "attention:flash"):
            continue
        keep.append(tok[len("paged-"):] if tok.startswith("paged-") else tok)
    if "params" in offload and not any(t.startswith("checkpoint") for t in keep):
        keep.append("checkpoint")  # a streamed block is recomputed in backward: its activations are checkpoint's
    return Plan.parse(keep or "baseline"), offload


def check_as_gpu(plan: Plan) -> None:
    """Run every technique's check with a CUDA context (under T4 emulation flags), so conflicts that
    only exist on a GPU (offload rules, bf16 on a T4) are refused as the real run would refuse them.
    A check that needs a real GPU to answer (it queries the device) is skipped: the trace checks again."""
    ctx = Context(device=torch.device("cuda"), env={**_env_report(), "device": "cuda", "gpu": "Tesla T4",
                                                   "capability": [7, 5], "bf16_native": False})
    for t in plan.techniques():
        if t.check is None:
            continue
        try:
            t.check(plan, ctx)
        except PlanError:
            raise
        except (RuntimeError, AssertionError, AttributeError):  # no GPU here to query
            pass


@contextlib.contextmanager
def _attention_as(profile: dict | None, plan: Plan, notes: list[str]):
    """On a GPU profile, SDPA keeps what that GPU's kernel keeps. A T4 runs the memory-efficient kernel,
    dropout included (it stores the RNG seed, not a mask): output + log-sum-exp, no S x S matrix. The CPU
    falls back to the math kernel whenever dropout > 0 and keeps the S x S probabilities and mask, so the
    trace calls the CPU's fused kernel (same memory as the GPU's efficient one) with dropout 0.
    ``attention:math`` is traced as math, as the GPU would run it."""
    if profile is None or plan.get("attention") == "math":
        if profile is not None:
            notes.append("attention: math kernel (forced by attention:math): S x S scores and probabilities kept")
        yield
        return
    real = F.scaled_dot_product_attention
    seen: list[float] = []

    def sdpa(*args, **kwargs):
        seen.append(float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) or 0.0))
        kwargs["dropout_p"] = 0.0
        return real(*args[:4], **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
        if seen:
            kernel = "flash" if "flash" in profile.get("sdpa", ()) and plan.get("attention") == "flash" else "memory-efficient"
            notes.append(f"attention: the {profile['name']}'s {kernel} kernel, traced as such"
                         + (f" (dropout {max(seen):g} included; a CPU would fall back to the math kernel and keep "
                            "S x S matrices)" if max(seen) > 0 else ""))

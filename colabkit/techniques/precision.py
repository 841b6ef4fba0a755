"""Mixed precision: ``fp16`` (autocast fp16 + GradScaler) and ``bf16`` (autocast bf16), fp32 master weights.

Autocast runs matmuls in 16 bits and keeps reductions (softmax, norms, the loss) in fp32; the weights
and the optimizer stay fp32, so what shrinks is what the forward saves for backward (activations),
not the parameters. fp16 has 5 exponent bits: small gradients underflow, so the loss is scaled up
before backward and the scale backed off whenever a gradient overflows (``fp16`` sets
``ctx.loss_scaling``, which enables the ``Trainer``'s ``torch.amp.GradScaler``; its state is in
``Trainer.state_dict``). ``lora``/``qlora`` set it too where they compute in fp16 (a GPU without bf16).
bf16 has fp32's range and needs no scaler, but only Ampere+ GPUs (sm80) have bf16 units: on a T4 it
is refused, with ``fp16`` as the answer.

On the CPU both run (torch's CPU autocast supports fp16 and bf16; ``GradScaler("cpu")`` works): they
measure memory and numerics, not T4 speed — CPU fp16/bf16 matmuls are usually slower than fp32.

>>> from colabkit.plan import Plan
>>> Plan.parse("fp16").get("fp16"), Plan.parse("bf16").get("bf16")
(True, True)
"""
from __future__ import annotations

import contextlib

import torch

from ..env import emulating_t4, native_bf16
from ..plan import Context, Plan, PlanError, Technique, register

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(precision: str, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``fp16``/``bf16`` on ``device``; ``fp32`` gives a disabled autocast
    (a value, not a branch).

    >>> with autocast("bf16", "cpu"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """
    dev = torch.device(device).type
    if precision == "fp32":
        return torch.autocast(dev, enabled=False)
    return torch.autocast(dev, dtype=DTYPES[precision])


def _context(name: str):
    return lambda plan, ctx: autocast(name, ctx.device)


def _check_bf16(plan: Plan, ctx: Context) -> None:
    if emulating_t4():
        raise PlanError("bf16: T4 emulation is on and a T4 (sm75) has no native bf16 (it would be emulated, "
                        "slowly); use fp16 (autocast fp16 + GradScaler) instead")
    if ctx.cuda and not native_bf16(ctx.device):
        major, minor = torch.cuda.get_device_capability(ctx.device)
        raise PlanError(f"bf16: {torch.cuda.get_device_name(ctx.device)} (sm{major}{minor}) has no native bf16 "
                        "(needs compute capability >= 8.0, e.g. A100/L4); use fp16 (autocast fp16 + GradScaler) instead")


def _needs_scaling(model: torch.nn.Module, plan: Plan, ctx: Context) -> torch.nn.Module:
    ctx.loss_scaling = True  # the Trainer's GradScaler is enabled by this value
    return model


register(Technique(
    name="fp16",
    help="autocast fp16 + GradScaler, fp32 master weights: about half the activation memory "
         "(on the CPU it runs, for memory and numerics, not speed)",
    group="precision",
    forward_context=_context("fp16"),
    prepare_model=_needs_scaling,
    order=20,
))
register(Technique(
    name="bf16",
    help="autocast bf16, fp32 master weights, no loss scaling; refused on GPUs without native bf16 "
         "(T4: use fp16)",
    group="precision",
    check=_check_bf16,
    forward_context=_context("bf16"),
    order=20,
))

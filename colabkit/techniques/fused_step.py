"""``fused-step``: the optimizer step runs inside backward, one parameter at a time, as soon as that
parameter's gradient is complete (``register_post_accumulate_grad_hook``); the gradient is freed
right after. Full gradients never coexist: the gradient memory falls from the size of the model to
about its largest tensor.

It needs the whole gradient of a parameter to be final when its hook fires, so it refuses
``accum:K`` (gradients must add up over micro-batches first), global-norm clipping (needs every
gradient before any step) and ``fp16`` (the GradScaler must see every gradient for infs before any
step; stepping on an overflowed gradient would silently corrupt the weights).

>>> from colabkit.plan import Plan, Context, PlanError
>>> try:
...     Plan.parse("fused-step").check(Context(device=torch.device("cpu"), max_grad_norm=1.0))
... except PlanError as e:
...     print(str(e)[:47])
'fused-step' cannot clip by the global gradient
"""
from __future__ import annotations

from typing import Any

import torch

from ..plan import Context, Plan, PlanError, Technique, register
from ._wrapper import WrappedOptimizer


class FusedStepOptimizer(WrappedOptimizer):
    """Wraps an optimizer so that its step runs per parameter inside backward.

    Each hook calls the wrapped optimizer's ``step()`` while only that parameter has a ``.grad``
    (every other gradient was freed or not made yet); torch and bitsandbytes optimizers skip
    parameters without a gradient, so the update equals the plain step, and the state_dict is the
    wrapped optimizer's own (checkpoints are interchangeable with a plain run). ``step()`` and
    ``zero_grad()`` are then no-ops, so an ordinary training loop runs unchanged.

    >>> m = torch.nn.Linear(4, 2)
    >>> opt = FusedStepOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
    >>> m(torch.ones(1, 4)).sum().backward()   # the step happened in here
    >>> m.weight.grad is None, opt.steps_in_backward
    (True, 2)
    """

    def __init__(self, optimizer: Any, model: torch.nn.Module):
        self.optimizer = optimizer
        self.steps_in_backward = 0
        self.enabled = True
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        self.optimizer.step()  # only p has a grad now: the others were stepped and freed, or wait
        p.grad = None
        self.steps_in_backward += 1

    def remove(self) -> None:
        """Detach the hooks (the model then needs an ordinary optimizer step again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # the optimizer interface the Trainer, schedulers and MemoryTracker use
    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)



def _check(plan: Plan, ctx: Context) -> None:
    if plan.get("accum", 1) > 1:
        raise PlanError("'fused-step' steps each parameter when its gradient is complete, but accum:K needs "
                        "gradients summed over K micro-batches first: drop accum, or drop fused-step and use a "
                        "smaller batch with accum")
    if ctx.max_grad_norm is not None:
        raise PlanError("'fused-step' cannot clip by the global gradient norm: the norm needs every gradient "
                        "before any step. Train without max_grad_norm, or drop fused-step")
    if "fp16" in plan:
        raise PlanError("'fused-step' with 'fp16': the GradScaler must check every gradient for inf/NaN before "
                        "any parameter steps, and fused-step has already stepped them. Drop fp16 (fp32 "
                        "weights), or drop fused-step")


register(Technique(
    name="fused-step",
    help="optimizer step inside backward, per parameter: gradients never all exist at once",
    check=_check,
    wrap_optimizer=lambda opt, model, plan, ctx: FusedStepOptimizer(opt, model),
    order=70,
))
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

from collections import OrderedDict
from typing import Any

import torch

from ..plan import Context, Plan, PlanError, Technique, register
from ._wrapper import WrappedOptimizer, weak_grad_hooks
from .optimizers import BNB_SYNC_PER_PARAM


class FusedStepOptimizer(WrappedOptimizer, torch.optim.Optimizer):
    """Wraps an optimizer so that its step runs per parameter inside backward.

    Each parameter's hook runs the wrapped optimizer's ``step()`` on that parameter alone: for the
    duration of the call the optimizer sees one group holding only it (O(1) Python work per parameter,
    O(N) per backward). The update equals the plain step: torch, bitsandbytes and colabkit optimizers
    update each parameter from its own gradient, state and group hyperparameters. ``step()`` and
    ``zero_grad()`` are then no-ops, so an ordinary training loop runs unchanged.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``state_dict`` are the
    wrapped optimizer's own (not copies): LR schedulers (``LambdaLR``, transformers'
    ``get_linear_schedule_with_warmup``) and Hugging Face's Trainer change the lr the hooks use, and a
    checkpoint is interchangeable with a plain run's. A parameter whose gradient arrives twice before
    ``step()``/``zero_grad()`` (gradient accumulation) is refused: it was already updated from a partial
    gradient.

    >>> m = torch.nn.Linear(4, 2)
    >>> opt = FusedStepOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    >>> m(torch.ones(1, 4)).sum().backward()   # the step happened in here, at lr 0.1
    >>> opt.step(); sched.step(); opt.param_groups[0]["lr"]
    0.05
    >>> m.weight.grad is None, opt.steps_in_backward
    (True, 2)
    """

    def __init__(self, optimizer: Any, model: torch.nn.Module | None = None):
        # Not Optimizer.__init__: it would copy the groups into new dicts that the hooks never read.
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self.optimizer = optimizer
        self.steps_in_backward = 0
        self.enabled = True
        self._stepped: set[int] = set()  # ids of parameters updated since the last step()/zero_grad()
        self._group_of: dict[int, int] = {}  # id(param) -> index of its group
        self._handles: list = []
        for i, g in enumerate(optimizer.param_groups):
            self._hook_params(g["params"], i)

    def _hook_params(self, params: list[torch.Tensor], group: int) -> None:
        for p in params:
            self._group_of[id(p)] = group
        weak_grad_hooks(self, "_hook", params, self._handles)  # a bound method would leak the model (see there)

    def _narrow(self) -> bool:
        """Whether the optimizer may be shown one parameter at a time. bitsandbytes initialises on its first
        step (scanning every group for overrides) and looks overrides up by (group, index): those steps
        see the full groups; torch optimizers iterate ``param_groups`` and key their state by parameter."""
        opt = self.optimizer
        if getattr(opt, "initialized", True) is False:
            return False
        mng = getattr(opt, "mng", None)
        return not getattr(mng, "index2config", None)

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        if id(p) in self._stepped:
            raise RuntimeError("fused-step: a second gradient reached a parameter it already updated in this step "
                               "(gradient accumulation, or a parameter used in two backward passes). fused-step "
                               "applies each gradient inside backward, so gradients cannot accumulate: call "
                               "optimizer.step() after every backward, or drop fused-step")
        opt = self.optimizer
        if not self._narrow():
            opt.step()  # only p has a gradient now: the others were stepped and freed, or wait
        else:
            groups = opt.param_groups
            group = groups[self._group_of[id(p)]]
            params = group["params"]
            group["params"] = [p]
            opt.param_groups = [group]  # the same dict: hyperparameters (lr) as the scheduler set them
            try:
                opt.step()
            finally:
                group["params"] = params
                opt.param_groups = groups
        p.grad = None
        self._stepped.add(id(p))
        self.steps_in_backward += 1

    def remove(self) -> None:
        """Detach the hooks (the model then needs an ordinary optimizer step again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)
        self._hook_params(self.optimizer.param_groups[-1]["params"], len(self.optimizer.param_groups) - 1)

    # the optimizer interface the Trainer, schedulers and MemoryTracker use
    def step(self, closure=None):
        self._stepped.clear()
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stepped.clear()
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _check(plan: Plan, ctx: Context) -> None:
    if plan.get("accum", 1) > 1:
        raise PlanError("'fused-step' steps each parameter when its gradient is complete, but accum:K needs "
                        "gradients summed over K micro-batches first: drop accum, or drop fused-step and use a "
                        "smaller batch with accum")
    if ctx.max_grad_norm is not None:
        raise PlanError("'fused-step' cannot clip by the global gradient norm: the norm needs every gradient "
                        "before any step. Train without max_grad_norm, or drop fused-step")
    if ctx.cuda and plan.optimizer in BNB_SYNC_PER_PARAM:
        raise PlanError(f"'fused-step' with {plan.optimizer_token!r} on a GPU: bitsandbytes synchronizes the device after "
                        "every parameter it steps (Optimizer8bit.step), so inside backward that is a full GPU stall per "
                        "tensor: use adamw8bit (colabkit's own 8-bit kernel under fused-step) or adamw4bit, or drop fused-step")
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
"""ZeRO sharding across processes on torch.distributed's own engines (plan tokens ``zero:1|2|3``).

* ``zero:1`` — optimizer state sharded: DDP all-reduces full gradients (as buckets the gradients are
  views of), :class:`torch.distributed.optim.ZeroRedundancyOptimizer` keeps each rank's 1/N of the
  optimizer state, steps it, and broadcasts the updated parameters.
* ``zero:2`` — FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients and optimizer state
  sharded (reduce-scatter); parameters all-gathered once per block in forward and kept through
  backward (no second all-gather), sharded again between steps.
* ``zero:3`` — FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters resharded after each
  block's forward and gathered again in backward. With ``offload:params`` / ``offload:optimizer``
  on a GPU, FSDP2's ``CPUOffloadPolicy`` keeps the shards (and so the optimizer step) in host RAM.

The process group is started by :func:`colabkit.distributed.launch` (gloo on CPU, nccl on GPUs);
each rank's Trainer sees its 1/N slice of the effective batch, so the gradient averaged over ranks
is the single-process gradient.

>>> from colabkit.plan import Plan, Context, PlanError
>>> try:
...     Plan.parse("zero:3").check(Context(device=torch.device("cpu")))
... except PlanError as e:
...     print(str(e)[:60])
'zero:3' needs one process per rank: run it through colabkit
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..memory import tensors_in
from ..models import blocks_of
from ..plan import Context, Plan, PlanError, Technique, register

STAGES = (1, 2, 3)
TORCH_OPTIMIZERS = ("adamw", "sgd")  # optimizers whose torch implementation steps DTensor shards


def _parse(arg: str | None) -> int:
    if arg is None or not arg.isdigit() or int(arg) not in STAGES:
        raise PlanError("use zero:1 (optimizer state), zero:2 (+ gradients) or zero:3 (+ parameters)")
    return int(arg)


def world_size() -> int:
    """Ranks in the running process group (1 when none is started)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check(plan: Plan, ctx: Context) -> None:
    stage = plan.get("zero")
    tok = f"zero:{stage}"
    if plan.optimizer not in TORCH_OPTIMIZERS:
        raise PlanError(f"{tok!r} with {plan.optimizer!r}: the sharded engines step torch optimizers on "
                        f"parameter shards; use {' or '.join(TORCH_OPTIMIZERS)}")
    for other, why in (("fused-step", "steps each parameter inside backward, before its gradient is "
                                      "reduced across ranks"),
                       ("qlora", "4-bit bitsandbytes weights cannot be sharded by FSDP2 / DDP here"),
                       ):
        if other in plan:
            raise PlanError(f"{tok!r} with {other!r}: {why}; drop one of them")
    if "fp16" in plan and stage > 1:
        raise PlanError(f"{tok!r} with 'fp16': GradScaler's inf check would see only this rank's gradient "
                        "shard and ranks could disagree on skipping a step; use bf16 (GPUs with native bf16), "
                        "zero:1, or fp32")
    offload = set(plan.get("offload", ()))
    if offload and (stage != 3 or offload - {"params", "optimizer"}):
        raise PlanError(f"{tok!r} with {'+'.join('offload:' + k for k in sorted(offload))}: only zero:3 with "
                        "offload:params / offload:optimizer is supported (FSDP2's CPUOffloadPolicy); "
                        "drop the other offload tokens or use zero:3")
    if world_size() < 2:
        raise PlanError(f"{tok!r} needs one process per rank: run it through colabkit.distributed.launch / "
                        "bench_sharded, or `python -m colabkit bench --world-size 2`")


def _mesh(ctx: Context):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (world_size(),))


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    stage = plan.get("zero")
    if stage == 1:
        ids = [ctx.device.index] if ctx.cuda and ctx.device.index is not None else None
        for p in model.parameters():  # DDP turns existing .grad into views of its buckets: the buckets
            if p.requires_grad and p.grad is None:  # are then gradients from the start (tracker, estimator)
                p.grad = torch.zeros_like(p)
        # gradients are views of DDP's all-reduce buckets: one copy of them, as in single-process
        # (plus, transiently, the one fresh gradient autograd hands over before it is copied in)
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=ctx.cuda) if plan.get("offload") else OffloadPolicy()
    mesh, reshard = _mesh(ctx), stage == 3
    for block in blocks_of(model):  # one all-gather / reduce-scatter unit per transformer block
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    return model


@functools.cache
def sharded_optimizer_class() -> type:
    """ZeroRedundancyOptimizer that shows the tracker the state of its own shard (``state_tensors``).
    Made on first use: importing ``torch.distributed.optim`` costs ~0.7 s, every ``import colabkit`` would pay it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ShardedOptimizer(ZeroRedundancyOptimizer):
        def state_tensors(self) -> Iterator[torch.Tensor]:
            yield from tensors_in(dict(self.optim.state))

    return ShardedOptimizer


def _wrap(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> Any:
    if plan.get("zero") != 1:
        return optimizer  # FSDP2: the plain optimizer on DTensor shards is already sharded
    # the plan's optimizer was built lazily (no state yet): rebuild it as ZeRO-1 with its groups
    groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay", "lr")} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold derived keys
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in ("params", "weight_decay")}
    return sharded_optimizer_class()(groups, optimizer_class=type(optimizer), **defaults)


register(Technique(
    name="zero",
    help="ZeRO sharding across processes: 1 optimizer state (ZeroRedundancyOptimizer), 2 + gradients, "
         "3 + parameters (FSDP2); launch with --world-size N",
    parse=_parse,
    group="sharding",
    examples=("zero:1", "zero:2", "zero:3"),
    check=_check,
    prepare_model=_prepare,
    wrap_optimizer=_wrap,
    order=80,
))

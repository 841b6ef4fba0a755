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

zero:2/3 never hold the whole model on one rank: the model is built on the meta device (shapes only)
with its init calls recorded (:class:`InitRecorder`), sharded by ``fully_shard``, and only then
materialised: ``to_empty`` allocates this rank's shards and the init calls are replayed one full
tensor at a time (:func:`materialize_sharded`), so every world size starts from the single-process
build's weights for the same seed, and the Trainer never moves the model before sharding
(``places_model``). With ``fp16``, FSDP2's ``MixedPrecisionPolicy(param_dtype=float16,
reduce_dtype=float32)`` gathers fp16 compute copies of fp32 master shards and reduce-scatters
gradients in fp32; torch's ``ShardedGradScaler`` unscales each rank's gradient shard and all-reduces
found-inf, so every rank skips the same steps (the T4 has no bf16: this is how a T4 shards fp16).

The process group is started by :func:`colabkit.distributed.launch` (gloo on CPU, nccl on GPUs) or
by ``torchrun`` (:func:`colabkit.distributed.run_here`);
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
from torch.overrides import TorchFunctionMode

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


# ----- zero:2/3 on a meta-built model: shard first, then give each rank its shards' weights ---------
FULL_WRITES = {"normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "kaiming_uniform_",
               "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "copy_"}
NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad", "set_"}
RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like",
                    "randn_like", "randint_like", "poisson"}


class InitRecorder(TorchFunctionMode):
    """Records, while a model is built on the meta device, every in-place write to its tensors (the
    init calls, e.g. ``nn.init.normal_(p, 0, 0.02)``) in order, so they can be replayed later on real
    tensors drawing the same random numbers a plain build draws. ``ok`` is False (with ``why``) when
    the build did something a replay cannot reproduce (a random factory such as ``torch.randn``).

    >>> from colabkit.models import build_meta
    >>> with InitRecorder() as rec:
    ...     m = build_meta("gpt:2x64")
    >>> rec.ok, [getattr(f, "__name__", "") for _, f, _, _ in rec.ops[:2]]
    (True, ['normal_', 'normal_'])
    """

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[torch.Tensor, Any, tuple, dict]] = []  # (meta target, func, other args, kwargs)
        self.alias: dict[int, torch.Tensor] = {}  # id(p.data) -> p
        self.keep: list[torch.Tensor] = []
        self.why: str | None = None

    @property
    def ok(self) -> bool:
        return self.why is None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        first = args[0] if args else kwargs.get("tensor")  # nn.init.* pass the tensor by keyword
        target = first if isinstance(first, torch.Tensor) and first.is_meta else None
        if name in RANDOM_FACTORIES and isinstance(out, torch.Tensor) and out.is_meta:
            self.why = f"the model's build calls torch.{name} (a random factory a replay cannot redo)"
        elif target is None:
            pass
        elif func is torch.Tensor.data.__get__:  # HF inits write through p.data
            self.alias[id(out)] = self.alias.get(id(target), target)
            self.keep.append(out)
        elif (name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES) or name == "__setitem__":
            kw = {k: v for k, v in kwargs.items() if k != "tensor"}
            self.ops.append((self.alias.get(id(target), target), func, tuple(args[1:]), kw))
        return out


def record_meta_build(name: str, seq: int | None = None) -> nn.Module | None:
    """``build_model(name)`` on the meta device with its init calls recorded (``_colabkit_init_log``), or
    None when a replay could not give the plain build's weights (then build it normally)."""
    from ..models import build_meta

    if name.startswith("hf:"):  # from_pretrained loads weights, no init to replay
        return None
    with InitRecorder() as rec:
        model = build_meta(name, seq=seq)
    full = {id(t) for t, f, _, _ in rec.ops if getattr(f, "__name__", "") in FULL_WRITES}
    params = dict(model.named_parameters())
    unwritten = [n for n, p in params.items() if id(p) not in full]
    if not rec.ok or unwritten or any(True for _ in model.buffers()):
        return None  # a buffer's value comes from a factory (no op to replay)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    # (parameter name or None for a tensor that is not one, shape, dtype, func, args, kwargs)
    model._colabkit_init_log = [(names.get(id(t)), t.shape, t.dtype, f, a, kw) for t, f, a, kw in rec.ops]
    return model


@torch.no_grad()
def materialize_sharded(model: nn.Module, log: list, device: torch.device) -> nn.Module:
    """Give an FSDP2-sharded meta model real weights: ``to_empty`` allocates only this rank's shards,
    then the recorded init calls are replayed in order, each on one full-size temporary tensor on
    ``device`` (same shapes, same random draws as a plain build), and this rank's rows are copied into
    its shard. Calls overwritten later only draw their random numbers; at most one parameter exists in
    full at a time. Every world size gets the weights of the single-process build with the same seed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    real = dict(model.named_parameters(remove_duplicate=False))
    last_full, last = {}, {}
    for i, (name, _, _, f, _, _) in enumerate(log):
        last[name] = i
        if getattr(f, "__name__", "") in FULL_WRITES:
            last_full[name] = i
    live: dict[str, torch.Tensor] = {}
    for i, (name, shape, dtype, f, args, kwargs) in enumerate(log):
        if i < last_full.get(name, -1) or name is None:  # overwritten later: only its random draws matter
            f(torch.empty(shape, dtype=dtype, device=device), *args, **kwargs)
            continue
        full = live.setdefault(name, torch.empty(shape, dtype=dtype, device=device))
        f(full, *args, **kwargs)
        if i == last[name]:
            p = real[name]
            del live[name]
            if isinstance(p, DTensor):
                local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                rows = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
                p.to_local().copy_(full[rows])
            else:
                p.copy_(full)
    written = {id(real[n]) for n in last if n is not None}  # tied weights: one object, several names
    unset = [n for n, p in real.items() if id(p) not in written]
    if unset:  # an empty shard would train from garbage: refuse
        raise RuntimeError(f"materialize_sharded: no recorded init for {unset[:3]}; build the model normally")
    return model


META_SAFE = ("zero", "fp16", "checkpoint", "attention")  # their prepare_model adds no weights


def _load(name: str, plan: Plan, ctx: Context, seq: int | None) -> nn.Module | None:
    """zero:2/3: the model is built on the meta device (no memory) and sharded before it gets weights."""
    if plan.get("zero") == 1:
        return None
    others = [t.name for t in plan.techniques() if t.prepare_model is not None and t.name not in META_SAFE]
    model = None if others else record_meta_build(name, seq)  # e.g. lora adds weights the log does not init
    if model is None:  # not replayable: built in host RAM; fully_shard moves it to the GPU block by block
        from ..models import build_model

        model = build_model(name, seq=seq, device="cpu")
    return model


def _places(plan: Plan) -> bool:
    return plan.get("zero", 1) > 1  # FSDP2 puts each block's shards on the device itself


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
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=ctx.cuda) if plan.get("offload") else OffloadPolicy()
    # fp16: blocks compute on fp16 copies of the gathered parameters, gradients are reduce-scattered in
    # fp32 onto fp32 master shards; the loss scaler unscales the local shards and agrees on found-inf
    # (bf16 likewise, without a scaler: blocks get bf16 parameters, so autocast has no fp32 weight to cast
    # and cache -- its cache would otherwise hold a bf16 copy of every gathered weight until forward ends)
    half = torch.float16 if "fp16" in plan else torch.bfloat16 if "bf16" in plan else None
    precision = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half is not None \
        else MixedPrecisionPolicy()
    if "fp16" in plan:
        ctx.make_scaler = sharded_scaler
    mesh, reshard = _mesh(ctx), stage == 3
    kw = dict(mesh=mesh, reshard_after_forward=reshard, offload_policy=offload, mp_policy=precision)
    for block in blocks_of(model):  # one all-gather / reduce-scatter unit per transformer block
        fully_shard(block, **kw)
    # the root unit (embeddings, head) too: given explicitly, reshard_after_forward=True frees its gathered copy after
    # forward (left to its default, FSDP2 would keep it through the loss's backward, where a large vocabulary's
    # logits peak), and its pre-backward gathers it again at the logits' gradient (estimate.zero.fsdp_backward)
    fully_shard(model, **kw)
    log = getattr(model, "_colabkit_init_log", None)
    if log is not None:
        del model._colabkit_init_log
        materialize_sharded(model, log, torch.device("cpu") if plan.get("offload") else ctx.device)
    return model


def sharded_scaler(device_type: str, enabled: bool) -> Any:
    """The loss scaler of zero:2/3 + fp16: torch's ShardedGradScaler (unscales each rank's gradient
    shards and all-reduces found-inf, so every rank skips the same steps)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type, enabled=enabled)


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
    load_model=_load,
    places_model=_places,
    order=80,
))

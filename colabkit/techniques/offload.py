"""CPU offload: keep a kind of training state in host RAM and move it to the GPU only around its use.

* ``offload:optimizer`` — optimizer state and fp32 master weights live in (pinned) host RAM; each
  gradient is copied to the host inside backward as soon as it is complete (a side stream overlaps
  the copy with the rest of backward), the update runs on the CPU, new weights are copied back.
* ``offload:activations`` — tensors saved for backward go to pinned host blocks during forward and
  come back for backward (``torch.autograd.graph.save_on_cpu``'s pack/unpack, but asynchronous: the
  copies run on a side stream, each copy back waits only for its own event).
* ``offload:params`` — layer streaming: block parameters live in host RAM; a block's weights are
  copied in just before it runs (the next block's copy prefetched on a side stream), in forward
  and again in backward, where the block is recomputed (RNG state replayed, as in
  ``torch.utils.checkpoint``); its gradients go to pinned host buffers on the side stream, waited
  for once at the end of backward.
* :func:`offloaded` — phase-aware offload for evaluation / generation: optimizer state (and any
  gradients) leave the GPU for the block and come back before the next step.

Every move goes through a :class:`~colabkit.device.DevicePair` (compute side, host side), the only code that calls CUDA:
pinned memory, a side stream, events, ``record_stream`` and non-blocking copies. On a CPU run the
tokens are refused (there is nothing to offload to) unless offload is **simulated**
(``offload_sim=True``, ``--offload-sim``): both sides are then the CPU and the pair runs the same
statements against :class:`~colabkit.device.CudaTwin`, a CPU model of CUDA's ordering rules (a copy on the side stream
lands only once it is waited for; until then, or if its source was freed without ``record_stream``,
its destination holds NaN), so every other line — copies, prefetch, recompute, master weights — is
the code a GPU runs, and a missing wait fails in CI. Host-side storages are tagged, so the tracker
reports them apart (``host_bytes``, ``host_breakdown``). One host-RAM guard (:func:`guard_plan`)
refuses a plan whose weights, gradients and optimizer state would not fit in host RAM (pinned blocks
rounded up as CUDA does) before anything moves — a Colab VM is killed, not warned, when it runs out.

>>> from colabkit.plan import Plan, Context, PlanError
>>> try:
...     Plan.parse("offload:optimizer").check(Context(device=torch.device("cpu")))
... except PlanError as e:
...     print(str(e)[:55])
'offload:optimizer' on a CPU run: there is nothing to o
>>> Plan.parse("offload:optimizer").check(Context(device=torch.device("cpu"), offload_sim=True))

Each topic has its module: :mod:`.offload_optimizer` (``HostOptimizer``, :func:`offloaded`),
:mod:`.offload_activations`, :mod:`.offload_params` (layer streaming), :mod:`.offload_guard` (the plan's
host-RAM guard); this one registers the token. The seam's names (``DevicePair``, ``CudaTwin``,
``pinned_bytes``, ``host_ram_guard``, ...) are re-exported here for one release: import them from
:mod:`colabkit.device`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import (HOST_RESERVE, CudaRuntime, CudaTwin, DevicePair, PinnedCache, _TwinEvent,  # noqa: F401
                      _TwinStream, fmt_bytes, host_ram, host_ram_guard, host_side, mark_host, pair_of, pinned_bytes)
from ..models import blocks_of  # noqa: F401  (re-exported for one release)
from ..plan import Context, Plan, PlanError, Technique, register
from .offload_activations import activation_offload  # noqa: F401
from .offload_guard import guard_plan, guard_sharded, host_footprint  # noqa: F401
from .offload_optimizer import (STRATEGIES, HostOptimizer, HostStateOptimizer, _dq8, _host_copy,  # noqa: F401
                                _offload_optimizer, _q8, offloaded)
from .offload_params import BlockStreamer, _Streamed, _StreamedBlockFn, stream_blocks  # noqa: F401

KINDS = ("optimizer", "activations", "params")
PREFETCH = True  # offload:params copies the next block on a side stream; set False to measure without


# ----- the plan token --------------------------------------------------------------------------
def _parse(arg: str | None) -> str:
    if arg not in KINDS:
        raise PlanError(f"offload needs what to offload: {', '.join('offload:' + k for k in KINDS)}")
    return arg


def _check(plan: Plan, ctx: Context) -> None:
    kinds = sorted(plan.get("offload", ()))
    if kinds and not ctx.cuda and "zero" in plan:
        if plan.get("zero") != 3 or set(kinds) - {"params", "optimizer"}:
            return  # a pair zero's own check refuses, with its reason (only zero:3 offloads, through FSDP2)
        raise PlanError("'zero:3' with offload on a CPU run: the ranks offload through FSDP2's CPUOffloadPolicy, "
                        "which keeps the shards in CPU memory -- the device itself here, so there is nothing to "
                        "offload or to simulate. Drop the offload tokens, or see `python -m colabkit estimate "
                        "--world-size N --gpu t4` for the per-rank GPU and host figures")
    if kinds and not ctx.cuda and not ctx.offload_sim:
        names = " + ".join(f"'offload:{k}'" for k in kinds)
        raise PlanError(f"{names} on a CPU run: there is nothing to offload to — the tensors already live in host "
                        "RAM. Drop the offload tokens (on a GPU they move state to host RAM), simulate them with "
                        "offload_sim=True (--offload-sim) to see the bytes move, or see "
                        "`python -m colabkit estimate --gpu t4` for what they would save there")
    if "optimizer" in kinds:
        if ctx.max_grad_norm is not None:
            raise PlanError("'offload:optimizer' moves each gradient to host RAM inside backward, so global-norm "
                            "clipping on the GPU would see no gradients: train without max_grad_norm, or drop offload:optimizer")
        if "fused-step" in plan:
            raise PlanError("'offload:optimizer' and 'fused-step' both take the gradient inside backward: keep one "
                            "(offload:optimizer already frees each gradient on the GPU as it arrives)")
    if "activations" in kinds and "compress" in plan:
        raise PlanError("'offload:activations' and 'compress:int8' both rewrite the tensors saved for backward and "
                        "would not compose (the inner one wins): keep one")
    if "params" in kinds and "zero" not in plan:  # the block streamer's rules (zero:3: FSDP2 moves the shards)
        if "checkpoint" in plan:
            raise PlanError("'offload:params' already recomputes each block in backward (its weights are fetched "
                            "again): drop 'checkpoint'")
        if "fused-step" in plan:
            raise PlanError("'offload:params' and 'fused-step' conflict: the streamed blocks' gradients land on the "
                            "host after the block is recomputed, outside fused-step's per-parameter hooks, so their "
                            "parameters would be stepped twice: drop 'fused-step' (offload:params keeps no block "
                            "gradients on the GPU anyway)")
    if "params" in kinds:
        if "lora" in plan or "qlora" in plan:
            tok = next(t for t in plan.tokens if t.startswith(("lora", "qlora")))
            raise PlanError(f"'offload:params' with {tok!r} is not supported: offload:params is made for full "
                            "training (each block's weights streamed to the GPU, its gradients and step on the host); "
                            "with adapters the gradients are the adapters' own, and the large part is the frozen base, "
                            "which qlora keeps in 4 bits instead: drop one (for a base too big for the GPU, qlora)")


def local_ranks() -> int:
    """Processes of the run on this machine (they share its host RAM): torchrun's LOCAL_WORLD_SIZE, else
    every rank of the process group (colabkit.launch starts them all here)."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    kinds = set(plan.get("offload", ())) - {"activations"}  # activations: guarded as the pinned cache grows
    if kinds and "zero" in plan:  # zero:3: FSDP2's CPUOffloadPolicy moves the shards; every rank's count here
        guard_sharded(model, local_ranks(), plan.optimizer_token, pinned=ctx.cuda)
    if kinds and "zero" not in plan:
        # the one guard, before anything moves: weights, gradients and optimizer state, pinned rounding
        guard_plan(model, kinds, plan.optimizer_token)
        if "params" in kinds:
            return stream_blocks(model, ctx.device, prefetch=PREFETCH, guard=False)
    return model


def _forward_context(plan: Plan, ctx: Context):
    if "activations" not in plan.get("offload", ()):
        return contextlib.nullcontext()
    return activation_offload(pair_of(ctx.model, ctx.device) if ctx.model is not None else DevicePair(ctx.device))


def _wrap(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> Any:
    if "optimizer" in plan.get("offload", ()) and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy
        return _offload_optimizer(optimizer, model, plan, ctx)
    if "params" in plan.get("offload", ()):
        return HostStateOptimizer(optimizer)
    return optimizer


register(Technique(
    name="offload",
    help="keep optimizer state / saved activations / block parameters in host RAM (CUDA; simulated on a CPU with offload_sim)",
    parse=_parse,
    multi=True,
    examples=tuple(f"offload:{k}" for k in KINDS),
    check=_check,
    prepare_model=_prepare,
    forward_context=_forward_context,
    wrap_optimizer=_wrap,
    order=45,
))

"""Host RAM an offload plan takes (weights, gradients, optimizer state, pinned rounding), checked before anything moves."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from ..device import fmt_bytes, host_ram_guard, pinned_bytes
from ..models import blocks_of
from .optimizers import state_bytes_per_param


def host_footprint(model: nn.Module, kinds: Iterable[str], optimizer: str | float = "adamw") -> dict[str, int]:
    """Host RAM that offloading ``kinds`` of ``model`` takes, by category, every pinned block rounded up
    by :func:`pinned_bytes` (on CUDA, and in the twin that models it):

    * ``params``: block parameters and buffers kept host side (``offload:params``, pinned), and the fp32
      master copy of every other trainable parameter (``offload:optimizer``, pinned);
    * ``grads``: a pinned gradient buffer per trainable parameter of either kind (streamed gradients
      land in a new one each step; ``offload:optimizer`` keeps one);
    * ``optimizer``: the optimizer's state for all of them (pageable: ``HostStateOptimizer`` /
      ``HostOptimizer`` step on the host): ``optimizer`` is a token (its formula per shape,
      :func:`~colabkit.techniques.optimizers.state_bytes_per_param`) or bytes per parameter;
    * ``step``: the temporaries of that step on the host: none for ``adamw`` (torch's fused kernel, which
      the token uses on CPU tensors too, updates in place), else twice the largest such parameter (torch's
      single-tensor AdamW holds about two parameter-sized temporaries at a time: measured 2.25x under the
      tracker, CPU, 2026-11-23; a bound for the others).

    ``offload:activations`` depends on the batch: its pinned cache is guarded as it grows.

    >>> from colabkit.models import build_model
    >>> f = host_footprint(build_model("gpt:2x32"), ["params"], "adamw")
    >>> f["params"] >= 4 * sum(p.numel() for p in build_model("gpt:2x32").blocks.parameters()), f["optimizer"] > 0
    (True, True)
    """
    kinds = set(kinds)
    out = dict.fromkeys(("params", "grads", "optimizer", "step"), 0)
    biggest = 0

    def state(p: torch.Tensor) -> int:
        if not isinstance(optimizer, str):
            return int(p.numel() * optimizer)
        try:
            return int(p.numel() * state_bytes_per_param(optimizer, tuple(p.shape)))
        except ValueError:  # shape-dependent state the formula cannot give (galore): AdamW's as the bound
            return 8 * p.numel()

    streamed: set[int] = set()
    if "params" in kinds:
        blocks = blocks_of(model)
        for t in list(blocks.parameters()) + list(blocks.buffers()):
            streamed.add(id(t))
            out["params"] += pinned_bytes(t.numel() * t.element_size())
        for p in blocks.parameters():
            if p.requires_grad:
                out["grads"] += pinned_bytes(p.numel() * p.element_size())
                out["optimizer"] += state(p)
                biggest = max(biggest, p.numel() * p.element_size())
    if "optimizer" in kinds:
        for p in model.parameters():
            if p.requires_grad and id(p) not in streamed:
                out["params"] += pinned_bytes(p.numel() * p.element_size())
                out["grads"] += pinned_bytes(p.numel() * p.element_size())
                out["optimizer"] += state(p)
                biggest = max(biggest, p.numel() * p.element_size())
    fused = optimizer == "adamw" and "cpu" in _get_fused_kernels_supported_devices()
    out["step"] = 0 if fused else 2 * biggest
    return out


def guard_plan(model: nn.Module, kinds: Iterable[str], optimizer: str | float = "adamw",
               available: int | None = None) -> dict[str, int]:
    """The one host-RAM guard of an offload plan: :func:`host_footprint` against the RAM available,
    before anything moves. Returns the footprint; raises PlanError naming it when it does not fit."""
    kinds = set(kinds)
    f = host_footprint(model, kinds, optimizer)
    names = {"params": " and ".join(n for k, n in (("params", "block parameters"), ("optimizer", "fp32 master weights"))
                                    if k in kinds),
             "grads": "gradient buffers", "optimizer": "optimizer state", "step": "step temporaries"}
    parts = ", ".join(f"{names[k]} {fmt_bytes(v)}" for k, v in f.items() if v)
    host_ram_guard(sum(f.values()), f"{' + '.join('offload:' + k for k in sorted(kinds))} ({parts}; pinned "
                   "blocks rounded up to a power of two)", available=available)
    return f


def sharded_host_footprint(model: nn.Module, ranks: int, optimizer: str | float = "adamw",
                           pinned: bool = True) -> dict[str, int]:
    """Host RAM that ``ranks`` processes of ``zero:3`` with offload take on one machine, by category.
    Each rank builds the whole model in host RAM before ``fully_shard`` (``model``: fp32, unpinned),
    then FSDP2's ``CPUOffloadPolicy`` keeps its shard (dim 0 split in ``ranks``, padded) of every
    parameter and gradient (pinned on CUDA, each block rounded up) and of the optimizer state in host RAM.

    >>> from colabkit.models import build_model
    >>> one, two = (sum(sharded_host_footprint(build_model("gpt:2x32"), n).values()) for n in (1, 2))
    >>> 1.1 < two / one < 1.5    # the shards of two ranks add up to one copy; each rank builds the whole model
    True
    """
    out = dict.fromkeys(("model", "params", "grads", "optimizer"), 0)
    rounded = pinned_bytes if pinned else (lambda n: n)
    for p in model.parameters():
        out["model"] += p.numel() * p.element_size()
        rows = p.shape[0] if p.dim() else 1
        shard = -(-rows // ranks) * (p.numel() // max(rows, 1))  # FSDP2 pads dim 0 to a multiple of ranks
        out["params"] += rounded(shard * p.element_size())
        if p.requires_grad:
            out["grads"] += rounded(shard * p.element_size())
            full = host_footprint(_One(p), ["optimizer"], optimizer)["optimizer"]
            out["optimizer"] += -(-full // ranks)
    return {k: v * ranks for k, v in out.items()}


class _One(nn.Module):
    """One parameter as a module (host_footprint's formula per parameter)."""

    def __init__(self, p: torch.Tensor):
        super().__init__()
        self.p = nn.Parameter(p.detach(), requires_grad=True)


def guard_sharded(model: nn.Module, ranks: int, optimizer: str | float = "adamw", pinned: bool = True,
                  available: int | None = None) -> dict[str, int]:
    """The host-RAM guard of ``zero:3`` with offload: :func:`sharded_host_footprint` of all ``ranks`` on this
    machine against the RAM available, before FSDP2 moves anything; raises PlanError naming it."""
    f = sharded_host_footprint(model, ranks, optimizer, pinned)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in f.items() if v)
    host_ram_guard(sum(f.values()), f"zero:3 shards to host RAM on {ranks} ranks of this machine ({parts}; each "
                   "rank builds the full model first)", available=available)
    return f

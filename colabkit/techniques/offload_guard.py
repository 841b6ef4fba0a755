"""The host RAM an offload plan takes (weights, gradients, optimizer state, pinned blocks rounded up), checked before anything moves."""
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

"""Every collective colabkit issues goes through :func:`collective`, on the rank's compute device.

NCCL moves CUDA tensors only: an ``all_reduce`` of a CPU tensor after ``init_process_group("nccl")``
fails on Kaggle's 2xT4, while gloo (CI's CPU ranks) accepts any CPU tensor and hides the bug.
:func:`rank_tensor` makes a tensor on :func:`compute_device` (``cuda:<local rank>`` on nccl, the CPU on
gloo) and :func:`collective` runs ``all_reduce`` / ``broadcast`` / ``all_gather`` / ``barrier`` on it.

Strict mode (``COLABKIT_STRICT_COLLECTIVES=1``, what the tests run) applies NCCL's rule on gloo too:
:func:`collective` refuses a tensor that is not on the compute device, and on CPU ranks -- where
every tensor is "on the CPU" -- the compute device is modelled by a tag that only :func:`rank_tensor`
(or :func:`to_compute`) gives; :func:`install_strict` makes a ``torch.distributed`` collective called
directly from a colabkit module fail, so no call site can bypass the rule.

>>> compute_device("gloo", 1), compute_device("nccl", 1)
(device(type='cpu'), device(type='cuda', index=1))
>>> try:
...     check_tensor(torch.zeros(1), torch.device("cuda", 0), strict=True)
... except RuntimeError as e:
...     print(str(e)[:44])
collective on a tensor on cpu, not on cuda:0
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

STRICT_ENV = "COLABKIT_STRICT_COLLECTIVES"
_TAG = "_colabkit_compute"  # set on tensors made for collectives by rank_tensor / to_compute
OPS = ("all_reduce", "broadcast", "all_gather", "barrier")


def strict() -> bool:
    """Whether NCCL's device rule is enforced on every backend (tests set ``COLABKIT_STRICT_COLLECTIVES=1``)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def compute_device(backend: str | None = None, local_rank: int | None = None) -> torch.device:
    """The device this rank computes (and communicates) on: ``cuda:<local rank>`` on nccl, else the CPU."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    if backend != "nccl":
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    return torch.device("cuda", local_rank)


def rank_tensor(data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor for a collective, created on the compute device (and tagged as such).

    >>> rank_tensor([1.5]).device
    device(type='cpu')
    """
    t = torch.as_tensor(data, dtype=dtype, device=compute_device())
    setattr(t, _TAG, True)
    return t


def to_compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the compute device (a copy when it is elsewhere), tagged for :func:`collective`."""
    t = t.to(compute_device())
    setattr(t, _TAG, True)
    return t


def check_tensor(t: torch.Tensor, device: torch.device, strict: bool) -> None:
    """NCCL's rule: a collective's tensor lives on the rank's compute device (strict mode: on CPU ranks,
    made by :func:`rank_tensor` / :func:`to_compute`)."""
    if t.device != device:
        raise RuntimeError(f"collective on a tensor on {t.device}, not on {device} (the rank's compute "
                           "device): NCCL takes CUDA tensors only; make it with rank_tensor() / to_compute()")
    if strict and device.type == "cpu" and not getattr(t, _TAG, False):
        raise RuntimeError("collective on a CPU tensor made ad hoc: under nccl it would be a CPU tensor and "
                           "fail; make it with colabkit.collectives.rank_tensor() / to_compute()")


def collective(op: str, tensor: torch.Tensor | None = None, *, reduce: str = "sum", src: int = 0,
               group: Any = None) -> Any:
    """Run one collective on ``tensor`` (in place, as torch.distributed does): ``all_reduce`` (``reduce``
    sum / min / max), ``broadcast`` (from ``src``), ``all_gather`` (returns the list) or ``barrier``.
    Outside strict mode a tensor elsewhere is moved to the compute device first (and the result copied
    back into it); in strict mode it is refused, as NCCL would."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(OPS)}")
    if op == "barrier":
        return dist.barrier(group=group)
    assert tensor is not None, f"{op} needs a tensor"
    dev, src_t = compute_device(), tensor
    if strict():
        check_tensor(tensor, dev, strict=True)
    elif tensor.device != dev:
        tensor = to_compute(tensor)
    if op == "all_reduce":
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, reduce.upper()), group=group)
    elif op == "broadcast":
        dist.broadcast(tensor, src=src, group=group)
    else:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return parts
    if tensor is not src_t:
        src_t.copy_(tensor)
    return src_t


def install_strict() -> None:
    """In strict mode, make ``torch.distributed``'s collectives refuse a call made directly from a
    colabkit module (not through :func:`collective`); torch's own engines (DDP, FSDP2, DCP) are not
    affected. Called by the rank entry points; idempotent."""
    if not strict() or _ORIGINALS:
        return
    for name in GUARDED:
        _ORIGINALS[name] = getattr(dist, name)
        setattr(dist, name, _guard(_ORIGINALS[name]))


def uninstall_strict() -> None:
    """Undo :func:`install_strict` (tests that install it in their own process)."""
    for name, fn in _ORIGINALS.items():
        setattr(dist, name, fn)
    _ORIGINALS.clear()


GUARDED = ("all_reduce", "broadcast", "all_gather", "barrier", "reduce", "all_gather_object",
           "broadcast_object_list", "reduce_scatter", "all_to_all")
_ORIGINALS: dict[str, Any] = {}


def _guard(fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "colabkit" and caller != __name__:
            raise RuntimeError(f"torch.distributed.{fn.__name__} called directly from {caller}: every colabkit "
                               "collective goes through colabkit.collectives.collective() (NCCL's device rule)")
        return fn(*args, **kwargs)
    return guarded

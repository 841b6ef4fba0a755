"""Activation compression ``compress:int8``: tensors that autograd saves for backward are stored as
int8 with one absmax scale per block of 64 values, and expanded back when backward needs them.

Saved fp32 activations shrink ~4x (fp16/bf16 ~2x) plus 4 bytes of scale per block; the gradient
picks up a small error (each value is off by at most half a quantisation step, absmax/254 of its
block). Parameters (and views of them), integer tensors and small tensors are left untouched: a copy
of a weight would add memory, not save it.

>>> x = torch.randn(4, 256, requires_grad=True)
>>> with int8_saved_tensors():
...     y = (x * 2).sigmoid()  # sigmoid saves its (1024-value) output for backward
>>> y.sum().backward()
>>> bool(x.grad.abs().max() < 0.6)
True
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..plan import PlanError, Technique, register

BLOCK = 64  # values per absmax scale: 4 bytes of scale per 64 bytes of int8 (6% overhead)
MIN_NUMEL = 1024  # smaller tensors are kept as they are (scales and bookkeeping would not pay)


@dataclass
class Packed:
    """An int8 copy of a float tensor: q (n_blocks, BLOCK) int8, scale (n_blocks, 1) fp32, the
    tail (< BLOCK values) as it was, and what is needed to rebuild the original."""

    q: torch.Tensor
    scale: torch.Tensor
    tail: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.tail))


def quantize(t: torch.Tensor, block: int = BLOCK) -> Packed:
    """Blockwise absmax int8 of ``t`` (any shape): 64-value blocks, the rest kept as the tail.

    >>> p = quantize(torch.ones(130))
    >>> p.q.shape, p.tail.shape
    (torch.Size([2, 64]), torch.Size([2]))"""
    flat = t.detach().reshape(-1)  # a copy only when t is not contiguous
    n_main = flat.numel() // block * block
    main = flat[:n_main].view(-1, block)  # (n_blocks, block)
    scale = main.abs().amax(dim=1, keepdim=True).float().div_(127.0).clamp_(min=1e-12)
    q = (main.float() / scale).round_().clamp_(-127, 127).to(torch.int8)
    return Packed(q, scale, flat[n_main:].clone(), t.shape, t.dtype)


def dequantize(p: Packed) -> torch.Tensor:
    """The float tensor back (contiguous, original shape and dtype)."""
    main = (p.q.float() * p.scale).to(p.dtype).reshape(-1)
    return torch.cat([main, p.tail]).view(p.shape)


def _keep_as_is(t: torch.Tensor, min_numel: int) -> bool:
    if not t.is_floating_point() or t.numel() < min_numel:
        return True
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True  # a weight (or its transpose): it stays in memory anyway
    if t.grad_fn is None and not t.requires_grad:
        # no autograd history: an input or a constant (a transformers attention mask with -inf, shared by every
        # layer; RoPE tables) that its owner keeps alive anyway -- an int8 copy would add memory, and -inf is NaN
        return True
    fn = t.grad_fn  # autocast's low-precision copy of a weight is cached: an int8 copy would add memory
    if fn is not None and type(fn).__name__.startswith("ToCopyBackward"):
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
            return True
    return False


def pack_int8(t: torch.Tensor, min_numel: int = MIN_NUMEL, block: int = BLOCK):
    """The pack hook: a :class:`Packed` int8 copy of a float activation, ``t`` itself otherwise."""
    return t if _keep_as_is(t, min_numel) else quantize(t, block)


def unpack_int8(obj):
    """The unpack hook: the float tensor back from :func:`pack_int8`'s result."""
    return dequantize(obj) if isinstance(obj, Packed) else obj


def int8_saved_tensors(min_numel: int = MIN_NUMEL, block: int = BLOCK, stats: dict | None = None):
    """Context manager: saved-for-backward float activations are stored as blockwise int8.

    Use it around the forward (and loss) of a training step; backward may run outside it. With
    ``stats`` (a dict), the bytes of the compressed tensors before and after are added to
    ``stats["orig"]`` and ``stats["packed"]``.
    """
    pack = functools.partial(pack_int8, min_numel=min_numel, block=block)
    if stats is not None:
        stats.setdefault("orig", 0)
        stats.setdefault("packed", 0)

        def pack(t, _pack=pack):  # noqa: F811  (the counting version)
            out = _pack(t)
            if isinstance(out, Packed):
                stats["orig"] += t.numel() * t.element_size()
                stats["packed"] += out.nbytes
            return out

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack_int8)


def _parse(arg: str | None) -> str:
    if arg != "int8":
        got = "no format" if arg is None else repr(arg)
        raise PlanError(f"compress supports int8 (blockwise absmax), got {got}: use compress:int8")
    return arg


def _check(plan, ctx) -> None:
    if "offload" in plan and "activations" in plan.get("offload", ()):
        raise PlanError("compress:int8 and offload:activations both take over the saved-tensor hooks and the "
                        "inner one would win silently: keep one (offload moves them to host RAM, "
                        "compress shrinks them in place)")


register(Technique(
    name="compress",
    help="store activations saved for backward as int8 with blockwise absmax scales: ~4x smaller (fp32), "
         "small gradient error",
    parse=_parse,
    check=_check,
    forward_context=lambda plan, ctx: int8_saved_tensors(),
    examples=("compress:int8",),
    order=70,
))

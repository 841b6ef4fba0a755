"""Saved-for-backward tensors to pinned host blocks during forward, back for backward (``offload:activations``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..device import DevicePair, PinnedCache


# ----- offload:activations -----------------------------------------------------------------------
class _Saved:
    """A tensor saved for backward, on its way to or in a pinned host block; the block goes back to
    the pair's cache when autograd lets go of this (after its backward ran)."""

    __slots__ = ("cache", "block", "host", "device", "event")

    def __init__(self, cache: PinnedCache, block: torch.Tensor, host: torch.Tensor, device: torch.device, event: Any):
        self.cache, self.block, self.host, self.device, self.event = cache, block, host, device, event

    def __del__(self):
        self.cache.give(self.block)


def _offloadable(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.layout == torch.strided and t.numel() > 0


@contextlib.contextmanager
def activation_offload(pair: DevicePair | None = None) -> Iterator[None]:
    """Saved-for-backward tensors go to pinned host blocks and come back for backward — the
    pack/unpack of ``torch.autograd.graph.save_on_cpu``, but asynchronous: each copy to the host is
    issued on the side stream (overlapping the rest of forward) and the copy back waits only for its
    own event. Blocks are reused from the pair's :class:`PinnedCache` (guarded, trimmed at each entry).

    >>> with activation_offload(): pass
    """
    pair = pair or DevicePair("cpu")
    cache = pair.cache
    if torch.is_grad_enabled():  # a training forward: what the last one did not need goes (not in evaluation)
        cache.trim()

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight (or its W.t()) saved
            return t                                                          # by its op: it stays where it is
        if not pair.on_compute(t):  # already in host memory (SDPA's seed and offset on CUDA): it stays too;
            return t                # CUDA refuses record_stream on it (found on an H200, 2026-11-27)
        if not _offloadable(t):  # subclasses, sparse, empty: a plain blocking copy
            return t.device, pair.to_host(t)
        nbytes = t.numel() * t.element_size()
        block = cache.take(nbytes)
        host = block[:nbytes].view(t.dtype).view(t.shape)
        with pair.side():
            pair.copy_(host, t)
        pair.lend(t)  # autograd drops t now: its memory must outlive the copy
        return _Saved(cache, block, host, t.device, pair.done())

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if isinstance(saved, tuple):
            return saved[1].to(saved[0], copy=True)
        pair.use(saved.event)  # the copy to the host has landed before the copy back reads it
        return pair.to_compute(saved.host).to(saved.device)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield

"""The tracker's hooks into torch: its dispatch mode (:class:`_Mode`), the CUDA caching allocator's counters
(:class:`CudaStats`), the wrapper of ``UntypedStorage.resize_`` that tells active trackers about storages
freed or re-allocated in place (FSDP2 does this; no aten op is dispatched), the aten ops the dispatch
mode watches for in-place resizes, and the tensors among an op's arguments.
:class:`colabkit.memory.MemoryTracker` uses them.

>>> _RESIZING, [t.shape for t in _tensors_of((torch.ones(1), [torch.zeros(2)]), None)]
([], [torch.Size([1]), torch.Size([2])])
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .device import _HOST, _HOST_SCOPE, _PLAIN, _storages


class CudaStats:
    """The CUDA caching allocator's counters, the tracker's only CUDA calls besides snapshots (a test
    swaps in a fake allocator here to check the tracker's logic on a CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        """Largest ``allocated()`` since the last :meth:`reset_peak`."""
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def used(self) -> int | None:
        """The device's used memory as NVML sees it (other processes included), None without NVML."""
        try:
            return torch.cuda.device_memory_used(self.device)
        except Exception:  # no NVML (or AMD without amdsmi): not essential
            return None


# ----- storage resizes ---------------------------------------------------------------------------
# FSDP2 frees an all-gathered parameter with ``tensor.untyped_storage().resize_(0)`` and re-allocates it
# with ``resize_(n)`` before the next all-gather (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
# free_storage / alloc_storage): a direct call into the storage, no aten op, so no dispatch mode sees it.
# While any tracker is active, ``torch.UntypedStorage.resize_`` is wrapped to tell every active tracker
# (nested ones too); the last one to exit puts the original back.
_RESIZING: list["MemoryTracker"] = []
_RESIZE_LOCK = threading.Lock()
_RESIZE_PREV: list[Any] = []  # resize_ as it was when the wrapper went in


def _resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    out = _RESIZE_PREV[0](self, size)
    for tracker in tuple(_RESIZING):
        tracker._resized(self)
    return out


def _watch_resizes(tracker: "MemoryTracker", on: bool) -> None:
    """Start (``on``) or stop telling ``tracker`` about ``UntypedStorage.resize_`` calls."""
    with _RESIZE_LOCK:
        if on:
            if not _RESIZING:
                _RESIZE_PREV[:] = [torch.UntypedStorage.__dict__.get("resize_", torch._C.StorageBase.resize_)]
                torch.UntypedStorage.resize_ = _resize_
            _RESIZING.append(tracker)
        elif tracker in _RESIZING:
            _RESIZING.remove(tracker)
            if not _RESIZING:
                prev = _RESIZE_PREV.pop()
                if prev is torch._C.StorageBase.resize_:  # it was inherited: inherit it again
                    del torch.UntypedStorage.resize_
                else:
                    torch.UntypedStorage.resize_ = prev


_ATEN_RESIZE = torch.ops.aten.resize_.default  # tensor.resize_: an aten op whose output is its input
_STORAGE_RESIZE = getattr(getattr(torch.ops, "inductor", None), "resize_storage_bytes_", None)  # compiled FSDP2


def _tensors_of(args: tuple, kwargs: dict | None) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (flat, or in a list: aten ops nest no deeper)."""
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
                elif isinstance(b, (tuple, list, dict)):  # not an aten schema; be safe
                    yield from (x for x in tree_flatten(b)[0] if isinstance(x, torch.Tensor))


def _see(self, func, types, args=(), kwargs=None):
    """:class:`_Mode`'s dispatch: run the op, hand its new storages of the tracked device to the tracker."""
    out = func(*args, **(kwargs or {}))
    tr, plain = self.tracker, self.plain
    if type(out) in plain:  # most ops: one plain tensor
        st = out.untyped_storage()
        if id(st) in tr._ids:
            if func is _ATEN_RESIZE:  # may have grown (or shrunk) the storage in place
                tr._resized(st)
            return out
        outs = (out,)
    elif isinstance(out, (tuple, list)) and all(type(o) in plain or o is None for o in out):
        outs = out
    else:
        if _STORAGE_RESIZE is not None and func in (_STORAGE_RESIZE.default,):  # returns nothing
            for st in _storages(args[0]):
                tr._resized(st)
        outs = tree_flatten(out)[0]
    inputs = None
    host = getattr(_HOST_SCOPE, "on", False)
    ids = tr._ids
    for t in outs:
        if isinstance(t, torch.Tensor) and (tr._on_device(t) or (host and t.device.type == "cpu")):
            for st in ((t.untyped_storage(),) if type(t) in plain else _storages(t)):
                if id(st) in ids:
                    continue
                if inputs is None:  # views and in-place results share an input's storage
                    inputs = {id(s) for a in _tensors_of(args, kwargs)
                              for s in ((a.untyped_storage(),) if type(a) in plain else _storages(a))}
                if id(st) not in inputs:
                    if host:
                        _HOST.add(st)
                    tr._add(st, func.__name__)
    return out


class _Mode(TorchDispatchMode):
    """Sees every op; hands new storages of the tracked device to the tracker. The hot path (an op whose
    outputs are storages the tracker knows: views, in-place ops) allocates nothing in Python: one dict
    lookup per output tensor, keyed by the storage's id."""

    plain = _PLAIN  # tensor types with one storage of their own (no wrapper subclass to look inside)

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    __torch_dispatch__ = _see  # (torch wraps it in its guard against torch.compile tracing into it)


class _EagerMode(_Mode):
    """:class:`_Mode` without torch's guard against torch.compile tracing into its dispatch (a Python frame
    switch, ~5 µs an op): for the estimator's fake traces, where nothing is compiled."""

    plain = (*_PLAIN, FakeTensor)  # a fake tensor holds its meta storage itself (not a wrapper subclass)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    __torch_dispatch__ = _see

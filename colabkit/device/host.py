"""The host side of the seam: which storages live in host RAM (tagged, for the tracker), human-readable
bytes, pinned blocks as CUDA's host allocator rounds them, and the host-RAM guard."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..env import GiB, MiB, host_ram
from ..plan import PlanError

HOST_RESERVE = 1 << 30  # leave 1 GiB of host RAM for Python, the data loader and the notebook


def fmt_bytes(n: float | None) -> str:
    """Human-readable bytes. >>> fmt_bytes(3 * 1024**2)
    '3.0 MiB'"""
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no wrapper subclass: one storage, found without a stack


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The real storages behind a tensor, looking inside wrapper subclasses (e.g. torchao 4-bit state)."""
    if type(t) in _PLAIN:
        yield t.untyped_storage()
        return
    stack = [t]
    while stack:
        obj = stack.pop()
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            stack.extend(v for v in (getattr(obj, a) for a in attrs) if isinstance(v, torch.Tensor))
        else:
            yield obj.untyped_storage()


# ----- the host side (offload) -------------------------------------------------------------------
# Offload keeps tensors in host RAM: pinned on CUDA, and on a CPU run with simulated offload a
# second, distinct side of the same RAM. Storages allocated inside ``host_side()`` (or tagged with
# ``mark_host``) are counted on the host side: ``host_bytes`` / ``host_breakdown`` in the report,
# not the device's peak — on a GPU and in the CPU simulation alike.
_HOST: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()
_HOST_SCOPE = threading.local()


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Storages created in this block (this thread) live on the host side.

    >>> from colabkit.memory import MemoryTracker
    >>> with MemoryTracker(device="cpu") as mt:
    ...     with host_side():
    ...         h = torch.zeros(256)
    ...     d = torch.zeros(128)
    >>> r = mt.report(); r["host_bytes"], r["peak_bytes"]
    (1024, 512)
    """
    prev = getattr(_HOST_SCOPE, "on", False)
    _HOST_SCOPE.on = True
    try:
        yield
    finally:
        _HOST_SCOPE.on = prev


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Tag a tensor's storage as host side (for trackers started later too); returns ``t``."""
    for st in _storages(t):
        _HOST.add(st)
    return t


def is_host(t: torch.Tensor) -> bool:
    """True if the tensor's storage was allocated on, or tagged as, the host side."""
    return any(st in _HOST for st in _storages(t))


# ----- the host-RAM guard ------------------------------------------------------------------------
def pinned_bytes(nbytes: int) -> int:
    """Host RAM one pinned tensor of ``nbytes`` takes: CUDA's caching host allocator rounds each
    block up to the next power of two (``PowerOf2Ceil`` in CachingHostAllocator), so a 33 MB
    gradient buffer takes 64 MiB of page-locked RAM.

    >>> pinned_bytes(1000), pinned_bytes(1024), pinned_bytes(0)
    (1024, 1024, 0)
    """
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def host_ram_guard(nbytes: int, what: str, available: int | None = None, reserve: int = HOST_RESERVE,
                   pinned: Iterable[int] = ()) -> int:
    """Refuse (PlanError) to move ``nbytes`` (plus the ``pinned`` blocks, each rounded up by
    :func:`pinned_bytes`) to host RAM when that would leave less than ``reserve`` free; returns the
    bytes that stay free. A Colab VM is killed without warning when RAM runs out.

    >>> host_ram_guard(2 << 30, "optimizer state", available=8 << 30)
    6442450944
    >>> host_ram_guard(10 << 30, "optimizer state", available=8 << 30)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: offloading optimizer state needs 10.0 GiB of host RAM but only 8.0 GiB is available (1.0 GiB kept in reserve): offload less (e.g. only offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM
    """
    nbytes += sum(pinned_bytes(b) for b in pinned)
    if available is None:
        available = host_ram().get("available") or 0
    left = available - nbytes - reserve
    if left < 0:
        raise PlanError(f"offloading {what} needs {fmt_bytes(nbytes)} of host RAM but only {fmt_bytes(available)} "
                        f"is available ({fmt_bytes(reserve)} kept in reserve): offload less (e.g. only "
                        "offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM")
    return available - nbytes

"""The runtime that calls ``torch.cuda`` (streams, events, ``record_stream``, pinned memory, non-blocking
copies), the :class:`DevicePair` everything else calls, its pinned-block cache, and loss scaling with
gradients in host memory."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .host import host_ram_guard, host_side, is_host, mark_host, pinned_bytes
from .twin import CudaTwin


# ----- the runtimes under DevicePair: CUDA itself, or the CPU twin that models its ordering rules ---
class CudaRuntime:
    """The CUDA calls :class:`DevicePair` makes, bound to one device (the only code of colabkit that calls them)."""

    def __init__(self, device: torch.device):
        self.device = device

    def Stream(self) -> Any:  # noqa: N802 (torch.cuda's names)
        return torch.cuda.Stream(self.device)

    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream(self, s: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(s)

    def record_stream(self, t: torch.Tensor, s: Any) -> None:
        t.record_stream(s)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def empty_host_cache(self) -> None:
        """Hand cached pinned blocks nobody uses back to the OS (torch >= 2.8; older: kept cached)."""
        fn = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
              or getattr(torch._C, "_host_emptyCache", None))
        if fn is not None:
            fn()

    @contextlib.contextmanager
    def sync_debug(self, mode: str = "error") -> Iterator[None]:
        """Inside, a synchronizing CUDA call warns or raises (``torch.cuda.set_sync_debug_mode``)."""
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    def strict_sides(self) -> contextlib.AbstractContextManager:
        """CUDA itself refuses an op that mixes host and device tensors."""
        return contextlib.nullcontext()

    def stats(self) -> dict[str, int]:
        s = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {"pinned_bytes": s.get("allocated_bytes.current", 0),
                "pinned_peak_bytes": s.get("allocated_bytes.peak", 0)}


# ----- the device pair: the only lines that differ between CUDA and the CPU twin -----------------
class DevicePair:
    """The two sides offload moves tensors between: ``compute`` (the GPU) and ``host`` (CPU RAM).

    On CUDA: pinned host buffers, one side stream, events and non-blocking copies. On a CPU (simulated
    offload) both sides are the CPU and the same statements run against :class:`CudaTwin`, which
    models their ordering rules: a copy on the side stream lands only once it is waited for, so a
    missing wait, event, ``record_stream`` or synchronize shows up as NaN in CI.

    >>> pair = DevicePair("cpu")
    >>> h = pair.to_host(torch.ones(3)); d = pair.to_compute(h)
    >>> pair, d.data_ptr() != h.data_ptr(), pinned_bytes(12), pair.host_nbytes([12])
    (DevicePair(cpu <-> host (simulated)), True, 16, 16)
    """

    def __init__(self, compute: str | torch.device, runtime: Any = None):
        self.compute, self.host = torch.device(compute), torch.device("cpu")
        self.cuda = self.compute.type == "cuda"
        self.simulated = not self.cuda
        self.rt = runtime if runtime is not None else CudaRuntime(self.compute) if self.cuda else CudaTwin()
        self.stream = self.rt.Stream()
        self.cache = PinnedCache(self)

    def __repr__(self) -> str:
        return f"DevicePair({self.compute} <-> host{' (simulated)' if self.simulated else ', pinned'})"

    def host_nbytes(self, sizes: Iterable[int]) -> int:
        """Host RAM that pinned host buffers of these sizes take (each rounded up to a power of two)."""
        return sum(pinned_bytes(n) for n in sizes)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised pinned host buffer (asynchronous copies), tagged host side."""
        with host_side():
            return mark_host(self.rt.host_empty(shape, dtype))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``t``, complete on return (a blocking copy: for setup, not the step)."""
        h = self.host_empty(t.shape, t.dtype)
        h.copy_(t.detach())
        return h

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """A compute-side copy of ``t``, allocated and copied on the current stream (asynchronous from
        pinned memory on CUDA)."""
        d = torch.empty(t.shape, dtype=t.dtype, device=self.compute)
        self.copy_(d, t.detach())
        return d

    def to_host_async(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host copies of ``tensors`` issued on the side stream; they hold their data once the
        pair is synchronized (or an event after them is waited for)."""
        tensors = list(tensors)
        hosts = [self.host_empty(t.shape, t.dtype) for t in tensors]
        with self.side():
            for h, t in zip(hosts, tensors):
                self.copy_(h, t)
        for t in tensors:
            self.lend(t)
        return hosts

    def on_compute(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on the compute side (device memory, which may be lent to a stream). A CUDA model
        also holds host tensors: SDPA's fused kernels save their random seed and offset as CPU scalars. In
        the twin every tensor is on the CPU, and the host side is what is tagged so."""
        return t.device.type == self.compute.type if self.cuda else not is_host(t)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream, non-blocking."""
        self.rt.copy_(dst, src)

    # the ordering statements: each one deleted alone makes a test fail (tests/test_cuda_twin.py)
    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the block on the side stream, after the work queued on the compute stream so far."""
        self.stream.wait_stream(self.rt.current_stream())
        with self.rt.stream(self.stream):
            yield

    def done(self) -> Any:
        """An event marking the side stream's work so far."""
        ev = self.rt.Event()
        ev.record(self.stream)
        return ev

    def use(self, event: Any) -> None:
        """The current (compute) stream waits for ``event`` before it reads what the side stream made."""
        self.rt.current_stream().wait_event(event)

    def lend(self, t: torch.Tensor) -> None:
        """``t`` is read by the side stream: its memory is not reused before that work is done."""
        self.rt.record_stream(t, self.stream)

    def sync(self) -> None:
        """The host waits for every copy queued on the side stream."""
        self.stream.synchronize()

    def wait_host(self, event: Any) -> None:
        """The host (this thread) waits for ``event``: what was copied to host buffers before it is there."""
        event.synchronize()

    @contextlib.contextmanager
    def widened_races(self, cycles: int = 10_000_000) -> Iterator[None]:
        """For the block, the side stream sleeps ``cycles`` GPU cycles (~7 ms) each time work enters it
        (``torch.cuda._sleep``), so a copy read before it was waited for reads stale memory (selftest). The
        twin needs nothing: its side-stream copies never land before they are waited for."""
        if not self.cuda:
            yield
            return
        side = self.side

        @contextlib.contextmanager
        def slow_side() -> Iterator[None]:
            with side():
                torch.cuda._sleep(cycles)
                yield
        self.side = slow_side
        try:
            yield
        finally:
            del self.side

    def sync_debug(self, mode: str = "error") -> contextlib.AbstractContextManager:
        """A path that promises no device sync, checked: ``torch.cuda.set_sync_debug_mode(mode)`` for the
        block on CUDA ("error": a synchronizing call raises); the twin's own sync counter on a CPU."""
        return CudaRuntime.sync_debug(self.rt, mode) if self.cuda else self.rt.sync_debug(mode)

    def release_host_cache(self) -> None:
        """Give cached pinned blocks that nothing holds back to the OS."""
        self.rt.empty_host_cache()

    def stats(self) -> dict[str, int]:
        """Pinned host memory (rounded blocks, now and peak); in the twin also the copies, waits and
        synchronizations it saw and the copies that landed poison."""
        return self.rt.stats()

    def rng_state(self) -> tuple:
        """The RNG states a recompute must replay (CPU, and the GPU's on CUDA)."""
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.compute) if self.cuda else None

    @contextlib.contextmanager
    def replay_rng(self, state: tuple) -> Iterator[None]:
        """Run the block with the RNG as it was at ``state``; the outer RNG is left untouched."""
        devices = [self.compute.index or 0] if self.cuda else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.compute)
            yield


_PAIRS: "weakref.WeakKeyDictionary[nn.Module, DevicePair]" = weakref.WeakKeyDictionary()


def pair_of(model: nn.Module, device: str | torch.device) -> DevicePair:
    """The one DevicePair of a model's offload (its side stream, twin and pinned cache are shared by
    every offload kind of the plan, so one synchronize covers them all)."""
    pair = _PAIRS.get(model)
    if pair is None or pair.compute != torch.device(device):
        pair = _PAIRS[model] = DevicePair(device)
    return pair


class PinnedCache:
    """Pinned host blocks for saved activations, reused from step to step. Blocks come in powers of
    two (as CUDA's host allocator hands them out); each new block passes the host-RAM guard; at each
    forward's start the cache drops the blocks the previous step did not need, so it shrinks after a
    large batch instead of holding its peak for the rest of the run.

    >>> c = PinnedCache(DevicePair("cpu")); b = c.take(1000); c.give(b); c.held, c.trim(), c.held
    (1024, 0, 1024)
    >>> c.trim(), c.held  # the last cycle needed nothing: freed
    (1024, 0)
    """

    def __init__(self, pair: DevicePair):
        self.pair = pair
        self.free: dict[int, list[torch.Tensor]] = {}
        self.held = self.in_use = self.cycle_peak = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 pinned block of at least ``nbytes``."""
        size = pinned_bytes(nbytes)
        with self.lock:
            blocks = self.free.get(size)
            buf = blocks.pop() if blocks else None
            self.in_use += size
            self.cycle_peak = max(self.cycle_peak, self.in_use)
        if buf is None:
            host_ram_guard(size, "saved activations (offload:activations)")
            buf = self.pair.host_empty((size,), torch.uint8)
            with self.lock:
                self.held += size
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault(buf.numel(), []).append(buf)
            self.in_use -= buf.numel()

    def trim(self) -> int:
        """Free cached blocks beyond what the cycle since the last trim used at its peak; returns the bytes freed."""
        freed = 0
        with self.lock:
            for size in sorted(self.free, reverse=True):
                while self.free[size] and self.held - freed > self.cycle_peak:
                    self.free[size].pop()
                    freed += size
            self.held -= freed
            self.cycle_peak = self.in_use
        if freed:
            self.pair.release_host_cache()
        return freed


def to_device_async(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A copy of host tensor ``t`` on ``device`` on the current stream: non-blocking on CUDA (from pinned
    memory it overlaps the host; the current stream orders it before its readers), a plain copy elsewhere.

    >>> to_device_async(torch.ones(2), "cpu").tolist()
    [1.0, 1.0]
    """
    device = torch.device(device)
    return t.to(device, non_blocking=device.type == "cuda", copy=True)


# ----- loss scaling with gradients in host memory ---------------------------------------------------
def host_unscaling(scaler: Any) -> Any:
    """Make a ``torch.amp.GradScaler`` (or FSDP's ``ShardedGradScaler``) safe for gradients that live in
    host memory while the scale lives on the device (``offload:optimizer``, ``offload:params``, ``zero:3``
    with CPU offload). torch's scaler copies ``inv_scale`` and ``found_inf`` to the gradients' device with
    ``non_blocking=True``: to the CPU that lands in pinned memory *after* the CPU's unscale has read it
    (stale scale, overflow missed, the scale never backs off). Here host-side gradients are unscaled on the
    host with their own blocking read of ``inv_scale``; gradients on the scale's device go through torch's
    own code unchanged. Returns ``scaler``.

    >>> sc = host_unscaling(torch.amp.GradScaler("cpu", init_scale=4.0))
    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = mark_host(torch.tensor([8.0, float("inf")]))
    >>> opt = torch.optim.SGD([p], lr=1.0); _ = sc.scale(torch.ones(()))
    >>> sc.step(opt); sc.update(); p.tolist(), sc.get_scale()    # overflow: step skipped, scale halved
    ([1.0, 1.0], 2.0)
    """
    plain = scaler._unscale_grads_

    def _unscale_grads_(optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not any(g.device != inv_scale.device or is_host(g) for g in grads):
            return plain(optimizer, inv_scale, found_inf, allow_fp16)  # torch's own path
        if not allow_fp16 and any(g.dtype == torch.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:  # by (device, host side, dtype): one fused kernel per group
            g = g._values() if g.is_sparse else g
            groups.setdefault((g.device, g.device != inv_scale.device or is_host(g), g.dtype), []).append(g)
        host_dev = next(d for d, host, _ in groups if host)
        host_inv = inv_scale.to(host_dev, copy=True)  # blocking: the host reads the scale only once it is there
        host_found = torch.zeros((), dtype=found_inf.dtype, device=host_dev)
        with torch.no_grad():
            for (dev, host, _), gs in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(gs, host_found if host else found_inf,
                                                                 host_inv if host else inv_scale)
        if host_dev == found_inf.device:  # the CPU twin: both sides are the CPU
            found_inf += host_found
            return {found_inf.device: found_inf}
        return {found_inf.device: found_inf, host_dev: host_found}  # update() sums them on the scale's device

    scaler._unscale_grads_ = _unscale_grads_
    return scaler

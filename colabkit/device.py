"""The CUDA seam: every stream, event, pinned-memory and asynchronous-copy call of colabkit is here.

On a GPU, :class:`CudaRuntime` makes those calls on ``torch.cuda``; on a CPU its twin, :class:`CudaTwin`,
runs the same code with CUDA's ordering rules (a copy on a side stream lands only when something waits
for it; until then, or if its source was freed without ``record_stream``, its destination holds NaN).
:class:`DevicePair` (compute side, host side) is what the rest of colabkit calls: offload, disk offload,
the estimator and selftest move tensors between device and host only through it. Host-side storages are
tagged (:func:`host_side`, :func:`mark_host`) so the tracker reports them apart; :func:`host_ram_guard`
refuses to fill host RAM (a Colab VM is killed, not warned), pinned blocks rounded as CUDA rounds them
(:func:`pinned_bytes`). What needs techniques (optimizer state sizes: ``host_footprint``, ``guard_plan``)
stays in ``colabkit.techniques``.

>>> pair = DevicePair("cpu")                  # a CPU run: the twin under the pair
>>> h = pair.to_host(torch.ones(3)); is_host(h), fmt_bytes(pair.stats()["pinned_bytes"])
(True, '16 B')
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .env import GiB, MiB, host_ram
from .plan import PlanError

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

    def stats(self) -> dict[str, int]:
        s = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {"pinned_bytes": s.get("allocated_bytes.current", 0),
                "pinned_peak_bytes": s.get("allocated_bytes.peak", 0)}


def _poison(t: torch.Tensor) -> None:
    """What a buffer holds before its copy lands: NaN (floats), the largest value (integers)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _snapshot(t: torch.Tensor) -> Any:
    """A private copy of ``t``'s values, made through NumPy so that no tracker sees an allocation;
    returns a callable that gives it back as a tensor of ``t``'s dtype and shape."""
    bits = t.detach()
    if bits.dtype != torch.bool:
        bits = bits.view(_SAME_SIZE_INT[t.element_size()])
    arr, dtype = bits.numpy().copy(), t.dtype
    return lambda: torch.from_numpy(arr).view(dtype)


class _TwinEvent:
    def __init__(self, twin: "CudaTwin"):
        self.twin, self.stream, self.seq = twin, None, -1

    def record(self, stream: Any = None) -> None:
        self.stream = stream or self.twin.current_stream()
        self.seq = self.stream.issued  # everything issued on that stream so far

    def synchronize(self) -> None:
        """The host waits for the event: the copies before it land."""
        self.twin.count("event_waits")
        if self.stream is not None:
            self.stream.land(self.seq)


class _TwinStream:
    """One stream of the twin. The compute stream runs each op at once (the CPU is the device); a side
    stream queues its copies and runs them only when something waits for them."""

    def __init__(self, twin: "CudaTwin", side: bool):
        self.twin, self.side = twin, side
        self.ops: list[list] = []  # [seq, dst, source (a weakref, or the lent snapshot), stale]
        self.issued = 0
        self.waited = 0  # the compute stream's epoch this stream last waited for

    def enqueue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.twin.lock:
            self.issued += 1
            stale = self.waited < self.twin.compute.epoch  # issued without waiting for the compute stream
            _poison(dst)
            self.ops.append([self.issued, dst, weakref.ref(src), stale])
            self.twin.count("copies")

    def land(self, upto: int | None = None) -> None:
        """Run the queued copies up to ``upto`` (all when None), in order; a copy whose source was freed
        meanwhile (not lent by record_stream) or that never waited for its producer leaves poison."""
        with self.twin.lock, torch.no_grad():
            upto = self.issued if upto is None else upto
            while self.ops and self.ops[0][0] <= upto:
                _, dst, ref, stale = self.ops.pop(0)
                src = ref()
                if stale or src is None:
                    self.twin.count("poisoned")
                else:
                    dst.copy_(src)

    def keep(self, t: torch.Tensor) -> None:
        """record_stream(t, this stream): t's memory stays untouched until the queued copies that read it
        have run. On CUDA the allocator holds it until then (moments later); the twin, which runs them
        only when waited for, keeps a private copy instead (not device memory, so the tracker's figures
        stay those of CUDA) and lets t go."""
        with self.twin.lock:
            for op in self.ops:
                if op[2]() is t:
                    op[2] = _snapshot(t)

    def wait_stream(self, other: "_TwinStream") -> None:
        if self.side:
            self.waited = self.twin.compute.epoch
        else:
            other.land()

    def wait_event(self, event: _TwinEvent) -> None:
        self.twin.count("stream_waits")
        if event.stream is None:
            return  # never recorded: nothing to wait for (as on CUDA)
        if self.side and not event.stream.side:
            self.waited = self.twin.compute.epoch
        elif not self.side:
            event.stream.land(event.seq)

    def synchronize(self) -> None:
        self.twin.count("syncs")
        self.land()


class CudaTwin:
    """A CPU twin of CUDA's ordering rules, the runtime under a simulated :class:`DevicePair`.

    A copy issued on a side stream lands only when the compute stream waits on an event recorded after
    it (``wait_event``), the host waits on that event, or the stream is synchronized; until then its
    destination holds poison (NaN). A copy whose source was freed before it landed, without
    ``record_stream`` on the side stream, lands poison too, as does one issued on a side stream that did
    not wait for the compute stream since the compute stream last ran (its source may not exist yet).
    Pinned host blocks are rounded up to a power of two and counted (``stats()``).

    >>> twin = CudaTwin(); side = twin.Stream()
    >>> src, dst = torch.ones(3), torch.zeros(3)
    >>> side.wait_stream(twin.current_stream())
    >>> with twin.stream(side):
    ...     twin.copy_(dst, src)
    >>> ev = twin.Event(); ev.record(side)
    >>> dst.isnan().all().item()                # read before anyone waited: poison
    True
    >>> twin.current_stream().wait_event(ev); dst.tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self):
        self.lock = threading.RLock()
        self.compute = _TwinStream(self, side=False)
        self.compute.epoch = 1  # advances each time the compute stream takes over again
        self._local = threading.local()
        self.counts: dict[str, int] = {}
        self._pinned = self._pinned_peak = self._payload = self._payload_peak = 0

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def Stream(self) -> _TwinStream:  # noqa: N802
        return _TwinStream(self, side=True)

    def Event(self) -> _TwinEvent:  # noqa: N802
        return _TwinEvent(self)

    def current_stream(self) -> _TwinStream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, s: _TwinStream) -> Iterator[None]:
        prev, self._local.stream = self.current_stream(), s
        try:
            yield
        finally:
            self._local.stream = prev
            if s.side:
                self.compute.epoch += 1  # the compute stream runs on: what it makes next is new to the side

    def record_stream(self, t: torch.Tensor, s: _TwinStream) -> None:
        if s.side:
            s.keep(t)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = self.current_stream()
        if s.side:
            s.enqueue(dst, src)
        else:
            with torch.no_grad():
                dst.copy_(src)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        self._count_pinned(pinned_bytes(n), n)
        weakref.finalize(t.untyped_storage(), self._count_pinned, -pinned_bytes(n), -n)
        return t

    def _count_pinned(self, rounded: int, payload: int) -> None:
        with self.lock:
            self._pinned += rounded
            self._payload += payload
            self._pinned_peak = max(self._pinned_peak, self._pinned)
            self._payload_peak = max(self._payload_peak, self._payload)

    def empty_host_cache(self) -> None:
        self.count("host_cache_emptied")

    def stats(self) -> dict[str, int]:
        """Pinned blocks (rounded, as CUDA's host allocator takes them; payload = the bytes asked for),
        now and at the peak, and the calls seen."""
        with self.lock:
            return {"pinned_bytes": self._pinned, "pinned_peak_bytes": self._pinned_peak,
                    "payload_bytes": self._payload, "payload_peak_bytes": self._payload_peak, **self.counts}


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

    @contextlib.contextmanager
    def sync_debug(self, mode: str = "error") -> Iterator[None]:
        """A path that promises no device sync, checked: ``torch.cuda.set_sync_debug_mode(mode)`` for the
        block on CUDA ("error": a synchronizing call raises); the twin's own sync counter where it has one."""
        if not self.cuda:
            with getattr(self.rt, "sync_debug", lambda m: contextlib.nullcontext())(mode):
                yield
            return
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

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

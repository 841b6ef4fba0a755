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

Every move goes through a :class:`DevicePair` (compute side, host side), the only code that calls CUDA:
pinned memory, a side stream, events, ``record_stream`` and non-blocking copies. On a CPU run the
tokens are refused (there is nothing to offload to) unless offload is **simulated**
(``offload_sim=True``, ``--offload-sim``): both sides are then the CPU and the pair runs the same
statements against :class:`CudaTwin`, a CPU model of CUDA's ordering rules (a copy on the side stream
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
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..env import host_ram
from ..memory import fmt_bytes, host_side, mark_host, optimizer_tensors
from ..models import blocks_of
from ..plan import REGISTRY, Context, Plan, PlanError, Technique, register
from ._wrapper import WrappedOptimizer
from .checkpoint import recompute_context
from .optimizers import state_bytes_per_param

KINDS = ("optimizer", "activations", "params")
PREFETCH = True  # offload:params copies the next block on a side stream; set False to measure without
HOST_RESERVE = 1 << 30  # leave 1 GiB of host RAM for Python, the data loader and the notebook


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


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A pageable host copy (``offloaded(strategy="cpu")``)."""
    with host_side():
        h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        h.copy_(t.detach())
    return mark_host(h)


# ----- the runtimes under DevicePair: CUDA itself, or the CPU twin that models its ordering rules ---
class CudaRuntime:
    """The CUDA calls :class:`DevicePair` makes, bound to one device (the only CUDA-only code of offload)."""

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


# ----- offload:optimizer -------------------------------------------------------------------------
class HostOptimizer(WrappedOptimizer):
    """An optimizer whose fp32 master weights, gradients and state live in host RAM.

    ``make(host_param_groups)`` builds the real optimizer on the host copies. Inside backward each
    finished gradient is copied to its host buffer on the pair's side stream and freed on the
    compute side; ``step()`` waits for the copies, updates on the CPU, and copies the new weights
    back. Schedulers attach to ``.optimizer`` (it owns ``param_groups``); a gradient that arrives
    twice before a step (``accum:K``) is added on the host. ``state_dict()`` carries the master
    weights, so a resumed run continues from them, not from stale copies.

    >>> m = torch.nn.Linear(4, 2)
    >>> opt = HostOptimizer([{"params": list(m.parameters())}], lambda g: torch.optim.SGD(g, lr=0.1))
    >>> m(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> m.weight.grad is None, opt.host_bytes()
    (True, 80)
    """

    def __init__(self, param_groups: list[dict], make: Any, pair: DevicePair | None = None):
        params = [p for g in param_groups for p in g["params"]]
        self.pair = pair or DevicePair(params[0].device if params else "cpu")
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device param, host master)
        self._fresh: dict[int, bool] = {}
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host gradient buffer, accumulated copy in flight)
        host_groups = []
        for g in param_groups:
            hs = []
            for p in g["params"]:
                if getattr(p, "_colabkit_host", False):  # streamed by offload:params: update in place
                    h = p
                else:
                    h = nn.Parameter(self.pair.to_host(p))
                    h.grad = self.pair.host_empty(p.shape, p.dtype).zero_()
                    self._fresh[id(p)] = True
                    p.register_post_accumulate_grad_hook(self._grad_to_host)
                self._pairs.append((p, h))
                hs.append(h)
            host_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hs})
        self._host_of = {id(p): h for p, h in self._pairs}
        with host_side():
            self.optimizer = make(host_groups)

    def _grad_to_host(self, p: torch.Tensor) -> None:
        h = self._host_of[id(p)]
        if self._fresh[id(p)]:
            with self.pair.side():  # overlap the copy with the rest of backward
                self.pair.copy_(h.grad, p.grad)
            self.pair.lend(p.grad)
            self._fresh[id(p)] = False
        else:  # accumulation: a second gradient goes out on the side stream too, added on the host once landed
            self._land_adds()  # the previous one (at most one accumulated gradient in flight: host RAM)
            self._adds.extend(zip([h.grad], self.pair.to_host_async([p.grad])))
        p.grad = None

    def _land_adds(self) -> None:
        """Add the accumulated gradients in flight to their host buffers, once the side stream has run them."""
        if self._adds:
            self.pair.sync()
            for buf, g in self._adds:
                buf.add_(g)
            self._adds.clear()

    def step(self, closure=None):
        self.pair.sync()
        self._land_adds()
        with host_side():  # the update (and any state it creates) runs on the host
            loss = self.optimizer.step(closure)
        self._copy_back()
        return loss

    def _copy_back(self) -> None:
        for p, h in self._pairs:
            if h is not p:
                self.pair.copy_(p.data, h.data)  # pinned -> asynchronous host-to-device
                self._fresh[id(p)] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        # device gradients are already gone (moved in backward); host buffers are overwritten by
        # the next step's first gradient (also after a step the GradScaler skipped), so only
        # host-resident parameters have a .grad to clear
        for p, h in self._pairs:
            if h is p and p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
            self._fresh[id(p)] = True

    @property
    def param_groups(self) -> list[dict]:
        # The GradScaler unscales and inf-checks the gradients it finds here — the host copies —
        # so the copies still in flight on the side stream must land first.
        self.pair.sync()
        self._land_adds()
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        """The inner optimizer's state plus the host master weights (in parameter order)."""
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [h.detach().clone() for p, h in self._pairs if h is not p]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore state and master weights; a plain optimizer state dict (no masters) takes the
        masters from the model's current weights (exact when they are fp32)."""
        with host_side():
            self.optimizer.load_state_dict(sd["optimizer"] if "masters" in sd else sd)
        own = [(p, h) for p, h in self._pairs if h is not p]
        masters = sd["masters"] if "masters" in sd else [p.detach() for p, _ in own]
        if len(masters) != len(own):
            raise ValueError(f"checkpoint has {len(masters)} master weights, this optimizer {len(own)}: "
                             "resume with the same model and plan")
        for (p, h), m in zip(own, masters):
            h.data.copy_(m)
        self._copy_back()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Master weights, host gradient buffers and the inner optimizer's state (host side)."""
        for p, h in self._pairs:
            if h is not p:
                yield h
                yield h.grad
        yield from optimizer_tensors(self.optimizer)

    def host_bytes(self) -> int:
        """Host RAM held: master weights, gradient buffers and optimizer state."""
        seen, n = set(), 0
        for t in self.state_tensors():
            st = t.untyped_storage()
            if t.device.type == "cpu" and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
        return n


def _offload_optimizer(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> HostOptimizer:
    groups = optimizer.param_groups  # host RAM was guarded for the whole plan in _prepare
    pair = pair_of(model, ctx.device)
    cpu_ctx = Context(device=torch.device("cpu"), env=ctx.env, model_name=ctx.model_name, lr=ctx.lr,
                      weight_decay=ctx.weight_decay)
    make = lambda hg: REGISTRY[plan.optimizer].make_optimizer(hg, plan, cpu_ctx)  # noqa: E731
    # the groups as the Trainer made them (param_groups: decay or not), not as the optimizer rewrote them
    # (adafactor rescales weight_decay to its relative lr: rescaled twice, the decay was ~1000x too small)
    plain_groups = [{"params": g["params"], "weight_decay": ctx.weight_decay if g.get("weight_decay") else 0.0}
                    for g in groups]
    return HostOptimizer(plain_groups, make, pair)


class HostStateOptimizer(WrappedOptimizer):
    """``offload:params`` without ``offload:optimizer``: the plain optimizer updates the host-side
    block parameters in place, so their state lives on the host too (CPU tensors on a GPU run);
    this tags it host side for the tracker after each step. (Their gradients are complete when
    backward returns: the streamer synchronizes its copies at the end of backward.)"""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        for p, s in self.optimizer.state.items():
            if getattr(p, "_colabkit_host", False):
                for v in s.values():
                    if isinstance(v, torch.Tensor):
                        mark_host(v)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


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


# ----- offload:params (layer streaming) ----------------------------------------------------------
class BlockStreamer:
    """Copies one block's host-resident parameters to the compute side on demand, and
    (``prefetch``) the next block's on the side stream while the current one computes."""

    def __init__(self, blocks: nn.ModuleList, pair: DevicePair, prefetch: bool = True):
        self.blocks, self.pair, self.prefetch = blocks, pair, prefetch
        self._pending: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self.copies = 0
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, accumulated gradient in flight)
        self._sync_queued = False

    def _start(self, i: int) -> None:
        if i in self._pending or not 0 <= i < len(self.blocks):
            return
        named = dict(self.blocks[i].named_parameters()) | dict(self.blocks[i].named_buffers())
        # allocated on the compute stream, which reads them (no record_stream needed); filled on the side
        dev = {n: torch.empty(t.shape, dtype=t.dtype, device=self.pair.compute) for n, t in named.items()}
        with self.pair.side():
            for n, t in named.items():
                self.pair.copy_(dev[n], t)
        self.copies += 1
        self._pending[i] = (dev, self.pair.done())

    def get(self, i: int, next_i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors on the compute side; starts copying block ``next_i`` when prefetching."""
        self._start(i)
        dev, ev = self._pending.pop(i)
        self.pair.use(ev)
        if self.prefetch:
            self._start(next_i)
        return dev

    def grads_to_host(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Block gradients go to pinned host buffers on the side stream (overlapping the rest of
        backward); a second gradient before the step (``accum:K``, a block called twice) goes out the same
        way and is added on the host once it landed: at the next block (one block's copies in flight at a
        time) or when backward ends. The copies are waited for once, when backward ends, so ``p.grad`` is
        complete when ``backward()`` returns."""
        self._land_adds()
        for p, h in zip(params, self.pair.to_host_async(grads)):
            if p.grad is None:
                p.grad = h
            else:
                self._adds.append((p, h))
        if not self._sync_queued:
            self._sync_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _land_adds(self) -> None:
        """Add the accumulated block gradients in flight to ``p.grad``, once the side stream has run them."""
        if self._adds:
            self.pair.sync()
            for p, h in self._adds:
                p.grad.add_(h)
            self._adds.clear()

    def _end_of_backward(self) -> None:
        self._sync_queued = False
        self.pair.sync()
        self._land_adds()


class _Call:
    """One call of a streamed block: its arguments split into tensors (autograd inputs) and the
    rest (None, flags, cache objects), so any ``block(*args, **kwargs)`` — transformers passes
    ``attention_mask=``, ``position_ids=``, ``position_embeddings=(cos, sin)``, … — can be replayed."""

    def __init__(self, streamed: "_Streamed", args: tuple, kwargs: dict):
        self.block, self.i, self.streamer = streamed.block, streamed.i, streamed.streamer
        flat, self.spec = tree_flatten((args, kwargs))
        self.is_t = [isinstance(a, torch.Tensor) for a in flat]
        self.rest = [None if t else a for a, t in zip(flat, self.is_t)]
        self.tensors = [a for a, t in zip(flat, self.is_t) if t]
        self.out_spec: Any = None
        self.out_rest: list | None = None

    def __call__(self, w: dict[str, torch.Tensor], tensors: Iterable[torch.Tensor]) -> list:
        """Run the block with weights ``w``; returns the output's leaves (spec kept)."""
        it = iter(tensors)
        args, kwargs = tree_unflatten([next(it) if t else a for a, t in zip(self.rest, self.is_t)], self.spec)
        flat, self.out_spec = tree_flatten(torch.func.functional_call(self.block, w, tuple(args), kwargs))
        return flat


class _StreamedBlockFn(torch.autograd.Function):
    """Forward without keeping the block's weights; backward fetches them again, recomputes the
    block with the forward's RNG state and autocast, and adds the parameter gradients to the host
    parameters' ``.grad``."""

    @staticmethod
    def forward(ctx, call, *tensors):
        pair = call.streamer.pair
        ctx.rng = pair.rng_state()  # dropout in the recompute must draw the same masks
        w = call.streamer.get(call.i, call.i + 1)
        with torch.no_grad():
            flat = call(w, tensors)
        call.out_rest = [None if isinstance(o, torch.Tensor) else o for o in flat]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        dev = pair.compute.type  # the recompute in backward must see the same autocast as this forward
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        ctx.replay = recompute_context()  # and the forward's other contexts (attention:* backend)
        return tuple(o for o in flat if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grad_outs):
        call, needs = ctx.call, ctx.needs_input_grad[1:]
        w = call.streamer.get(call.i, call.i - 1)  # backward walks the blocks in reverse: prefetch the previous
        names = [n for n, p in call.block.named_parameters() if p.requires_grad]
        for n in names:
            w[n].requires_grad_(True)
        dev, dtype, enabled = ctx.autocast
        with torch.enable_grad(), call.streamer.pair.replay_rng(ctx.rng), torch.autocast(dev, dtype=dtype, enabled=enabled), ctx.replay:
            xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
            outs = [o for o in call(w, xs) if isinstance(o, torch.Tensor)]
        used = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad and g is not None]
        inputs = [x for x, need in zip(xs, needs) if need] + [w[n] for n in names]
        grads = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True)
        gx = iter(grads)
        result = [next(gx) if need else None for need in needs]
        params = dict(call.block.named_parameters())
        got = [(params[n], g) for n, g in zip(names, gx) if g is not None]
        call.streamer.grads_to_host([p for p, _ in got], [g for _, g in got])  # straight to the host side
        return (None, *result)


class _Streamed(nn.Module):
    """A block whose weights stay on the host side; called like the block itself."""

    def __init__(self, block: nn.Module, i: int, streamer: BlockStreamer):
        super().__init__()
        self.block, self.i = block, i
        object.__setattr__(self, "streamer", streamer)  # not a submodule

    def __getattr__(self, name: str) -> Any:  # model code may read block attributes (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, *args, **kwargs):
        call = _Call(self, args, kwargs)
        outs = iter(_StreamedBlockFn.apply(call, *call.tensors))
        rest, call.out_rest = call.out_rest, None  # no reference from the graph to the outputs
        return tree_unflatten([next(outs) if r is None else r for r in rest], call.out_spec)


def stream_blocks(model: nn.Module, device: str | torch.device, prefetch: bool = True,
                  guard: bool = True) -> nn.Module:
    """Keep the transformer blocks' parameters on the host side (pinned on CUDA) and move everything
    else to ``device``; each block's weights visit the device only while it runs (forward, then
    recomputed in backward). Block gradients land on the host parameters. Returns the model.
    ``guard``: first check host RAM for the blocks' weights, gradients and AdamW state
    (:func:`guard_plan`; the plan path guards the whole plan itself and passes False).

    >>> from colabkit.models import build_model
    >>> m = stream_blocks(build_model("gpt:2x32"), "cpu")
    >>> m.blocks[0].streamer.prefetch, m._colabkit_placed
    (True, True)
    """
    if guard:
        guard_plan(model, ["params"], "adamw")
    pair = pair_of(model, device)
    blocks = blocks_of(model)
    streamer = BlockStreamer(nn.ModuleList(list(blocks)), pair, prefetch)
    for i, b in enumerate(list(blocks)):
        for t in list(b.parameters()) + list(b.buffers()):
            t.data = pair.to_host(t.data)
            t._colabkit_host = True  # HostOptimizer updates these in place, no second copy
        blocks[i] = _Streamed(b, i, streamer)
    streamed = set(id(p) for p in blocks.parameters()) | set(id(b) for b in blocks.buffers())
    for m in model.modules():  # the rest (embeddings, final norm, head) goes to the device
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in streamed:
                p.data = p.data.to(pair.compute)
        for name, b in list(m.named_buffers(recurse=False)):
            if id(b) not in streamed:
                setattr(m, name, b.to(pair.compute))
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # training: no KV cache (a streamed block's k/v would be kept)
    model._colabkit_placed = True
    return model


# ----- phase-aware offload (evaluation, generation) ----------------------------------------------
STRATEGIES = ("cpu", "pinned", "int8", "drop")


def _q8(t: torch.Tensor, block: int = 256) -> tuple:
    flat = t.reshape(-1).float()
    pad = (-flat.numel()) % block
    b = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    absmax = b.abs().amax(1).clamp(min=1e-30)
    return (torch.round(b / absmax[:, None] * 127).to(torch.int8), absmax, t.shape, t.dtype)


def _dq8(q: tuple) -> torch.Tensor:
    codes, absmax, shape, dtype = q
    return (codes.float() / 127 * absmax[:, None]).reshape(-1)[: math.prod(shape)].view(shape).to(dtype)


@contextlib.contextmanager
def offloaded(optimizer: Any, model: nn.Module | None = None, strategy: str = "pinned") -> Iterator[dict]:
    """During a phase with no backward (evaluation, generation), take optimizer state and gradients
    off the device; put them back, bit-exact for cpu/pinned, when the block ends.

    Strategies: ``cpu`` / ``pinned`` (copy to host RAM, pageable or pinned through a
    :class:`DevicePair`, guarded by :func:`host_ram_guard` with pinned blocks rounded up), ``int8``
    (blockwise 8-bit in place: 1/4 of fp32, lossy), ``drop`` (free it; moments restart at zero
    after the block — changes training, use only when nothing else fits). Yields a dict with
    ``moved_bytes``.

    >>> m = torch.nn.Linear(64, 64); opt = torch.optim.AdamW(m.parameters())
    >>> m(torch.ones(1, 64)).sum().backward(); opt.step()
    >>> with offloaded(opt, m, "int8") as info:
    ...     info["moved_bytes"]
    49152
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown offload strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    inner = getattr(optimizer, "optimizer", optimizer)  # through fused-step / offload wrappers
    state = inner.state

    def worth(v: Any) -> bool:  # per-step scalars stay; int8 compresses only big float tensors
        if not torch.is_tensor(v) or v.numel() <= 1:
            return False
        return v.is_floating_point() and v.numel() >= 4096 if strategy == "int8" else True

    keys = [(p, k) for p, s in state.items() for k, v in s.items() if worth(v)]
    grads = [p for p in (model.parameters() if model is not None else ()) if p.grad is not None and worth(p.grad)]
    moved = sum(state[p][k].numel() * state[p][k].element_size() for p, k in keys)
    moved += sum(p.grad.numel() * p.grad.element_size() for p in grads)
    sizes = [state[p][k].numel() * state[p][k].element_size() for p, k in keys] + [
        p.grad.numel() * p.grad.element_size() for p in grads]
    if strategy == "cpu":
        host_ram_guard(moved, "optimizer state for evaluation")
    elif strategy == "pinned":
        host_ram_guard(0, "optimizer state for evaluation (pinned)", pinned=sizes)
    pairs: dict[torch.device, DevicePair] = {}

    def stash(v: torch.Tensor) -> tuple:
        if strategy == "int8":
            return _q8(v), v.device
        if strategy == "drop":
            return None, v.device
        if strategy == "pinned":
            pair = pairs.setdefault(v.device, DevicePair(v.device))
            return pair.to_host(v), v.device
        return _host_copy(v), v.device

    def unstash(stored: tuple) -> torch.Tensor:
        data, dev = stored
        if strategy == "int8":
            return _dq8(data).to(dev)
        return pairs[dev].to_compute(data) if strategy == "pinned" else data.to(dev)

    saved = {(id(p), k): stash(state[p][k]) for p, k in keys}
    for p, k in keys:
        state[p][k] = None  # the device copy is freed here
    grad_saved = {id(p): (p, stash(p.grad)) for p in grads}
    for p in grads:
        p.grad = None
    try:
        yield {"moved_bytes": moved, "strategy": strategy}
    finally:
        for p, k in keys:
            if strategy == "drop":
                state.pop(p, None)  # re-initialised (zeros, step 0) by the next optimizer step
            else:
                state[p][k] = unstash(saved[(id(p), k)])
        if strategy != "drop":
            for p, stored in grad_saved.values():
                p.grad = unstash(stored)


# ----- the plan token --------------------------------------------------------------------------
def _parse(arg: str | None) -> str:
    if arg not in KINDS:
        raise PlanError(f"offload needs what to offload: {', '.join('offload:' + k for k in KINDS)}")
    return arg


def _check(plan: Plan, ctx: Context) -> None:
    kinds = sorted(plan.get("offload", ()))
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
    if "params" in kinds:
        if "checkpoint" in plan:
            raise PlanError("'offload:params' already recomputes each block in backward (its weights are fetched "
                            "again): drop 'checkpoint'")
        if "fused-step" in plan:
            raise PlanError("'offload:params' and 'fused-step' conflict: the streamed blocks' gradients land on the "
                            "host after the block is recomputed, outside fused-step's per-parameter hooks, so their "
                            "parameters would be stepped twice: drop 'fused-step' (offload:params keeps no block "
                            "gradients on the GPU anyway)")
        if "lora" in plan or "qlora" in plan:
            raise PlanError("'offload:params' with lora/qlora is not supported: the frozen base is already small "
                            "in qlora; drop one")


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    kinds = set(plan.get("offload", ())) - {"activations"}  # activations: guarded as the pinned cache grows
    if kinds and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy does it
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

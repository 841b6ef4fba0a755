"""The CPU twin of CUDA: the same offload code runs against it on a CPU, under CUDA's ordering rules."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .host import _HOST_SCOPE, is_host, mark_host, pinned_bytes


class TwinError(RuntimeError):
    """What CUDA would refuse (a record_stream on a host tensor, a compute-side op on a host tensor), or a
    hidden synchronization inside ``sync_debug("error")`` (the twin of ``torch.cuda.set_sync_debug_mode``)."""


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
    """One stream of the twin. The compute stream runs each op at once (the CPU is the device), except a
    copy into pinned host memory, which lands when waited for (the device runs ahead of the host); a side
    stream queues its copies and runs them only when something waits for them."""

    def __init__(self, twin: "CudaTwin", side: bool):
        self.twin, self.side = twin, side
        # [seq, dst, weakref to the source, its lent snapshot or None, stale, source version, dst version]
        self.ops: list[list] = []
        self.issued = 0
        self.waited = 0  # the compute stream's epoch this stream last waited for

    def enqueue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.twin.lock:
            self.issued += 1
            stale = self.side and self.waited < self.twin.compute.epoch  # issued without waiting for compute
            st = dst.untyped_storage().data_ptr()
            for other in self.twin.streams():  # the same buffer filled by another stream, not landed yet: a race
                for op in other.ops:
                    if other is not self and op[1].untyped_storage().data_ptr() == st:
                        op[4] = stale = True
                        self.twin.count("reused_before_landed")
            _poison(dst)
            self.ops.append([self.issued, dst, weakref.ref(src), None, stale, src._version, dst._version])
            self._ordered(st, dst)
            self.twin.count("copies")

    def _ordered(self, st: int, dst: torch.Tensor) -> None:
        """This stream's own writes into a buffer are in order: its pending copies into it expect them."""
        for op in self.ops:
            if op[1].untyped_storage().data_ptr() == st:
                op[6] = dst._version

    def land(self, upto: int | None = None) -> None:
        """Run the queued copies up to ``upto`` (all when None), in order. A copy lands poison when its source
        was freed meanwhile (not lent by record_stream), was written after the copy was issued, or when its
        destination was written or filled by another stream meanwhile, or it never waited for its producer."""
        with self.twin.lock, torch.no_grad():
            upto = self.issued if upto is None else upto
            while self.ops and self.ops[0][0] <= upto:
                _, dst, ref, lent, stale, src_v, dst_v = self.ops.pop(0)
                src = ref()
                written = (src is not None and src._version != src_v) or dst._version != dst_v
                if written:
                    self.twin.count("written_before_landed")
                if stale or written or (src is None and lent is None):
                    _poison(dst)
                    self.twin.count("poisoned")
                else:
                    dst.copy_(src if src is not None else lent())
                self._ordered(dst.untyped_storage().data_ptr(), dst)

    def keep(self, t: torch.Tensor) -> None:
        """record_stream(t, this stream): t's memory stays untouched until the queued copies that read it
        have run. On CUDA the allocator holds it until then (moments later); the twin, which runs them
        only when waited for, keeps a private copy instead (not device memory, so the tracker's figures
        stay those of CUDA) and lets t go. A write to t itself before then still poisons the copy."""
        with self.twin.lock:
            for op in self.ops:
                if op[2]() is t:
                    op[3] = _snapshot(t)

    def wait_stream(self, other: "_TwinStream") -> None:
        if self.side:
            self.waited = self.twin.compute.epoch
            other.land()  # the compute stream's deferred copies are ordered before what this stream does next
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
        self.twin.hidden_sync("stream synchronize", explicit=True)
        self.land()


class CudaTwin:
    """A CPU twin of CUDA's ordering rules, the runtime under a simulated :class:`DevicePair`.

    A copy issued on a side stream lands only when the compute stream waits on an event recorded after
    it (``wait_event``), the host waits on that event, or the stream is synchronized; until then its
    destination holds poison (NaN). A copy whose source was freed before it landed, without
    ``record_stream`` on the side stream, lands poison too, as does one issued on a side stream that did
    not wait for the compute stream since the compute stream last ran (its source may not exist yet).
    Pinned host blocks are rounded up to a power of two and counted (``stats()``).

    Stricter, as CUDA is: tensors carry their side (host: tagged by :func:`~colabkit.device.mark_host`;
    compute: the rest); a ``record_stream`` on a host tensor, and (inside :meth:`strict_sides`) a
    compute-side op on a host tensor, raise :class:`TwinError`. A copy into pinned memory issued on the
    compute stream lands when waited for, too. A copy whose host end is pageable or not contiguous is a
    hidden synchronization (counted, ``hidden_syncs``); inside ``sync_debug("error")`` it raises, as do
    ``torch.tensor(..., device=)``, ``.to(device)`` and a stream synchronize. Writing to a source (lent or
    not) or to a destination before its copy landed, or filling one buffer from two streams at once,
    poisons the copy.

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
        self._pinned_storages: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()
        self._sides: list[_TwinStream] = []  # every side stream (weakly: a pair makes one)
        self.sync_mode: str | None = None

    def streams(self) -> list["_TwinStream"]:
        return [self.compute] + [s for s in (r() for r in self._sides) if s is not None]

    def pinned(self, t: torch.Tensor) -> bool:
        """``t`` lives in a pinned block of this twin."""
        return t.untyped_storage() in self._pinned_storages

    def hidden_sync(self, what: str, explicit: bool = False) -> None:
        """Count a synchronization CUDA would make here; inside ``sync_debug("error")`` raise."""
        if not explicit:
            self.count("hidden_syncs")
        if self.sync_mode == "error":
            raise TwinError(f"synchronizing operation inside sync_debug('error'): {what}")

    @contextlib.contextmanager
    def sync_debug(self, mode: str = "error") -> Iterator[None]:
        """The twin of ``torch.cuda.set_sync_debug_mode``: inside, a hidden synchronization raises (``"error"``)
        or is only counted (``"warn"``); ``torch.tensor(..., device=)`` and ``.to(device)`` count as one too
        (on CUDA a blocking host-to-device copy)."""
        prev, self.sync_mode = self.sync_mode, mode
        try:
            with _HiddenCopies(self):
                yield
        finally:
            self.sync_mode = prev

    @contextlib.contextmanager
    def strict_sides(self) -> Iterator[None]:
        """Inside, an op that mixes host-side and compute-side tensors (other than a copy between them)
        raises :class:`TwinError`, as a CUDA op given a CPU tensor does."""
        with _SideCheck():
            yield

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def Stream(self) -> _TwinStream:  # noqa: N802
        s = _TwinStream(self, side=True)
        self._sides.append(weakref.ref(s))
        return s

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
        if is_host(t):
            raise TwinError("record_stream on a host tensor: only device memory is lent to a stream "
                            "(CUDA refuses a CPU tensor)")
        if s.side:
            s.keep(t)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for end in (dst, src):  # the host end of a non-blocking copy must be pinned and contiguous
            if is_host(end) and not (self.pinned(end) and end.is_contiguous()):
                self.hidden_sync("a non-blocking copy through pageable memory (a host end that is not pinned "
                                 "or not contiguous)")
        s = self.current_stream()
        if s.side or (is_host(dst) and self.pinned(dst)):  # the compute stream runs ahead of the host too
            s.enqueue(dst, src)
        else:
            with torch.no_grad():
                dst.copy_(src)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        self._count_pinned(pinned_bytes(n), n)
        self._pinned_storages.add(t.untyped_storage())
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


class _HiddenCopies(TorchFunctionMode):
    """Counts (or refuses) the copies to a device that do not go through the seam: ``torch.tensor(...,
    device=)`` / ``torch.as_tensor(..., device=)`` and ``Tensor.to(device)`` / ``.cuda()`` — on CUDA a
    blocking host-to-device copy each (one per chunk adds up)."""

    def __init__(self, twin: "CudaTwin"):
        super().__init__()
        self.twin = twin

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.twin.hidden_sync(f"torch.{name}(..., device=...)")
        elif name == "cuda" or (name == "to" and (kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str)) for a in args[1:]))):
            self.twin.hidden_sync(f"Tensor.{name}(device)")
        return func(*args, **kwargs)


class _SideCheck(TorchDispatchMode):
    """Refuses an op whose tensors live on both sides (CUDA: 'Expected all tensors to be on the same
    device'); copies between the sides are the seam's business and pass."""

    _TRANSFERS = {"copy_", "_to_copy", "copy", "lift_fresh", "detach", "alias", "view", "_unsafe_view"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name.startswith(("_foreach_", "_fused_")):  # torch groups a list op's tensors by device: per index
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            groups = [[lst[i] for lst in lists if i < len(lst)] for i in range(len(lists[0]))] if lists else []
        elif name not in self._TRANSFERS:
            groups = [[a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]]
        else:
            groups = []
        for flat in groups:
            sides = {is_host(a) for a in flat if a.dim() > 0}  # 0-dim tensors: scalars, any side (as CUDA)
            if len(sides) > 1:
                raise TwinError(f"{func._schema.name} mixes host-side and compute-side tensors: move one side "
                                "first (DevicePair.to_compute / to_host)")
        out = func(*args, **kwargs)
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.dim()]
        # the side propagates as a device does: made from host tensors only (zeros_like(p)), or inside
        # host_side() (a host optimizer's state), the result is host side
        if getattr(_HOST_SCOPE, "on", False) or (ins and all(is_host(a) for a in ins)):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    mark_host(t)
        return out

"""The CPU twin of CUDA: the same offload code runs against it on a CPU, under CUDA's ordering rules."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

from .host import pinned_bytes


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

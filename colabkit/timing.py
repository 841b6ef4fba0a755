"""Speed, measured the honest way: untracked, warmed up, repeated, and interleaved against its peer.

A step time taken under :class:`~colabkit.memory.MemoryTracker` includes the tracker's per-op Python
work, and two things timed one after the other on a shared machine see different loads. So every
speed figure colabkit prints comes from here: each candidate runs ``warmup`` untimed calls, then
``repeats`` rounds in which every candidate runs once (A B A B …), and the result is the median with
its spread. Ratios are the median of the per-round ratios, so a burst of load hits both sides.

The clock is the device's: on a CPU the process's CPU time (robust to other processes on a shared
machine; with several threads it adds theirs up), on CUDA wall time between synchronizations.

>>> t = interleaved({"sum": lambda: sum(range(1000)), "sorted": lambda: sorted(range(1000))}, repeats=3)
>>> sorted(t), t["sum"].repeats, t["sum"].clock
(['sorted', 'sum'], 3, 'cpu process time')
>>> ratio(t, "sum", "sum")
1.0
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


@dataclass
class Timing:
    """Seconds per call of one candidate: ``median``, the spread (``low``/``high`` = min/max of the
    repeats), every sample, the clock and the device it was measured on."""

    median: float
    low: float
    high: float
    samples: list[float] = field(default_factory=list)
    clock: str = "cpu process time"
    device: str = "cpu"

    @property
    def repeats(self) -> int:
        return len(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.1 means the repeats differ by 10% of the median."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.median * 1e3:.2f} ms (min {self.low * 1e3:.2f}, max {self.high * 1e3:.2f}; {self.clock}, {self.device})"


def _clock(device: str | torch.device | None) -> tuple[Callable[[], float], Callable[[], None], str]:
    """(read the clock, wait for the device, the clock's name) for ``device``."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return time.perf_counter, lambda: torch.cuda.synchronize(dev), "wall time, CUDA-synchronized"
    return time.process_time, lambda: None, "cpu process time"


def interleaved(fns: Mapping[str, Callable[[], Any]], warmup: int = 1, repeats: int = 5,
                device: str | torch.device | None = None) -> dict[str, Timing]:
    """Time each callable in ``fns`` interleaved with the others: ``warmup`` untimed calls each, then
    ``repeats`` rounds of one timed call each. Returns a :class:`Timing` per name.

    >>> t = interleaved({"a": lambda: None}, warmup=0, repeats=2)
    >>> t["a"].repeats
    2
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    now, sync, clock = _clock(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = now()
            fn()
            sync()
            samples[name].append(now() - t0)
    dev = str(torch.device(device or "cpu"))
    return {name: Timing(statistics.median(s), min(s), max(s), s, clock, dev) for name, s in samples.items()}


def time_fn(fn: Callable[[], Any], warmup: int = 1, repeats: int = 5,
            device: str | torch.device | None = None) -> Timing:
    """:func:`interleaved` for one callable. >>> time_fn(lambda: None, repeats=2).repeats
    2"""
    return interleaved({"fn": fn}, warmup=warmup, repeats=repeats, device=device)["fn"]


def ratio(timings: Mapping[str, Timing], a: str, b: str) -> float:
    """How many times slower ``a`` is than ``b``: the median of the per-round ratios (each round ran
    both back to back, so a burst of load on the machine hits both)."""
    ta, tb = timings[a].samples, timings[b].samples
    return statistics.median(x / y if y > 0 else float("inf") for x, y in zip(ta, tb))


def untracked_time(record: Mapping[str, Any]) -> str:
    """A record's step time for a table: seconds when untracked steps timed it, else ``-`` (a step under the
    tracker is slower by its per-op work: never shown as speed).

    >>> untracked_time({"step_time_s": 0.25, "timing_steps": 2}), untracked_time({"step_time_s": 0.4, "timing_steps": 0})
    ('0.250', '-')
    """
    return f"{record['step_time_s']:.3f}" if record.get("timing_steps") else "-"

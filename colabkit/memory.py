"""Measure where training memory goes: a tracker that sorts every tensor storage into parameters,
gradients, optimizer state, activations and other/temporaries, on any device (the CPU included),
with a phase-labelled timeline, alerts, and CUDA snapshots.

The breakdown comes from a ``TorchDispatchMode`` that sees every storage an op creates, a weak
reference that sees it freed, and a wrapper of ``UntypedStorage.resize_`` (while a tracker is active)
that sees a storage freed or re-allocated in place, as FSDP2 does with its all-gathered parameters.
A storage's category is decided by what it turns out to be: a model parameter or buffer, a ``.grad``,
a tensor held in the optimizer's state, else by the phase that created it (forward -> activations,
anything else -> other). Peaks are replayed with those final
categories, so optimizer state created inside ``step()`` counts as optimizer state from its birth.

The tracker's parts live beside it: its ledger and the replay into peaks in :mod:`colabkit.memory_ledger`,
its hooks into torch besides the dispatch mode (``resize_``, CUDA's counters) in :mod:`colabkit.memory_hooks`;
every name stays importable from here.

>>> import torch
>>> model = torch.nn.Linear(64, 64)
>>> opt = torch.optim.AdamW(model.parameters())
>>> with MemoryTracker(model, opt) as mt:
...     with mt.phase("forward"):
...         loss = model(torch.randn(8, 64)).square().mean()
...     with mt.phase("backward"):
...         loss.backward()
...     with mt.phase("optimizer"):
...         opt.step()
>>> r = mt.report()
>>> (r["breakdown"]["grads"], r["breakdown"]["optimizer"]) == (4 * 4160, 8 * 4160 + 8)
True
"""
from __future__ import annotations

import contextlib
import json
import pickle
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: F401

from .env import GiB, MiB, budget_bytes as _default_budget, host_ram
from .device import _HOST, _HOST_SCOPE, _PLAIN, _storages, fmt_bytes, host_side, is_host, mark_host  # noqa: F401  (host tagging: the seam's)

# What to try when a category fills memory (used by alerts and the OOM post-mortem): (plan token the device must
# take, or "cuda" for a GPU-only remedy, or None; the words said), kept where the run's device would accept them
ADVICE = {
    "params": (("lora:8", "fp16 weights via lora/qlora"), ("offload:params", "offload:params"), (None, "a smaller model")),
    "grads": (("fused-step", "fused-step (optimizer step inside backward)"), ("lora:8", "lora")),
    "optimizer": (("adamw8bit", "adamw8bit / adamw4bit / adafactor / lion"), ("offload:optimizer", "offload:optimizer")),
    "activations": (("checkpoint", "checkpoint, accum:K, compress:int8"), (None, "a smaller batch or sequence")),
    "other": (("attention:efficient", "attention:efficient"), ("fp16", "fp16"),
              ("cuda", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), (None, "a smaller batch or sequence")),
}


def advice(category: str, device: str | torch.device = "cuda") -> str:
    """What to try when ``category`` fills memory on ``device``: :data:`ADVICE`'s remedies that the device takes
    (a CPU run refuses offload and attention:efficient; its allocator has no CUDA setting).

    >>> advice("params", "cpu")
    'fp16 weights via lora/qlora, or a smaller model'
    """
    dev = torch.device(device)

    def taken(token: str | None) -> bool:
        if token is None or dev.type == "cuda":  # every remedy listed is one for a GPU
            return True
        if token == "cuda":
            return False
        try:
            Plan.parse(token).check(Context(device=dev))
        except (PlanError, ImportError):
            return False
        return True
    said = [words for token, words in ADVICE[category] if taken(token)]
    return ", ".join(said[:-1]) + (", or " if len(said) > 1 else "") + said[-1]


def tensors_in(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors reachable in nested dicts/lists/tuples and in simple objects (e.g. bitsandbytes QuantState)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 4 or obj is None or isinstance(obj, (str, int, float, bool)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, _depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors_in(v, _depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for v in vars(obj).values():
            yield from tensors_in(v, _depth + 1)


def param_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Parameters and buffers, plus quantization state attached to parameters (4-bit absmax, ...)."""
    for p in model.parameters():
        yield p
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            yield from tensors_in(qs)
    yield from model.buffers()


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Tensors an optimizer keeps between steps. Wrappers (fused-step, offload) may define
    ``state_tensors()``; plain torch/bitsandbytes optimizers keep them in ``.state``."""
    if optimizer is None:
        return
    if hasattr(optimizer, "state_tensors"):
        yield from optimizer.state_tensors()
    elif hasattr(optimizer, "state"):
        yield from tensors_in(dict(optimizer.state))


from .memory_hooks import (_ATEN_RESIZE, _RESIZING, _STORAGE_RESIZE, CudaStats, _EagerMode, _Mode,  # noqa: F401
                           _tensors_of, _watch_resizes)  # (the tracker's hooks; names kept importable from here)
from .memory_ledger import CATEGORIES, Ledger, _dead_callback, _Info  # noqa: F401
from .notices import MemoryAlert, warn
from .plan import Context, Plan, PlanError


class MemoryTracker(Ledger):
    """Context manager that measures memory by category, phase and step on any device.

    Args:
        model, optimizer: what to classify as parameters / optimizer state (optional; more can be
            added with :meth:`watch`).
        device: the device whose storages are counted (default: the model's, else cuda/cpu).
        budget_bytes: the budget for alerts and plots (default: the T4's usable memory, or the GPU's).
        alert_at: fraction of the budget that triggers a one-time warning naming the largest category.
        on_sample: called with each timeline sample (the live plot uses it): taken as a phase ends, with
            ``phase_peak``, ``categories`` (live then) and ``category_peaks`` (each one's peak in the phase).
        categories: False skips the dispatch mode (CUDA stats only; no per-op overhead).
        record_history: on CUDA, record allocator history for :meth:`snapshot`.
        alloc_round: count each storage rounded up to this many bytes (the estimator's GPU profiles).
        guard_compile: False drops torch's guard against torch.compile tracing into the dispatch mode (~5 µs an
            op): only where nothing is compiled while it tracks (the estimator's fake traces).
        warn: warn when the alert fires (False: only record it in ``alerts``; ``train()``'s end-of-step alert says it
            once, with the planner's suggestion).

    Use :meth:`phase` to label forward/backward/optimizer, :meth:`set_step` to label steps and
    :meth:`reset_peaks` to start the measured window after warm-up.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        device: str | torch.device | None = None,
        budget_bytes: int | None = None,
        alert_at: float | None = 0.9,
        on_sample: Callable[[dict], None] | None = None,
        categories: bool = True,
        record_history: bool = False,
        alloc_round: int = 1,
        warn: bool = True,
        guard_compile: bool = True,
    ):
        if device is None:
            if model is not None and any(True for _ in model.parameters()):
                device = next(model.parameters()).device
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.models = [model] if model is not None else []
        self.optimizers = [optimizer] if optimizer is not None else []
        self.budget_bytes = budget_bytes if budget_bytes is not None else _default_budget()
        self.alert_at, self.warns = alert_at, warn
        self.on_sample = on_sample
        self.categories = categories
        self.record_history = record_history and self.is_cuda
        self.guard_compile = guard_compile
        self.alloc_round = alloc_round  # round each storage up to this many bytes (CUDA allocates 512 B blocks)
        self.timeline: list[dict] = []
        self.alerts: list[str] = []
        self._lock = threading.RLock()
        self._ids: dict[int, int] = {}  # id(live storage) -> uid
        self._refs: dict[int, tuple[Any, int, int]] = {}  # id(weak ref to a storage) -> (ref, uid, id(storage))
        self._dead = _dead_callback(weakref.ref(self))
        self._infos: dict[int, _Info] = {}  # uid -> info (live, and dead ones not yet folded)
        self._uid = 0
        self._events: list[tuple[int, int]] = []  # (uid, +/- bytes) since the last fold
        self._awaiting: list[dict] = []  # samples whose phase's category peaks the next fold gives them
        self._phase = "setup"
        self._segment: str | None = None  # off until set (segment()): each phase then starts at "pre"
        self._step = 0
        self._total = 0
        self._host_total = 0
        self._phase_max = 0
        self._mode: _Mode | None = None
        self._thread = threading.get_ident()  # where the dispatch mode runs (set again on entry)
        # CUDA's peak counter only goes up until reset, so the tracker resets it at each phase entry
        # and folds it into the window's peaks and every open phase's (see _cuda_fold)
        self._cuda = CudaStats(self.device) if self.is_cuda else None
        self._cuda_peak = self._cuda_peak_reserved = 0
        self._cuda_open: list[int] = []
        self._hooks: list[Any] = []
        self._t0 = time.perf_counter()
        self._reset_window()

    # ----- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        if self.is_cuda:
            self._cuda.synchronize()
            self._cuda.reset_peak()
            self._cuda_peak = self._cuda_peak_reserved = 0
            if self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.categories:
            for m in self.models:
                self._adopt_model(m)
            self._classify()
            self._mode = (_Mode if self.guard_compile else _EagerMode)(self)
            self._mode.__enter__()
            self._thread = threading.get_ident()
            _watch_resizes(self, True)
        self._sample("setup")
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            _watch_resizes(self, False)
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._classify()
        self._fold()
        self._sample("end")
        self._settle_category_peaks()
        if self.record_history:
            # history stays on until snapshot() is called or the next tracker starts
            pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, nothing is tracked (the dispatch modes are off): work that is not the run's -- the planner's
        estimate behind an alert or a post-mortem -- stays out of its peaks.

        >>> with MemoryTracker(device="cpu") as mt:
        ...     with mt.paused():
        ...         x = torch.ones(1024)
        >>> mt.report()["tracked_peak_bytes"]
        0
        """
        if self._mode is None:
            yield
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            yield

    def watch(self, model: torch.nn.Module | None = None, optimizer: Any = None) -> "MemoryTracker":
        """Add a model or optimizer created after the tracker started (e.g. inside the block)."""
        if model is not None and all(model is not m for m in self.models):
            self.models.append(model)
            if self._mode is not None:
                self._adopt_model(model)
        if optimizer is not None and all(optimizer is not o for o in self.optimizers):
            self.optimizers.append(optimizer)
        self._classify()
        return self

    # ----- labels -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator["MemoryTracker"]:
        """Label allocations made inside the block: 'forward' ones count as activations."""
        prev, prev_segment = self._phase, self._segment
        if step is not None:
            self._step = step
        self._phase, self._phase_max = name, self._current()
        if prev_segment is not None:
            self._segment = "pre"
        if self.is_cuda:  # this phase's CUDA peak starts here, not at the last reset
            self._cuda_fold()
            self._cuda_open.append(self._cuda.allocated())
        try:
            yield self
        finally:
            self._classify()
            cuda_peak = None
            if self.is_cuda:
                self._cuda_fold()
                cuda_peak = self._cuda_open.pop()
            self._sample(name, cuda_peak)
            self._phase, self._segment = prev, prev_segment

    def segment(self, label: str | None) -> None:
        """Label allocations from now on with where they happen in the model's repeated structure (the
        estimator's traces: ``"b0"``, ``"bmid"``, ``"bN"`` for the first, a middle and the last block, ``"pre"``
        and ``"post"`` around them); ``report()["segment_peaks"]`` then gives each (phase, segment)'s peak.
        Each phase starts at ``"pre"``; None switches labelling off."""
        self._segment = label

    @property
    def current_segment(self) -> str | None:
        return self._segment

    @property
    def current_phase(self) -> str:
        """The label new allocations get now (``forward``, ``backward``, ``optimizer``, ``setup``)."""
        return self._phase

    def set_step(self, step: int) -> None:
        self._step = step
        self._fold()

    def reset_peaks(self) -> None:
        """Start the measured window now (e.g. after a warm-up step): peaks restart from what is live."""
        self._classify()
        self._fold()
        self._reset_window()
        if self.is_cuda:
            self._cuda.synchronize()
            self._cuda.reset_peak()
            now = self._cuda.allocated()
            self._cuda_peak, self._cuda_peak_reserved = now, self._cuda.reserved()
            self._cuda_open = [now for _ in self._cuda_open]

    def _cuda_fold(self) -> int:
        """Fold CUDA's peak since its last reset into the window's peaks and every open phase's, then
        reset it; returns that peak."""
        peak = self._cuda.peak()
        self._cuda_peak = max(self._cuda_peak, peak)
        self._cuda_peak_reserved = max(self._cuda_peak_reserved, self._cuda.peak_reserved())
        self._cuda_open = [max(p, peak) for p in self._cuda_open]
        self._cuda.reset_peak()
        return peak

    # ----- bookkeeping ------------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor | torch.UntypedStorage) -> bool:
        if getattr(t, "is_paged", False):  # bitsandbytes paged state: CUDA managed memory seen as a CPU tensor
            return self.is_cuda and self.device.index in (None, getattr(t, "page_deviceid", None) or 0)
        d = t.device
        return d.type == self.device.type and (self.device.index is None or d.index in (None, self.device.index))

    def _add(self, st: torch.UntypedStorage, op: str, kind: str | None = None) -> None:
        n = -(-st.nbytes() // self.alloc_round) * self.alloc_round  # alloc_round: e.g. CUDA's 512 B blocks
        if n == 0:
            return
        host = bool(_HOST) and st in _HOST  # (a WeakSet lookup makes a weak reference: skip it when empty)
        with self._lock:
            self._uid += 1
            key = self._uid
            self._ids[id(st)] = key
            self._infos[key] = _Info(n, self._phase, op, self._step, kind, host=host, segment=self._segment)
            self._events.append((key, n))
            if host:
                self._host_total += n
                n = 0
            self._total += n
            if self._total > self._phase_max:
                self._phase_max = self._total
            over = self.alert_at is not None and self._total > self.alert_at * self.budget_bytes
        # a weak reference to the storage, owned by the tracker, whose callback reaches the tracker weakly:
        # a strong one (self._free) would keep the tracker -- and through it the model and optimizer it
        # watches -- alive for as long as any tracked storage lives, i.e. forever
        ref = weakref.ref(st, self._dead)
        self._refs[id(ref)] = (ref, key, id(st))
        if over and not self.alerts:
            self._alert(self._total)

    def _resized(self, st: torch.UntypedStorage) -> None:
        """``st`` was resized in place: a tracked storage now holds its new size (0: freed; the category
        stays), an untracked one of this device that grew is a new allocation (in the tracker's thread,
        as the dispatch mode sees allocations: a mode is per thread)."""
        uid = self._ids.get(id(st))
        if uid is None:
            if st.nbytes() and self._on_device(st) and threading.get_ident() == self._thread:
                if getattr(_HOST_SCOPE, "on", False) and st.device.type == "cpu":
                    _HOST.add(st)
                self._add(st, "resize_")
            return
        n = -(-st.nbytes() // self.alloc_round) * self.alloc_round
        with self._lock:
            info = self._infos.get(uid)
            if info is None or info.dead or n == info.nbytes:
                return
            delta, info.nbytes = n - info.nbytes, n
            self._events.append((uid, delta, self._phase, self._step))  # a regrowth peaks in this phase
            if info.host:
                self._host_total += delta
                return
            self._total += delta
            if self._total > self._phase_max:
                self._phase_max = self._total
            over = self.alert_at is not None and self._total > self.alert_at * self.budget_bytes
        if over and not self.alerts:
            self._alert(self._total)

    def _mark(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        host_any = bool(_HOST)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                uid = self._ids.get(id(st))
                info = self._infos.get(uid) if uid is not None else None
                if info is None:
                    # host-side storages count on any device (pinned on CUDA)
                    if self._on_device(t) or (host_any and st in _HOST):
                        self._add(st, "pre-existing", kind)
                    continue
                if host_any and not info.host and st in _HOST:  # tagged host side after it was made
                    self._to_host(info)
                if info.kind is None or (kind == "params" and info.kind != "params"):
                    info.kind = kind

    def _adopt_model(self, model: torch.nn.Module) -> None:
        self._mark(param_tensors(model), "params")
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._grad_hook(p)))

    def _grad_hook(self, p: torch.Tensor):
        # Runs before AccumulateGrad: the incoming tensor becomes p.grad when p has none yet; when
        # accumulating into an existing .grad it is a temporary and stays "other".
        def hook(grad):
            if p.grad is None:
                self._mark([grad], "grads")
            return None

        return hook

    def _classify(self) -> None:
        if not self.categories:
            return
        for m in self.models:
            self._mark(param_tensors(m), "params")
            self._mark((p.grad for p in m.parameters() if p.grad is not None), "grads")
        for o in self.optimizers:
            self._mark(optimizer_tensors(o), "optimizer")

    def _current(self) -> int:
        if self.is_cuda and not self.categories:
            return self._cuda.allocated()
        return self._total

    # ----- samples, alerts ---------------------------------------------------------------------
    def _sample(self, phase: str, cuda_peak: int | None = None) -> dict:
        cats = self.current()
        with self._lock:
            now, pmax = self._current(), max(self._phase_max, self._current())
        s = {
            "t": time.perf_counter() - self._t0,
            "step": self._step,
            "phase": phase,
            "allocated": now,
            "phase_peak": pmax,
            "categories": cats if self.categories else None,
            "reserved": None,
            "host_rss": host_ram()["rss"],
        }
        if self.is_cuda:  # phase_peak_cuda: this phase's peak (a sample outside phases: since the last one)
            s["allocated_cuda"] = self._cuda.allocated()
            s["reserved"] = self._cuda.reserved()
            s["phase_peak_cuda"] = cuda_peak if cuda_peak is not None else self._cuda_fold()
        if self.categories:  # each category's peak within the phase, once replayed; it started from the last sample
            self._await_category_peaks(s, self.timeline[-1]["categories"] if self.timeline else None)
        self._phase_max = now
        self.timeline.append(s)
        if self.alert_at is not None and not self.alerts and (reached := max(pmax, s.get("allocated_cuda") or 0)) > self.alert_at * self.budget_bytes:
            self._alert(reached)
        if self.on_sample is not None:
            self.on_sample(s)
        return s

    def _alert(self, reached: int) -> None:
        cats = self.current()
        top = max(cats, key=cats.get)
        msg = (
            f"colabkit: memory reached {fmt_bytes(reached)}, {reached / self.budget_bytes:.0%} of the budget "
            f"({fmt_bytes(self.budget_bytes)}; alert at {self.alert_at:.0%}); largest category: {top} "
            f"({fmt_bytes(cats[top])}). Try: {advice(top, self.device)}."
        )
        self.alerts.append(msg)
        if self.warns:
            warn(msg, MemoryAlert)

    # ----- results -----------------------------------------------------------------------------
    def table(self) -> str:
        """The report as a readable table."""
        return format_report(self.report())

    def snapshot(self, path: str) -> str:
        """Save a memory snapshot. On CUDA: the allocator history (open it at pytorch.org/memory_viz,
        or call :func:`show_snapshot`); elsewhere: the live storages with category, phase and op."""
        if self.is_cuda and self.record_history:
            torch.cuda.memory._dump_snapshot(path)
            return path
        with self._lock:
            rows = sorted(
                ({"bytes": i.nbytes, "category": i.category, "phase": i.phase, "op": i.op, "step": i.step}
                 for i in self._live_infos()),
                key=lambda r: -r["bytes"],
            )
        with open(path, "w") as f:
            json.dump({"device": str(self.device), "live": rows, "timeline": self.timeline}, f)
        return path


def format_report(r: dict[str, Any]) -> str:
    """A table of one report (or bench record): each category's peak and its share."""
    lines = [f"peak {fmt_bytes(r['peak_bytes'])}" + (f"  (reserved {fmt_bytes(r.get('peak_reserved_bytes'))})" if r.get("peak_reserved_bytes") else "")]
    if r.get("breakdown"):
        lines.append(f"{'category':<12} {'own peak':>12} {'at peak':>12}")
        at = r.get("at_peak") or {}
        for c in CATEGORIES:
            lines.append(f"{c:<12} {fmt_bytes(r['breakdown'][c]):>12} {fmt_bytes(at.get(c)):>12}")
    if r.get("host_bytes"):
        hb = r.get("host_breakdown") or {}
        lines.append(f"host side {fmt_bytes(r['host_bytes'])}: " + ", ".join(f"{c} {fmt_bytes(v)}" for c, v in hb.items() if v))
    return "\n".join(lines)


class _DataUnpickler(pickle.Unpickler):
    """Reads a pickle of plain data only (dicts, lists, strings, numbers: what CUDA's allocator snapshot
    holds); a file that asks to import anything -- the way a pickle runs code -- is refused."""

    def find_class(self, module: str, name: str):
        raise ValueError(f"refused: this snapshot asks to load {module}.{name}; a memory snapshot holds plain data "
                         "only, so the file was altered or is not a snapshot (loading it could run code)")


def show_snapshot(path: str):
    """Inline view of a snapshot: the CUDA allocator trace as HTML, or the top live storages as a table.
    A CUDA snapshot (a pickle) is read as plain data only: one that would import anything is refused, so
    opening a snapshot someone shared never runs code."""
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        lines = [f"{'bytes':>12} {'category':<12} {'phase':<10} op"]
        for r in data["live"][:15]:
            lines.append(f"{fmt_bytes(r['bytes']):>12} {r['category']:<12} {r['phase']:<10} {r['op']}")
        return "\n".join(lines)
    from torch.cuda import _memory_viz

    with open(path, "rb") as f:
        snap = _DataUnpickler(f).load()
    html = _memory_viz.trace_plot(snap)
    try:
        from IPython.display import HTML

        return HTML(html)
    except ImportError:
        return html

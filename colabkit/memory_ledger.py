"""The tracker's ledger: every tracked storage (its size, the phase and step that made it, its category
once known), the log of allocations and frees since the last fold, and the replay of that log into the
measured window's peaks -- the total's, each category's own, and per phase -- with the categories the
storages finally turned out to have. :class:`colabkit.memory.MemoryTracker` is a :class:`Ledger`: it
records into it (``_add``, ``_resized``, ``_mark``) and supplies ``_classify()`` and the CUDA counters
that :meth:`Ledger.report` reads.

>>> _Info(512, "forward", "mm", 0).category, _Info(512, "backward", "mm", 0).category
('activations', 'other')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


@dataclass(slots=True)
class _Info:
    nbytes: int
    phase: str
    op: str
    step: int
    kind: str | None = None  # params/grads/optimizer once known; None -> decided by phase
    dead: bool = False
    host: bool = False  # host side (offload): counted in host_bytes, not the device's peak
    segment: str | None = None  # where in the model's repeated structure it was made (``MemoryTracker.segment``)

    @property
    def category(self) -> str:
        if self.kind:
            return self.kind
        return "activations" if self.phase == "forward" else "other"


def _dead_callback(tracker_ref: "weakref.ref[MemoryTracker]") -> Callable[[Any], None]:
    """The callback of the weak references to tracked storages: the storage ``ref`` pointed to is freed."""
    def dead(ref: Any) -> None:
        tracker = tracker_ref()
        if tracker is not None:
            entry = tracker._refs.pop(id(ref), None)
            if entry is not None:
                tracker._free(entry[1], entry[2])
    return dead


class Ledger:
    """Peaks and live bytes from the storages the tracker recorded; the state is set up by
    ``MemoryTracker.__init__`` (``_infos``, ``_events``, ``_lock``, running totals) and
    :meth:`_reset_window`."""

    def _free(self, key: int, sid: int) -> None:
        with self._lock:
            info = self._infos.get(key)
            if info is None or info.dead:
                return
            info.dead = True
            if self._ids.get(sid) == key:
                del self._ids[sid]
            self._events.append((key, -info.nbytes))
            if info.host:
                self._host_total -= info.nbytes
            else:
                self._total -= info.nbytes
            if len(self._events) > 200_000:  # bound the log in long runs without step labels
                self._fold()

    def _to_host(self, info: _Info) -> None:
        with self._lock:
            info.host = True  # its logged events replay on the host side at the next fold
            if not info.dead:
                self._total -= info.nbytes
                self._host_total += info.nbytes

    def _reset_window(self) -> None:
        with self._lock:
            cats = dict.fromkeys(CATEGORIES, 0)
            hcats = dict.fromkeys(CATEGORIES, 0)
            for info in self._live_infos():
                (hcats if info.host else cats)[info.category] += info.nbytes
            self._host_now, self._host_cat_peak = hcats, dict(hcats)
            self._host_peak = sum(hcats.values())
            self._window_start = dict(cats)
            self._cat_now = cats
            self._cat_peak = dict(cats)
            # each (step, phase)'s own category peaks, replayed with final categories at the folds; the
            # samples of that phase receive them then (a fold only at step boundaries: a phase's tensors are
            # categorised by what they turn out to be, e.g. a fresh gradient copied into DDP's bucket)
            self._step_phase_own: dict[tuple[int, str], dict[str, int]] = {}
            self._peak = sum(cats.values())
            self._at_peak = dict(cats)
            self._phase_at_peak = self._phase
            self._step_at_peak = self._step
            # per phase of allocation: the total's peak, the categories then, and each category's own peak
            self._phase_peaks: dict[str, dict[str, Any]] = {}
            # per (phase, segment): the total's peak and the categories then (only where segments are labelled)
            self._segment_peaks: dict[tuple[str, str], dict[str, Any]] = {}

    def _fold(self) -> None:
        """Replay pending events with final categories into the running peaks, then drop them."""
        with self._lock:
            events, self._events = self._events, []
            cats, total = self._cat_now, sum(self._cat_now.values())
            hcats, htotal = self._host_now, sum(self._host_now.values())
            dead = []
            for ev in events:  # (uid, bytes), or (uid, bytes, phase, step) for a resize: when it happened
                key, delta = ev[0], ev[1]
                info = self._infos[key]
                if info.host:  # the host side keeps its own peaks
                    c = info.category
                    hcats[c] += delta
                    htotal += delta
                    self._host_cat_peak[c] = max(self._host_cat_peak[c], hcats[c])
                    self._host_peak = max(self._host_peak, htotal)
                    if info.dead:  # (a storage resized smaller is still alive)
                        dead.append(key)
                    continue
                cats[info.category] += delta
                total += delta
                if delta > 0:
                    c = info.category
                    if cats[c] > self._cat_peak[c]:
                        self._cat_peak[c] = cats[c]
                    phase, step = (ev[2], ev[3]) if len(ev) > 2 else (info.phase, info.step)
                    spo = self._step_phase_own.setdefault((step, phase), dict(cats))
                    if cats[c] > spo[c]:
                        spo[c] = cats[c]
                    if total > self._peak:
                        self._peak, self._at_peak = total, dict(cats)
                        self._phase_at_peak, self._step_at_peak = phase, step
                    pp = self._phase_peaks.get(phase)
                    if pp is None:
                        pp = self._phase_peaks[phase] = {"peak": 0, "at_peak": dict(cats), "own": dict(cats)}
                    if total > pp["peak"]:
                        pp["peak"], pp["at_peak"] = total, dict(cats)
                    own = pp["own"]  # each category's largest value during the phase (also what it carries in)
                    for k, v in cats.items():
                        if v > own[k]:
                            own[k] = v
                    if info.segment is not None:
                        sp = self._segment_peaks.setdefault((phase, info.segment), {"peak": 0, "at_peak": None})
                        if total > sp["peak"]:
                            sp["peak"], sp["at_peak"] = total, dict(cats)
                elif info.dead:  # (a storage resized smaller is still alive)
                    dead.append(key)
            for key in dead:
                self._infos.pop(key, None)
            self._give_category_peaks()

    def _await_category_peaks(self, sample: dict[str, Any], carried_in: dict[str, int] | None) -> None:
        """``sample["category_peaks"]`` (each category's peak within the phase the sample closes, ``other``
        included) is filled in at the fold that replays that phase's events with their final categories;
        until then it is None (a live plot shows the sample's end-of-phase ``categories``). ``carried_in``:
        the categories the phase started with (the previous sample's), its peak where it allocated nothing."""
        sample["category_peaks"] = None
        with self._lock:
            self._awaiting.append((sample, carried_in or sample.get("categories") or {}))

    def _give_category_peaks(self, final: bool = False) -> None:
        # under self._lock, at the end of a fold: the samples of earlier steps (all of them when ``final``)
        # are settled; the current step's may still allocate in their phase (accumulation re-enters it)
        keep = []
        for s, carried in self._awaiting:
            own = self._step_phase_own.get((s["step"], s["phase"]))
            if own is not None:
                s["category_peaks"] = {c: max(v, carried.get(c, 0)) for c, v in own.items()}
            if s["step"] >= self._step and not final:
                keep.append((s, carried))
            elif own is None:  # nothing allocated in that phase: its peak is what it carried in
                s["category_peaks"] = dict(carried)
        self._awaiting = keep
        oldest = min((s["step"] for s, _ in keep), default=self._step)
        for k in [k for k in self._step_phase_own if k[0] < oldest]:
            del self._step_phase_own[k]

    def _settle_category_peaks(self) -> None:
        """At the end of tracking: every sample's phase is over."""
        self._fold()
        with self._lock:
            self._give_category_peaks(final=True)

    def current(self) -> dict[str, int]:
        """Bytes live now, by category."""
        cats = dict.fromkeys(CATEGORIES, 0)
        with self._lock:
            for info in self._live_infos():
                if not info.host:
                    cats[info.category] += info.nbytes
        return cats

    def host_current(self) -> dict[str, int]:
        """Host-side bytes live now, by category (offload: pinned on CUDA, simulated on a CPU)."""
        cats = dict.fromkeys(CATEGORIES, 0)
        with self._lock:
            for info in self._live_infos():
                if info.host:
                    cats[info.category] += info.nbytes
        return cats

    def _live_infos(self) -> list[_Info]:
        return [i for i in self._infos.values() if not i.dead]

    def report(self) -> dict[str, Any]:
        """Peaks over the measured window: ``peak_bytes`` (CUDA: max_memory_allocated), each
        category's own peak in ``breakdown``, the categories at the total's peak in ``at_peak``."""
        self._classify()
        self._fold()
        r: dict[str, Any] = {
            "device": str(self.device),
            "peak_bytes": self._peak,
            "tracked_peak_bytes": self._peak,
            "breakdown": dict(self._cat_peak),
            "at_peak": dict(self._at_peak),
            "peak_phase": self._phase_at_peak,
            "peak_step": self._step_at_peak,
            "phase_peaks": {p: {"peak": v["peak"], "at_peak": dict(v["at_peak"]), "own": dict(v["own"])}
                            for p, v in self._phase_peaks.items()},
            "budget_bytes": self.budget_bytes,
            "alerts": list(self.alerts),
            "host_rss_peak": max((s["host_rss"] or 0) for s in self.timeline) if self.timeline else None,
            "host_bytes": self._host_peak,  # host side (offload), each category's peak below
            "host_breakdown": dict(self._host_cat_peak),
        }
        if self._segment_peaks:  # {phase: {segment: {"peak", "at_peak"}}}
            seg: dict[str, dict[str, Any]] = {}
            for (p, g), v in self._segment_peaks.items():
                seg.setdefault(p, {})[g] = {"peak": v["peak"], "at_peak": dict(v["at_peak"])}
            r["segment_peaks"] = seg
        if self.is_cuda:  # max_memory_allocated over the window, folded across the per-phase resets
            self._cuda_fold()
            r["peak_bytes"] = self._cuda_peak
            r["peak_reserved_bytes"] = self._cuda_peak_reserved
            r["device_used_bytes"] = self._cuda.used()  # NVML
        if not self.categories:
            r["breakdown"] = r["at_peak"] = r["host_breakdown"] = None
            r["tracked_peak_bytes"] = r["host_bytes"] = None
        return r

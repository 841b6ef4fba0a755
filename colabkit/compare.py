"""Measure several plans on the same model and put them side by side, relative to the first, and
next to what the estimator predicts for the real size on a T4.

>>> recs = compare("gpt-tiny", ["baseline"], batch=2, seq=16, steps=1)
>>> "baseline" in comparison_table(recs)
True
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Sequence

import torch

from .data import TextData
from .estimate import estimate
from .memory import CATEGORIES, fmt_bytes
from .plan import PlanError, plain_words
from .timing import Timing, interleaved, untracked_time
from .train import measure
from .trainer import Trainer, _device, load_model


def compare(model: Any, plans: Sequence[str], batch: int = 8, seq: int = 128, steps: int = 2,
            device: str | None = None, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """One :func:`colabkit.measure` record per plan, same model, data and seed."""
    return [measure(model, p, batch=batch, seq=seq, steps=steps, device=device, seed=seed, **kwargs) for p in plans]


def step_times(model: Any, plans: Sequence[str], batch: int = 8, seq: int = 128, device: str | None = None,
               warmup: int = 1, repeats: int = 5, seed: int = 0, lr: float = 3e-4,
               offload_sim: bool = False) -> dict[str, Timing]:
    """Seconds per optimizer step of each plan, untracked and interleaved (:mod:`colabkit.timing`).

    ``model`` is a name or a function returning a model; one Trainer per plan is built from the same
    seed and each timed round steps every plan once on the same batch, so load on the machine hits all
    plans alike. All trainers are alive at once: time at sizes where they fit together.

    >>> t = step_times("gpt-tiny", ["baseline", "accum:2"], batch=2, seq=16, repeats=2, device="cpu")
    >>> sorted(t), t["baseline"].repeats
    (['accum:2', 'baseline'], 2)
    """
    dev = _device(device)
    x, y = TextData().batch(batch, seq, step=0, seed=seed, device=dev)
    trainers = {}
    for p in plans:
        torch.manual_seed(seed)
        m = load_model(model, p, seq=seq, device=dev) if isinstance(model, str) else model()
        trainers[p] = Trainer(m, p, device=dev, lr=lr, offload_sim=offload_sim)
    return interleaved({p: (lambda t=t: t.step(x, y)) for p, t in trainers.items()},
                       warmup=warmup, repeats=repeats, device=dev)


def comparison_table(records: Sequence[dict[str, Any]]) -> str:
    """Peak, each category, step time and loss, with ratios to the first record."""
    base = records[0]
    head = f"{'plan':<30} {'peak':>10} {'x base':>7} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'step s':>7} {'loss':>7}"
    lines = [head]
    for r in records:
        if not r["ok"]:
            lines.append(f"{r['plan']:<30} refused/failed: {r['error']}")
            continue
        ratio = r["peak_bytes"] / base["peak_bytes"] if base.get("ok") else float("nan")
        cats = " ".join(f"{fmt_bytes(r['breakdown'][c]):>11}" for c in CATEGORIES)
        lines.append(f"{r['plan']:<30} {fmt_bytes(r['peak_bytes']):>10} {ratio:>7.2f} {cats} {untracked_time(r):>7} {r['loss']:>7.4f}")
    lines.append("step s: untracked steps after the measured ones (-: not timed, as on a CPU, where the tracker "
                 "slows each op); speed between plans: step_times (untracked, warmed up, interleaved)")
    return "\n".join(lines)


def _plain_error(error: str | None) -> str | None:
    """A refusal shown to a learner: in plain words (no sm75, no emulation), without the exception's class name."""
    return None if error is None else plain_words(error).removeprefix("PlanError: ")


def side_by_side(records: Sequence[dict[str, Any]], model: str, batch: int, seq: int,
                 gpu: str = "t4", world_size: int = 1) -> list[dict[str, Any]]:
    """Each measured plan next to what it would be at the real size: the estimator's prediction for
    ``model`` at ``batch`` x ``seq`` on the ``gpu`` profile, and the textbook formula at that size.
    A sharded plan (``zero:N``) is predicted per GPU of ``world_size`` such GPUs sharing ``batch``.

    Smoke mode shrinks what is *measured*, never what is *predicted*: the prediction is a fake-tensor
    trace (nothing allocated), so a CPU answers for a T4-sized run in about a second per plan.

    >>> rows = side_by_side(compare("gpt-tiny", ["baseline"], batch=2, seq=16, steps=1), "gpt2-124m", 1, 256)
    >>> rows[0]["predicted_bytes"] > rows[0]["measured_bytes"], rows[0]["formula_bytes"] > 0
    (True, True)
    """
    rows = []
    for r in records:
        ws = world_size if "zero" in str(r["plan"]) else 1
        row = {"plan": r["plan"], "measured_bytes": r.get("peak_bytes") if r.get("ok") else None,
               "measured_on": f"{r.get('model')}, {r.get('batch')}x{r.get('seq')}, {r.get('device')}",
               "predicted_bytes": None, "formula_bytes": None, "verdict": None,
               "predicted_for": f"{model}, {batch}x{seq}, {gpu}", "error": _plain_error(r.get("error"))}
        try:
            est = estimate(model, r["plan"], batch=batch, seq=seq, gpu=gpu, world_size=ws)
            row.update(predicted_bytes=est["peak_bytes"], verdict=est["verdict"],
                       formula_bytes=int(est["analytic"]["total"]) if "analytic" in est else None,
                       why=formula_gap(est, str(r["plan"])))
        except (PlanError, ValueError) as e:
            row["error"] = row["error"] or _plain_error(str(e))
        rows.append(row)
    return rows


# What the textbook formula leaves out for a token (it knows precision, checkpointing, the optimizer, offload rules)
FORMULA_MISSES = {
    "compress": "it counts the saved activations at full width (it has no int8 compression)",
    "lora": "it has no adapters: every weight counts as trained", "qlora": "it has no 4-bit base: every weight counts as trained",
    "zero": "it is the single-GPU formula (no sharding)",
    "attention": "its attention term is Korthikanti et al.'s (5·a·s/h per layer for math, none for a fused kernel), "
                 "not what torch's backend keeps",
}
GAP = 0.10   # formula vs estimate: beyond this a sentence says why


def formula_gap(est: dict[str, Any], plan: str) -> str | None:
    """Why the textbook formula (``est["analytic"]``) and colabkit's estimate of the peak differ by more than
    :data:`GAP`, from the estimate's own figures: the category where they differ most, and what the formula
    leaves out for the plan's tokens. None when they agree within it.

    >>> est = {"peak_bytes": 100, "peak_phase": "backward", "analytic": {"total": 160, "weights": 40, "grads": 40,
    ...        "optimizer": 60, "activations": 20}, "at_peak": {"params": 40, "grads": 40, "optimizer": 0,
    ...        "activations": 15, "other": 5}}
    >>> formula_gap(est, "baseline")
    'formula 60% above the estimate: it counts optimizer as 60 B, the traced peak (in backward) holds 0 B of it — the formula adds every category as if all were alive at once'
    """
    a, pred = est.get("analytic"), est.get("peak_bytes")
    if not a or not pred or abs(a["total"] / pred - 1) <= GAP:
        return None
    at = est["at_peak"]
    formula = {"params": a["weights"], "grads": a["grads"], "optimizer": a["optimizer"], "activations": a["activations"]}
    traced = {"params": at["params"], "grads": at["grads"], "optimizer": at["optimizer"],
              "activations": at["activations"] + at["other"]}   # the formula's activations include the logits
    c = max(formula, key=lambda k: abs(formula[k] - traced[k]))
    why = (f"formula {abs(a['total'] / pred - 1):.0%} {'above' if a['total'] > pred else 'below'} the estimate: it counts "
           f"{c} as {fmt_bytes(formula[c])}, the traced peak (in {est.get('peak_phase')}) holds {fmt_bytes(traced[c])} of it")
    if formula[c] > traced[c]:
        why += " — the formula adds every category as if all were alive at once"
    misses = [m for tok, m in FORMULA_MISSES.items() if tok in plan]
    return why + ("; " + "; ".join(misses) if misses else "")


def side_by_side_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`side_by_side` rows as a table whose headers say where each column comes from; where the formula
    and the estimate differ by more than :data:`GAP`, a line under the table says why (:func:`formula_gap`)."""
    if not rows:
        return ""
    gpu = rows[0]["predicted_for"].rsplit(", ", 1)[-1].upper()
    lines = [f"{'plan':<28} {'measured here':>14} {'estimate ' + gpu:>14} {'formula':>12}  verdict"]
    for r in rows:
        lines.append(f"{r['plan']:<28} {fmt_bytes(r['measured_bytes']):>14} {fmt_bytes(r['predicted_bytes']):>14} "
                     f"{fmt_bytes(r['formula_bytes']):>12}  {r['verdict'] or r['error'] or ''}")
    lines.append(f"measured: {rows[0]['measured_on']}; estimate and formula: {rows[0]['predicted_for']} "
                 "(predictions, nothing allocated)")
    lines.append("estimate: colabkit's trace of one step, its peak moment; formula: the textbook sum (bytes per "
                 "parameter + Korthikanti et al.'s activations)")
    lines += [f"why {r['plan']}: {r['why']}" for r in rows if r.get("why")]
    return "\n".join(lines)


# ---- notebooks 07-13 ----
@contextlib.contextmanager
def _fd2_silenced():
    """torch.profiler's C++ side writes "profiler_start"/"profiler_stop" lines straight to file descriptor 2,
    which a notebook shows in the cell: point fd 2 at /dev/null meanwhile (Python's sys.stderr is untouched,
    and an exception raised inside still propagates)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tracker_vs_allocator(make_model: Any, plan: str = "baseline", batch: int = 4, seq: int = 64, steps: int = 2,
                         outside: int = 0) -> tuple[int, int]:
    """``(tracker's peak, allocator's peak)`` in bytes for ``steps`` CPU training steps of ``make_model()``
    under ``plan`` (:func:`peaks_vs_allocator`).

    >>> from colabkit.models import build_model
    >>> tracked, alloc = tracker_vs_allocator(lambda: build_model("gpt:1x32"), steps=1, batch=2, seq=16)
    >>> abs(tracked - alloc) <= 0.02 * alloc
    True
    """
    x = torch.randint(0, 256, (batch, seq))

    def work(tracker: Any) -> None:
        trainer = Trainer(make_model(), plan, device="cpu", tracker=tracker)
        for i in range(steps):
            tracker.set_step(i)
            trainer.step(x, x)

    return peaks_vs_allocator(work, outside=outside)


def peaks_vs_allocator(work: Any, outside: int = 0) -> tuple[int, int]:
    """``(tracker's peak, allocator's peak)`` in bytes of ``work(tracker)`` on the CPU, both windows opening
    on nothing: the allocator's is torch's own accounting, the running sum of ``torch.profiler``'s
    ``[memory]`` events (:func:`colabkit.estimate.calibrate.allocator_peak`), an independent check of the
    tracker. Garbage of earlier work collected *inside* the window would show as frees of memory the
    profiler never saw allocated, so the cyclic GC runs first and is paused meanwhile. ``outside`` bytes
    are allocated after the tracker closed (a negative control).

    >>> def work(tracker):  # 4 KB freed in place, 2 KB, the 4 KB storage re-allocated at 8 KB
    ...     a = torch.empty(1024); a.untyped_storage().resize_(0); b = torch.empty(512)
    ...     a.untyped_storage().resize_(8192)
    >>> peaks_vs_allocator(work)
    (10240, 10240)
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    from .estimate.calibrate import allocator_peak
    from .memory import MemoryTracker

    tracker = MemoryTracker(device="cpu", alert_at=None, budget_bytes=1 << 62)
    gc.collect()
    gc.disable()
    try:
        with _fd2_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with tracker:
                work(tracker)
            extra = torch.empty(outside, dtype=torch.uint8) if outside else None  # noqa: F841
    finally:
        gc.enable()
    return tracker.report()["peak_bytes"], allocator_peak(prof)

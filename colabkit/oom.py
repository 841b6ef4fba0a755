"""OOM post-mortem: when a CUDA out-of-memory happens, free what can be freed, save a snapshot, show
what filled memory by category, and suggest the cheapest plan the planner says fits.

``train`` runs its steps inside :func:`oom_guard`; wrap your own code the same way:

>>> with oom_guard(reraise=False, verbose=False) as pm:
...     raise torch.OutOfMemoryError("CUDA out of memory (injected)")
>>> pm.caught, sorted(pm.report["at_oom"]) == sorted(CATEGORIES)
(True, True)
"""
from __future__ import annotations

import contextlib
import contextvars
import gc
import os
import tempfile
import traceback
from typing import Any, Callable, Iterator

import torch

from .callbacks import Callback, Run
from .memory import CATEGORIES, MemoryTracker, advice, fmt_bytes


class OutOfMemoryWithAdvice(torch.OutOfMemoryError):
    """The original OOM, with the post-mortem (``.postmortem``) in its message and as a dict."""

    def __init__(self, message: str, postmortem: dict[str, Any]):
        super().__init__(message)
        self.postmortem = postmortem


class PostMortem:
    """What :func:`oom_guard` found: ``caught``, and ``report`` (by category, snapshot, suggestion)."""

    def __init__(self):
        self.caught = False
        self.report: dict[str, Any] = {}

    def text(self) -> str:
        r = self.report
        if not r:
            return "no out-of-memory"
        lines = [f"colabkit: out of memory ({r['error']})", f"{'category':<12} {'live at OOM':>12}"]
        lines += [f"{c:<12} {fmt_bytes(r['at_oom'][c]):>12}" for c in CATEGORIES]
        lines.append(f"largest: {r['largest']}. Try: {advice(r['largest'], r.get('device', 'cuda'))}")
        lines.append(f"freed {fmt_bytes(r['freed_bytes'])}; snapshot: {r['snapshot']}")
        if r.get("suggestion"):
            s = r["suggestion"]
            lines.append(f"cheapest plan that fits (planner): {s['plan']} — predicted peak {fmt_bytes(s['peak_bytes'])}, "
                         f"step-time overhead {s['overhead']:+.0%}")
        elif r.get("suggestion_error"):
            lines.append(f"no plan suggestion: {r['suggestion_error']}")
        return "\n".join(lines)


# The planner lives above the train loop; it registers itself here when colabkit is imported, so the
# guard can suggest a plan without importing a layer above it. ``suggest(model, batch, seq, gpu=...,
# budget_bytes=...) -> {"plan", "peak_bytes", "overhead", "breakdown"} | None``.
_SUGGESTER: Callable[..., dict[str, Any] | None] | None = None


def register_suggester(fn: Callable[..., dict[str, Any] | None] | None) -> None:
    """Install the function the guard asks for the cheapest plan that fits (the planner's ``suggest``)."""
    global _SUGGESTER
    _SUGGESTER = fn


# The RuntimeError forms an out-of-memory takes besides torch.OutOfMemoryError (the same strings
# accelerate.utils.memory.should_reduce_batch_size matches).
OOM_MESSAGES = (" out of memory", "CUDA out of memory", "DefaultCPUAllocator: can't allocate memory",
                "MPS backend out of memory")


def is_oom(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and the RuntimeError forms of an out-of-memory.

    >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")), is_oom(ValueError("x"))
    (True, False)
    """
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OOM_MESSAGES)


def free_after_oom(trainer: Any = None, err: BaseException | None = None) -> None:
    """Free what a failed step held: its frames' locals (activations), gradients, cached blocks."""
    if err is not None:
        traceback.clear_frames(err.__traceback__)
    if trainer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# set while plan="auto" trains its chosen plan (estimate.auto.run_ranked): the plan was the planner's own answer
AUTO_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("colabkit_auto_choice", default=None)


def own_model_tip(device: Any) -> str:
    """What is said instead of a plan when the run's model has no name the planner can build (the user's own
    module): where to ask, for this run's device -- or, in a run of ``plan="auto"``, what its choice rested on.

    >>> own_model_tip("cpu").endswith("budget_bytes=..., device='cpu'), or train with plan='auto'")
    True
    >>> t = AUTO_CHOICE.set("auto: checkpoint"); own_model_tip("cpu").startswith("plan='auto' chose this plan")
    True
    >>> AUTO_CHOICE.reset(t)
    """
    if (why := AUTO_CHOICE.get()) is not None:
        return (f"plan='auto' chose this plan as the fastest predicted to fit the budget ({why.removeprefix('auto: ')}): "
                "to leave more room give a smaller budget_bytes, or a smaller batch or sequence")
    where = "device='cpu'" if torch.device(device or "cpu").type == "cpu" else "gpu='t4' (or your GPU's profile)"
    return ("the planner is asked about a model by name during a run (a preset, gpt:LxD, hf:<id>): for your own "
            f"model ask colabkit.choose_plan(build, inputs=first_batch, budget_bytes=..., {where}), or train with "
            "plan='auto'")


def suggest_plan(model: Any, batch: int, seq: int, **kw: Any) -> dict[str, Any] | None:
    """The registered planner's cheapest plan that fits (None without a planner or when none fits)."""
    if _SUGGESTER is None or model is None:
        return None
    return _SUGGESTER(model, batch, seq, **kw)


@contextlib.contextmanager
def oom_guard(tracker: MemoryTracker | None = None, model: str | Any = None, batch: int | None = None,
              seq: int | None = None, plan: str | None = None, trainer: Any = None, gpu: str | None = "t4",
              snapshot_dir: str | None = None, reraise: bool = True, candidates: list[str] | None = None,
              verbose: bool = True) -> Iterator[PostMortem]:
    """Catch ``torch.OutOfMemoryError`` in the block and write a post-mortem.

    With a running ``tracker`` the categories are what it sees live at the OOM; without one, a tracker
    is started around the block. With ``model``/``batch``/``seq`` the planner suggests a plan that fits
    the tracker's budget. ``reraise`` raises :class:`OutOfMemoryWithAdvice` (an OutOfMemoryError).
    """
    pm = PostMortem()
    own = tracker is None
    ctx = MemoryTracker(alert_at=None) if own else contextlib.nullcontext(tracker)
    tr: MemoryTracker
    with contextlib.ExitStack() as stack:
        tr = stack.enter_context(ctx)
        try:
            yield pm
            return
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if isinstance(err, OutOfMemoryWithAdvice) or not is_oom(err):
                raise
            error = str(err).splitlines()[0] if str(err) else "out of memory"
            at_oom = tr.current()  # while the failed step's frames (and their tensors) are still alive
            path = os.path.join(snapshot_dir or tempfile.gettempdir(),
                                "colabkit-oom-snapshot" + (".pickle" if tr.is_cuda and tr.record_history else ".json"))
            tr.snapshot(path)
            # the failed step's frames hold its activations: clear their locals so they can be freed
            traceback.clear_frames(err.__traceback__)
            del err
        # free: gradients of the failed step, the exception's frames, the allocator's cached blocks
        free_after_oom(trainer)
        freed = sum(at_oom.values()) - sum(tr.current().values())
        pm.caught = True
        pm.report = {"error": error, "at_oom": at_oom, "largest": max(at_oom, key=at_oom.get),
                     "snapshot": path, "freed_bytes": max(0, freed), "plan": plan, "suggestion": None,
                     "device": str(tr.device)}
    if model is not None and batch and seq and _SUGGESTER is not None:
        try:
            with tr.paused():  # the planner's own work is not the run's memory
                pm.report["suggestion"] = suggest_plan(model, batch, seq, gpu=gpu, budget_bytes=tr.budget_bytes,
                                                       candidates=candidates)
            if pm.report["suggestion"] is None:
                pm.report["suggestion_error"] = "no candidate plan fits: use a smaller batch, sequence or model"
        except Exception as e:  # noqa: BLE001  (a suggestion must never hide the OOM itself)
            pm.report["suggestion_error"] = f"{type(e).__name__}: {e}"
    elif pm.caught and model is None and batch and seq:  # a run of the user's own model: where to ask
        pm.report["suggestion_error"] = own_model_tip(tr.device)
    if verbose:
        print(pm.text())
    if reraise:
        raise OutOfMemoryWithAdvice(pm.text(), pm.report)


def batch_size(batch: Any) -> int:
    """Examples in a step's batch: ``(x, y)`` or a dict of tensors (dim 0 of its first tensor)."""
    tensors = batch.values() if isinstance(batch, dict) else batch
    return next(t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.ndim)


class OOMHandling(Callback):
    """What the train loop does when a step runs out of memory.

    ``on_oom="shrink"``: free the failed step, halve the micro-batch at least, into equal parts (the accumulation
    the smallest divisor of the batch at least twice the current one: 8 -> 4 -> 2 -> 1, 6 -> 3 -> 1; same
    effective batch, same normalisation by the window's tokens) and retry the same data from the same RNG
    state, until one sequence per micro-batch. Otherwise (``"stop"``, or a shrink that cannot go further):
    with a tracker, the post-mortem (:func:`oom_guard`: freed, snapshot saved, categories shown, a plan that
    fits suggested), ``on_oom`` fired with ``recovered: False`` (checkpointing saves the state before the
    step), and the error raised. Other errors pass untouched.

    >>> OOMHandling("shrink").mode
    'shrink'
    """

    def __init__(self, mode: str = "stop"):
        self.mode = mode  # train(on_oom=...): "shrink" or "stop"

    def step(self, trainer: Any, batch: Any, run: Run) -> float:
        """One optimizer step of ``trainer`` on ``batch`` (``(x, y)`` or a dict) under this handling."""
        guard = oom_guard(run.tracker, model=run.model_name, batch=run.batch, seq=run.seq, plan=str(trainer.plan),
                          trainer=trainer, gpu=run.gpu) if run.tracker is not None else contextlib.nullcontext()
        try:
            with guard:
                return self._shrinking(trainer, batch, run)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if is_oom(e):
                run.fire("on_oom", {"step": trainer.step_count + 1, "error": e, "recovered": False, "shrink": None})
            raise

    def _shrinking(self, trainer: Any, batch: Any, run: Run) -> float:
        size = batch_size(batch)
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        while True:
            try:
                return trainer.step(*batch) if isinstance(batch, tuple) else trainer.step(batch)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                k = trainer.accum
                # at least halve the micro-batch, into equal parts: the smallest divisor of the batch >= 2k (6: 6 -> 3 -> 1)
                to = next((d for d in range(2 * k, size + 1) if size % d == 0), None)
                if self.mode != "shrink" or not is_oom(err) or to is None:
                    raise
                free_after_oom(trainer, err)
                msg = str(err).splitlines()[0] if str(err) else "out of memory"
                del err
                trainer.accum = to
                torch.set_rng_state(rng[0])
                if rng[1] is not None:
                    torch.cuda.set_rng_state_all(rng[1])
                shrink = {"step": trainer.step_count, "micro_batch": size // k, "to_micro_batch": size // to,
                          "accum": to}
                run.oom_shrinks.append(shrink)
                print(f"colabkit: out of memory at step {trainer.step_count} with micro-batch {size // k}; "
                      f"retrying with micro-batch {size // to} x accum {to} (effective batch {size})")
                run.fire("on_oom", {"step": trainer.step_count + 1, "error": msg, "recovered": True, "shrink": shrink})

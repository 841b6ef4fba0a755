"""The train loop every path uses (the CLI, ``measure``, the notebooks, the tests), above the Trainer.

:func:`train` adds progress, a tracker, a live plot, callbacks, crash-safe checkpoints and the OOM
guard around :class:`~colabkit.trainer.Trainer` steps; :func:`measure` returns one ``bench`` record.

>>> r = measure("gpt-tiny", "baseline", batch=2, seq=16, steps=1)
>>> r["ok"], r["breakdown"]["params"] == 4 * r["params"]
(True, True)
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from typing import Any, Callable, Iterable

import torch

from .data import TextData
from .memory import MemoryTracker
from .models import count_params
from .oom import oom_guard
from .plan import Plan, PlanError
from .trainer import ModelFn, Trainer, _device, load_model, weights_sha256

__all__ = ["train", "measure", "save_checkpoint", "load_checkpoint", "Trainer", "load_model", "weights_sha256"]


CKPT_NAME = "colabkit-checkpoint.pt"


def save_checkpoint(trainer: Trainer, directory: str) -> str:
    """Write the trainer's state atomically (temp file + rename): a disconnect mid-write never
    leaves a broken checkpoint behind, and the previous one stays until the new one is complete."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CKPT_NAME)
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(trainer: Trainer, directory: str) -> bool:
    """Restore the latest checkpoint in ``directory`` into ``trainer``; False if there is none."""
    path = os.path.join(directory, CKPT_NAME)
    if not os.path.exists(path):
        return False
    trainer.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
    return True


def _simulated(trainer: Trainer) -> bool:
    """True when offload ran simulated (host side and compute side both on the CPU)."""
    return bool(trainer.ctx.offload_sim and not trainer.ctx.cuda and "offload" in trainer.plan)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: torch.nn.Module | str,
    data: TextData | None = None,
    plan: Plan | str = "baseline",
    steps: int = 100,
    batch: int = 8,
    seq: int = 128,
    seed: int = 0,
    device: str | torch.device | None = None,
    lr: float = 3e-4,
    max_grad_norm: float | None = None,
    track: bool = True,
    live_plot: Any = None,
    callbacks: Iterable[Callable[[dict], Any]] = (),
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    progress: bool = True,
    eval_every: int = 0,
    offload_sim: bool = False,
) -> dict[str, Any]:
    """Train for ``steps`` optimizer steps of ``batch`` sequences (the effective batch) and return
    the loss curve, step times, memory report and a hash of the final weights.

    ``live_plot`` (a :class:`colabkit.plots.LivePlot`) is redrawn from the tracker's samples;
    callbacks get ``{"step", "loss", "step_time_s", "trainer"}`` after each step. With
    ``checkpoint_dir`` and ``checkpoint_every`` a checkpoint is written every K steps;
    ``resume=True`` continues from it, seeing the same batches an uninterrupted run would.
    ``offload_sim=True`` runs offload tokens on a CPU with a simulated host side (the result says
    ``"simulated": True``).

    >>> out = train("gpt-tiny", steps=2, batch=2, seq=16, progress=False)
    >>> len(out["losses"]), out["step"]
    (2, 2)
    """
    dev = _device(device)
    data = data or TextData()
    torch.manual_seed(seed)
    name = model if isinstance(model, str) else None
    on_sample = live_plot.update if live_plot is not None else None
    tracker = MemoryTracker(device=dev, on_sample=on_sample, categories=track) if (track or live_plot) else None
    ctx = tracker if tracker is not None else contextlib.nullcontext()
    losses, times, evals = [], [], []
    with ctx:
        if isinstance(model, str):
            model = load_model(model, plan, seq=seq, device=dev)
        trainer = Trainer(model, plan, device=dev, lr=lr, max_grad_norm=max_grad_norm, model_name=name, tracker=tracker,
                          offload_sim=offload_sim)
        if resume and checkpoint_dir and load_checkpoint(trainer, checkpoint_dir):
            print(f"colabkit: resumed from step {trainer.step_count} in {checkpoint_dir}")
        bar = range(trainer.step_count, steps)
        if progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(bar, desc=f"train {trainer.plan}", initial=trainer.step_count, total=steps)
            except ImportError:
                pass
        for step in bar:
            x, y = data.batch(batch, seq, step=step, seed=seed, device=dev)
            if tracker is not None:
                tracker.set_step(step)
            _sync(dev)
            t0 = time.perf_counter()
            # a CUDA OOM: freed, snapshot saved, categories shown, a plan that fits suggested (colabkit.oom)
            with oom_guard(tracker, model=name, batch=batch, seq=seq, plan=str(trainer.plan), trainer=trainer,
                            gpu="t4" if dev.type == "cuda" else None) if tracker is not None else contextlib.nullcontext():
                loss = trainer.step(x, y)
            _sync(dev)
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            if progress and hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss:.3f}")
            if eval_every and (step + 1) % eval_every == 0:
                ex, ey = data.batch(batch, seq, step=10**9 + step, seed=seed, device=dev)
                evals.append((step + 1, trainer.evaluate(ex, ey)))
            for cb in callbacks:
                cb({"step": step + 1, "loss": loss, "step_time_s": dt, "trainer": trainer})
            if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:
                save_checkpoint(trainer, checkpoint_dir)
    if checkpoint_dir and checkpoint_every and trainer.step_count % checkpoint_every:
        save_checkpoint(trainer, checkpoint_dir)
    return {
        "plan": str(trainer.plan),
        "step": trainer.step_count,
        "loss": losses[-1] if losses else None,
        "losses": losses,
        "evals": evals,
        "step_times": times,
        "report": tracker.report() if tracker is not None else None,
        "timeline": tracker.timeline if tracker is not None else [],
        "weights_sha256": weights_sha256(trainer.model),
        "simulated": _simulated(trainer),
        "trainer": trainer,
    }


def measure(
    model_fn: ModelFn | str,
    plan: Plan | str = "baseline",
    batch: int = 8,
    seq: int = 128,
    steps: int = 2,
    device: str | torch.device | None = None,
    seed: int = 0,
    lr: float = 3e-4,
    data: TextData | None = None,
    on_sample: Callable[[dict], None] | None = None,
    timing_steps: int | None = None,
    offload_sim: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps under the tracker and return one ``bench`` record.

    ``model_fn`` is a model name or a function returning a causal LM ((B, S) ids -> (B, S, V)
    logits, or a Hugging Face model). Errors (an OOM, a refused plan) come back as
    ``ok: False`` with the message, so a sweep goes on.

    The tracker's dispatch mode adds Python work to every op, which on a GPU is comparable to the
    kernels themselves; so on CUDA ``step_time_s`` comes from ``timing_steps`` (default 2) further
    steps run without it (``step_time_tracked_s`` keeps the tracked figure). On the CPU the ops
    dominate and the tracked steps are timed (``timing_steps=0``).

    ``offload_sim=True`` runs offload tokens on a CPU with a simulated host side: the record has
    ``"simulated": True``; ``host_bytes`` / ``host_breakdown`` are the host side's peaks (pinned RAM
    on a GPU) and ``breakdown`` the device side's.
    """
    dev = _device(device)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    record: dict[str, Any] = {"plan": str(plan), "model": name, "params": None, "trainable_params": None,
                              "peak_bytes": None, "breakdown": None, "at_peak": None, "step_time_s": None,
                              "loss": None, "ok": False, "error": None, "device": str(dev),
                              "batch": batch, "seq": seq, "steps": steps, "simulated": False}
    data = data or TextData()
    tracker = MemoryTracker(device=dev, on_sample=on_sample)
    try:
        plan = Plan.parse(plan)
        record["plan"] = str(plan)
        torch.manual_seed(seed)
        with tracker:
            model = load_model(model_fn, plan, seq=seq, device=dev) if isinstance(model_fn, str) else model_fn()
            trainer = Trainer(model, plan, device=dev, lr=lr, model_name=name, tracker=tracker, offload_sim=offload_sim)
            if _simulated(trainer):
                record["simulated"] = True
                record["device"] = f"{dev} (offload simulated: compute and host side both on the CPU)"
            record["params"] = count_params(trainer.model)
            record["trainable_params"] = count_params(trainer.model, trainable_only=True)
            tracker.reset_peaks()  # the measured window: the steps, not building the model
            times = []
            for step in range(steps):
                x, y = data.batch(batch, seq, step=step, seed=seed, device=dev)
                tracker.set_step(step)
                _sync(dev)
                t0 = time.perf_counter()
                record["loss"] = trainer.step(x, y)
                _sync(dev)
                times.append(time.perf_counter() - t0)
        record.update({k: v for k, v in tracker.report().items() if k in (
            "peak_bytes", "breakdown", "at_peak", "peak_phase", "peak_reserved_bytes", "host_rss_peak",
            "host_bytes", "host_breakdown")})
        # the first step also allocates optimizer state lazily; later steps show the steady state
        record["step_time_tracked_s"] = sum(times[1:]) / (len(times) - 1) if len(times) > 1 else times[0]
        record["step_time_s"] = record["step_time_tracked_s"]
        n_timing = (2 if dev.type == "cuda" else 0) if timing_steps is None else timing_steps
        if n_timing:
            trainer.tracker = None  # the tracker has exited; these steps run at full speed
            times = []
            for step in range(steps, steps + n_timing):
                x, y = data.batch(batch, seq, step=step, seed=seed, device=dev)
                _sync(dev)
                t0 = time.perf_counter()
                trainer.step(x, y)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            record["step_time_s"] = sum(times) / len(times)
        record["ok"] = True
    except (PlanError, torch.OutOfMemoryError, RuntimeError, ValueError, ImportError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e):
            record["error"] = f"out of memory: {e}".splitlines()[0]
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return record

"""The train loop every path uses (the CLI, ``measure``, the notebooks, the tests), above the Trainer.

:func:`train` adds progress, a tracker, a live plot, callbacks, crash-safe checkpoints and the OOM
guard around :class:`~colabkit.trainer.Trainer` steps; :func:`measure` returns one ``bench`` record.

>>> r = measure("gpt-tiny", "baseline", batch=2, seq=16, steps=1)
>>> r["ok"], r["breakdown"]["params"] == 4 * r["params"]
(True, True)
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Iterable

import torch

from .data import TextData
from .batches import multiple_choice
from .feed import TextFeed, feed
from .determinism import deterministic as deterministic_mode, seed_all
from .alerts import HOST_LIMIT_BYTES, MemoryAlerts
from .callbacks import LivePlotFeed, Run, as_callback
from .checkpoints import CHECKPOINT_MINUTES, Checkpointing, load_trainer, require_folder, save_trainer
from .logs import Logging
from .memory import MemoryTracker
from .models import PRESETS, count_params
from .oom import OOMHandling
from .progress import ProgressBar
from .plan import Plan, PlanError, check_batch
from .trainer import ModelFn, Trainer, _device, load_model, weights_sha256

__all__ = ["train", "measure", "save_checkpoint", "load_checkpoint", "check_run", "check_sizes", "check_device",
           "check_context", "Trainer", "load_model", "weights_sha256"]

_clock = time.monotonic  # the wall clock the checkpoint cadence reads (a test advances it)


def save_checkpoint(trainer: Trainer, directory: str, keep: int = 3, run: dict[str, Any] | None = None,
                    loss: float | None = None) -> str:
    """Write the trainer's full state to ``directory`` (streamed tensor by tensor, atomic, the last
    ``keep`` kept): see :mod:`colabkit.checkpoints`."""
    return save_trainer(trainer, directory, keep=keep, run=run, loss=loss)


def load_checkpoint(trainer: Trainer, directory: str, run: dict[str, Any] | None = None) -> bool:
    """Restore the newest valid checkpoint in ``directory`` into ``trainer``; False if there is none
    (a damaged newest one is skipped with a warning)."""
    path = load_trainer(trainer, directory, run=run, required=False)
    return path is not None


def _context_length(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for k in ("block_size", "n_positions", "max_position_embeddings"):
        v = getattr(cfg, k, None)
        if isinstance(v, int):
            return v
    return None


def check_sizes(batch: int, seq: int, steps: int) -> None:
    """Refuse a batch, sequence length or step count that is not a positive whole number.

    >>> check_sizes(-4, 16, 1)
    Traceback (most recent call last):
    ...
    ValueError: batch must be a positive whole number of sequences per step, got -4
    """
    for name, v, what in (("batch", batch, "sequences per step"), ("seq", seq, "tokens per sequence"),
                          ("steps", steps, "optimizer steps")):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive whole number of {what}, got {v!r}")


def check_device(device: str | torch.device | None) -> None:
    """Refuse ``cuda`` where torch sees no GPU, in one sentence that says what to do."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device 'cuda': torch sees no CUDA GPU on this machine (torch {torch.__version__}, {build}); "
                         "in Colab: Runtime -> Change runtime type -> T4 GPU; or run on the CPU (--device cpu)")


def check_context(name: str, seq: int) -> None:
    """Refuse a sequence longer than a preset's context (a preset is a fixed model: it is never widened;
    ``gpt:LxD`` shapes are built for the sequence asked for).

    >>> check_context("gpt-tiny", 512)
    Traceback (most recent call last):
    ...
    ValueError: seq 512 is longer than the model's context (gpt-tiny: 256 positions): use seq <= 256, or a gpt:LxD shape (built for the sequence), e.g. gpt:2x64
    """
    cfg = PRESETS.get(name)
    if cfg is not None and seq > cfg.block_size:
        shape = f"gpt:{cfg.n_layer}x{cfg.n_embd}" + (f":v{cfg.vocab_size}" if cfg.vocab_size != 256 else "")
        raise ValueError(f"seq {seq} is longer than the model's context ({name}: {cfg.block_size} positions): use seq <= "
                         f"{cfg.block_size}, or a gpt:LxD shape (built for the sequence), e.g. {shape}")


def check_run(batch: int, seq: int, steps: int, plan: Plan, on_oom: str = "stop",
              checkpoint_every: int = 0, resume: bool | str = False, checkpoint_dir: str | None = None,
              checkpoint_minutes: float | None = None) -> None:
    """Refuse bad run settings before anything is built, saying what to do.

    >>> check_run(0, 16, 1, Plan.parse("baseline"))
    Traceback (most recent call last):
    ...
    ValueError: batch must be a positive whole number of sequences per step, got 0
    """
    check_sizes(batch, seq, steps)
    check_batch(plan, batch)
    if on_oom not in ("stop", "shrink"):
        raise ValueError(f"on_oom={on_oom!r}: use 'shrink' (halve the micro-batch and retry) or 'stop'")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0 (0: by wall time, every {CHECKPOINT_MINUTES:g} min), "
                         f"got {checkpoint_every}")
    if checkpoint_minutes is not None and not checkpoint_minutes > 0:
        raise ValueError(f"checkpoint_minutes must be > 0 (minutes of wall time between checkpoints), got {checkpoint_minutes}")
    if not any(resume is v or resume == v for v in (False, True, "auto", "must")):
        raise ValueError(f"resume={resume!r}: use True or 'auto' (continue from the newest checkpoint when there is "
                         "one, start fresh otherwise), 'must' (a checkpoint must be there) or False")
    if resume and not checkpoint_dir:
        raise ValueError("resume needs checkpoint_dir (the folder the checkpoints were written to)")
    if resume == "must":
        require_folder(checkpoint_dir)


def _check_model(model: torch.nn.Module, seq: int) -> None:
    n = _context_length(model)
    if n is not None and seq > n:
        raise ValueError(f"seq {seq} is longer than the model's context ({n} positions): use seq <= {n}, "
                         f"or build the model for it (e.g. build_model(name, seq={seq}))")


def _simulated(trainer: Trainer) -> bool:
    """True when offload ran simulated (host side and compute side both on the CPU)."""
    return bool(trainer.ctx.offload_sim and not trainer.ctx.cuda and "offload" in trainer.plan)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_AUTO: Callable[..., dict[str, Any]] | None = None


def register_auto(fn: Callable[..., dict[str, Any]] | None) -> None:
    """Install what ``train(..., plan="auto")`` runs (the planner registers
    :func:`colabkit.estimate.auto.train_auto`; the train loop sits below the estimator and never imports it)."""
    global _AUTO
    _AUTO = fn


def train(model: torch.nn.Module | ModelFn | str, data: Any = None, plan: Plan | str = "baseline", steps: int = 100,
          batch: int = 8, seq: int = 128, seed: int = 0, device: str | torch.device | None = None, lr: float = 3e-4,
          max_grad_norm: float | None = None, track: bool = True, live_plot: Any = None,
          callbacks: Iterable[Any] = (), checkpoint_dir: str | None = None, checkpoint_every: int = 0,
          checkpoint_minutes: float | None = None, resume: bool | str = False, progress: bool = True,
          eval_every: int = 0, keep: int = 3, on_oom: str = "stop", budget_bytes: int | None = None,
          host_limit_bytes: int = HOST_LIMIT_BYTES, log: str | Iterable[str] | None = None, log_dir: str | None = None,
          offload_sim: bool = False, deterministic: bool = False, checkpointing: Checkpointing | None = None,
          ) -> dict[str, Any]:
    """Train for ``steps`` optimizer steps of ``batch`` sequences (the effective batch) and return
    the loss curve, step times, memory report and a hash of the final weights.

    ``model``: a name (``gpt-tiny``, ``gpt:LxD``, ``hf:<id>``), your module, or a function that builds it.
    ``data``: colabkit's corpus (default) or your own -- a list or map-style ``Dataset`` of batch dicts or of
    examples (``batch`` of them per step), or a ``DataLoader`` (:mod:`colabkit.feed`); the batch of step ``s``
    depends on (``seed``, ``s``) only, so a resumed run sees the batches it would have seen. ``seq`` is the
    length of colabkit's text windows (and the context a ``gpt:LxD`` name is built for); your own batches keep theirs.
    ``plan="auto"``: the fastest plan predicted to fit ``budget_bytes`` (:mod:`colabkit.estimate.auto`).

    The loop fires events (run start, step start/end, evaluation, save, out of memory, run end; see
    :mod:`colabkit.callbacks`) to one object per concern, and to a user's own objects in ``callbacks``
    (``on_train_begin``, ``on_step_end``, ... as in ``transformers.TrainerCallback``); a plain function there
    gets ``{"step", "loss", "step_time_s", "trainer"}`` after each step. ``live_plot`` (a
    :class:`colabkit.plots.LivePlot`) is redrawn from the tracker's samples.

    Checkpoints (:class:`colabkit.checkpoints.Checkpointing`, or its settings one by one): with
    ``checkpoint_dir`` a checkpoint is written every ``checkpoint_every`` steps and/or every
    ``checkpoint_minutes`` of wall time (with neither: every 10 minutes), and at the end; the last
    ``keep`` stay. ``resume=True`` (or ``"auto"``) continues from the newest valid one when there is one
    and starts fresh otherwise, saying which; ``resume="must"`` raises when there is none. The same
    batches follow. A run already at ``steps`` says it is complete (``"complete": True``, its final loss
    and weights hash) and trains nothing; a checkpoint past ``steps`` is an error.
    ``on_oom="shrink"`` halves the micro-batch on an out-of-memory and retries (same effective batch);
    ``"stop"`` writes a checkpoint and the post-mortem (:class:`colabkit.oom.OOMHandling`). A warning names
    the planner's cheapest plan once the peak nears ``budget_bytes`` or host RAM nears ``host_limit_bytes``
    (Colab's 12.7 GB). ``log`` (``"tensorboard"``, ``"wandb"``, ``"csv"`` or a list) writes loss, step time
    and memory by category per step under ``log_dir`` (default ``runs/colabkit``; see :mod:`colabkit.logs`).
    ``offload_sim=True`` runs offload tokens on a CPU with a simulated host side (the result says
    ``"simulated": True``).

    ``seed`` seeds Python's ``random``, NumPy and torch, so two runs with one seed write byte-identical
    checkpoints; ``deterministic=True`` adds deterministic algorithms (and cuBLAS's workspace setting), which a
    GPU needs for bit-identical weights. On the CPU the weights also depend on the number of threads: a
    checkpoint records it and a resume runs with it (:mod:`colabkit.determinism` says what "same weights" means).

    >>> out = train("gpt-tiny", steps=2, batch=2, seq=16, progress=False)
    >>> len(out["losses"]), out["step"]
    (2, 2)
    """
    if isinstance(plan, str) and plan.strip() == "auto":  # the fastest plan predicted to fit (colabkit.estimate.auto)
        return _train_auto(model, {k: v for k, v in locals().items() if k not in ("model", "plan")})
    plan = Plan.parse(plan)
    ck = _checkpointing(checkpointing, checkpoint_dir, checkpoint_every, checkpoint_minutes, keep, resume)
    check_run(batch, seq, steps, plan, on_oom, ck.every, ck.resume, ck.dir, ck.minutes)
    check_device(device)
    if isinstance(model, str):
        check_context(model, seq)
    choices = isinstance(model, torch.nn.Module) and multiple_choice(model)
    source = feed(data, batch, seq, seed, _device(device), eval_every, 2 if choices else 1)  # from (seed, step) only
    check_run(source.size, seq, steps, plan, on_oom)  # a batch dict's own size
    _say_ready_batches(data, source, batch)
    seed_all(seed)
    run = Run(steps, source.size, seq, seed, _device(device), model if isinstance(model, str) else None, source)
    run.callbacks = [OOMHandling(on_oom), MemoryAlerts(host_limit_bytes), *([ProgressBar()] if progress else []),
                     *([LivePlotFeed(live_plot)] if live_plot is not None else []), *map(as_callback, callbacks),
                     *([Logging(log, log_dir)] if log else []), *([ck] if ck.dir else [])]
    run.tracker = MemoryTracker(device=run.device, on_sample=run.on_sample, categories=track, budget_bytes=budget_bytes,
                                warn=False) if (track or live_plot) else None  # MemoryAlerts says it, with a plan
    try:
        with deterministic_mode(deterministic), run.tracker if run.tracker is not None else contextlib.nullcontext():
            model = _build(model, plan, seq, run.device)
            if isinstance(source, TextFeed):  # seq cuts colabkit's text windows; your own batches keep their length
                _check_model(model, seq)
            run.trainer = Trainer(model, plan, device=run.device, lr=lr, max_grad_norm=max_grad_norm,
                                  model_name=run.model_name, tracker=run.tracker, offload_sim=offload_sim)
            run.fire("on_init_end")
            run.fire("on_train_begin")
            for step in range(run.step, steps):
                run.fire("on_step_begin", step + 1)
                b = source.batch(step)
                if run.tracker is not None:
                    run.tracker.set_step(step)
                _sync(run.device)
                t0 = time.perf_counter()
                loss = _step(run.trainer, b, run)
                _sync(run.device)
                run.losses.append(loss)
                run.step_times.append(time.perf_counter() - t0)
                run.fire("on_step_end", {"step": step + 1, "loss": loss, "step_time_s": run.step_times[-1],
                                         "trainer": run.trainer})
                if eval_every and (step + 1) % eval_every == 0:
                    run.evals.append((step + 1, run.trainer.evaluate(*source.eval_batch(step))))
                    run.fire("on_evaluate", *run.evals[-1])
    except BaseException as e:
        run.error = e
        raise
    finally:  # the logs are complete (a W&B run ended) even when a step raised; a run that ends well is saved
        if run.trainer is not None:
            run.fire("on_train_end")
    return _result(run)


def _say_ready_batches(data: Any, source: Any, batch: int) -> None:
    """Ready batches (a DataLoader's batch_size, batch dicts) decide a step's size, not ``batch=``: said when they differ."""
    ready = ("a batch of {n} as the DataLoader makes it (its batch_size)" if isinstance(data, torch.utils.data.DataLoader)
             else "one of your batches as it is ({n} per step)" if getattr(source, "collate_fn", 0) is None else None)
    if ready and source.size != batch:
        print(f"colabkit: each step takes {ready.format(n=source.size)}; train's batch={batch} applies to single "
              "examples and colabkit's text data")


def _build(model: Any, plan: Plan, seq: int, device: torch.device) -> torch.nn.Module:
    """The run's model: a name (:func:`load_model`), a function that builds it (called under the tracker), or
    the model itself."""
    if isinstance(model, str):
        return load_model(model, plan, seq=seq, device=device)
    return model() if callable(model) and not isinstance(model, torch.nn.Module) else model


def _step(trainer: Trainer, batch: Any, run: Run) -> float:
    """One optimizer step under the run's OOM handling (:class:`colabkit.oom.OOMHandling`)."""
    handling = next(cb for cb in run.callbacks if isinstance(cb, OOMHandling))
    return handling.step(trainer, batch, run)


def _checkpointing(given: Checkpointing | None, directory: str | None, every: int, minutes: float | None, keep: int,
                   resume: bool | str) -> Checkpointing:
    """``train``'s checkpoint settings as one object: ``checkpointing=`` or the keyword arguments, not both."""
    if given is None:
        return Checkpointing(directory, every, minutes, keep, resume, clock=_clock)
    if (directory, every, minutes, keep, resume) != (None, 0, None, 3, False):
        raise ValueError("pass checkpointing=Checkpointing(...) or checkpoint_dir/checkpoint_every/checkpoint_minutes/"
                         "keep/resume, not both")
    return given


def _result(run: Run) -> dict[str, Any]:
    """What ``train`` returns: the run's curves, its memory report and the final weights' hash."""
    trainer, tracker = run.trainer, run.tracker
    return {
        "plan": str(trainer.plan),
        "step": trainer.step_count,
        "loss": run.losses[-1] if run.losses else getattr(trainer, "checkpoint_loss", None) if run.resumed_from else None,
        "complete": run.complete,
        "losses": run.losses,
        "evals": run.evals,
        "step_times": run.step_times,
        "accum": trainer.accum,
        "micro_batch": run.batch // trainer.accum,
        "oom_shrinks": run.oom_shrinks,
        "resumed_from": run.resumed_from,
        "report": tracker.report() if tracker is not None else None,
        "timeline": tracker.timeline if tracker is not None else [],
        "weights_sha256": weights_sha256(trainer.model),
        "simulated": _simulated(trainer),
        "trainer": trainer,
    }


def _train_auto(model: Any, kw: dict[str, Any]) -> dict[str, Any]:
    if _AUTO is None:
        raise PlanError("plan='auto' needs the planner: import colabkit (colabkit.estimate registers it)")
    return _AUTO(model, **kw)


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
    deterministic: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps under the tracker and return one ``bench`` record.

    ``model_fn`` is a model name or a function returning a causal LM ((B, S) ids -> (B, S, V)
    logits, or a Hugging Face model). Errors (an OOM, a refused plan) come back as
    ``ok: False`` with the message, so a sweep goes on.

    The tracker's dispatch mode adds Python work to every op: on a GPU as much as the kernels
    themselves, on a CPU 1.6x a step of gpt-tiny (less as ops grow). So on CUDA ``step_time_s`` comes
    from ``timing_steps`` (default 2) further steps run without it; ``step_time_tracked_s`` keeps the
    tracked figure, and ``timing_steps`` says which one ``step_time_s`` is (0: the tracked one, the
    CPU's default: a step there is slow, and one more raised a qlora:16 gpt:12x2048 process's RSS from
    914 to 1162 MiB, glibc keeping the freed blocks). The tables print no tracked figure. To compare
    plans' speed, use :func:`colabkit.step_times` (warmed up, repeated, interleaved).

    ``offload_sim=True`` runs offload tokens on a CPU with a simulated host side: the record has
    ``"simulated": True``; ``host_bytes`` / ``host_breakdown`` are the host side's peaks (pinned RAM
    on a GPU) and ``breakdown`` the device side's. ``deterministic=True``: deterministic algorithms for
    the whole measurement (:func:`colabkit.determinism.deterministic`); ``seed`` seeds every RNG either way.
    """
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    record: dict[str, Any] = {"plan": str(plan), "model": name, "params": None, "trainable_params": None,
                              "peak_bytes": None, "breakdown": None, "at_peak": None, "step_time_s": None,
                              "loss": None, "ok": False, "error": None, "device": str(device),
                              "batch": batch, "seq": seq, "steps": steps, "simulated": False,
                              "timing_steps": None}
    try:  # refused like train's: before anything is built
        check_device(device)
        check_sizes(batch, seq, steps)
        check_batch(Plan.parse(plan), batch)  # (a PlanError is a ValueError)
        if isinstance(model_fn, str):
            check_context(model_fn, seq)
        if isinstance(model_fn, torch.nn.Module):  # it would be called as a factory: forward() with no batch
            raise ValueError(f"measure takes a model name or a function that builds the model, not a built "
                             f"{type(model_fn).__name__}: it builds it under the tracker (so its weights are counted, "
                             f"each plan on fresh weights), e.g. measure(lambda: MyModel(), plan); "
                             f"colabkit.estimate takes the built model")
    except ValueError as e:
        record["error"] = f"ValueError: {e}"
        return record
    dev = _device(device)
    record["device"] = str(dev)
    data = data or TextData()
    gc.collect()  # an earlier run's cycles still holding device memory would count in this run's CUDA peak
    tracker = MemoryTracker(device=dev, on_sample=on_sample)
    det = deterministic_mode(deterministic)
    det.__enter__()
    try:
        plan = Plan.parse(plan)
        record["plan"] = str(plan)
        seed_all(seed)
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
        record["timing_steps"] = n_timing  # 0: step_time_s is the tracked steps' figure
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
        det.__exit__(None, None, None)
        # this run's tensors go now, not at some later collection: the next run's CUDA peak
        # (max_memory_allocated) counts whatever is still allocated
        model = trainer = tracker = x = y = None
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return record

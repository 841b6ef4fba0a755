"""One small training loop that every path uses: the CLI, ``measure``, the notebooks and the tests.

A :class:`Trainer` applies a plan to a model (model transforms, forward contexts, optimizer) and runs
optimizer steps on an effective batch, split into ``accum:K`` micro-batches, with the loss
normalised by the token count of the whole window. :func:`train` adds progress, a tracker, a live
plot, callbacks and crash-safe checkpoints; :func:`measure` returns one ``bench`` record.

>>> r = measure("gpt-tiny", "baseline", batch=2, seq=16, steps=1)
>>> r["ok"], r["breakdown"]["params"] == 4 * r["params"]
(True, True)
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from .env import default_device, env
from .data import IGNORE_INDEX, TextData
from .memory import MemoryTracker
from .models import build_model, count_params, logits_of
from .plan import Context, Plan, PlanError, param_groups, REGISTRY


def _oom_guard(*args, **kwargs):
    from .oom import oom_guard  # imported here: oom -> estimate -> train

    return oom_guard(*args, **kwargs)

ModelFn = Callable[[], torch.nn.Module]


def _device(device: str | torch.device | None) -> torch.device:
    d = torch.device(device or default_device())
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' asked for but no GPU is attached: use device='cpu', or in Colab "
                           "Runtime -> Change runtime type -> T4 GPU")
    return d


def split_micro(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split an effective batch (B, S) into k micro-batches along B; the last may be smaller."""
    if k > x.shape[0]:
        raise PlanError(f"accum:{k} needs at least {k} sequences per step, got batch {x.shape[0]}: "
                        f"use accum:{x.shape[0]} or less, or a larger batch")
    return list(zip(x.tensor_split(k), y.tensor_split(k)))


def load_model(name: str, plan: Plan | str = "baseline", seq: int | None = None,
               device: str | torch.device | None = None) -> torch.nn.Module:
    """Build a model by name for a plan: a technique may load it its own way (``qlora`` loads an
    ``hf:<id>`` model straight into 4-bit on a GPU); otherwise :func:`colabkit.build_model` on ``device``.

    >>> load_model("gpt-tiny", "baseline").config.n_layer
    2
    """
    plan, dev = Plan.parse(plan), _device(device)
    ctx = Context(device=dev)
    for t in plan.techniques():
        if t.load_model is not None:
            model = t.load_model(name, plan, ctx, seq)
            if model is not None:
                return model
    return build_model(name, seq=seq, device=dev)


class Trainer:
    """A model with a plan applied, ready to take optimizer steps.

    >>> t = Trainer(build_model("gpt-tiny"), "baseline", device="cpu")
    >>> x, y = TextData().batch(2, 16, step=0)
    >>> isinstance(t.step(x, y), float)
    True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan | str = "baseline",
        device: str | torch.device | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        max_grad_norm: float | None = None,
        model_name: str | None = None,
        tracker: MemoryTracker | None = None,
    ):
        self.plan = Plan.parse(plan)
        self.ctx = Context(device=_device(device), env=env(), model_name=model_name, lr=lr,
                           weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self.plan.check(self.ctx)
        techs = self.plan.techniques()
        for t in techs:  # order < 50: before the move to the device (e.g. quantize, stream params)
            if t.prepare_model is not None and t.order < 50:
                model = t.prepare_model(model, self.plan, self.ctx)
        if not getattr(model, "_colabkit_placed", False):
            model = model.to(self.ctx.device)
        for t in techs:
            if t.prepare_model is not None and t.order >= 50:
                model = t.prepare_model(model, self.plan, self.ctx)
        self.model = model
        opt_tech = REGISTRY[self.plan.optimizer]
        self.optimizer = opt_tech.make_optimizer(param_groups(model, weight_decay), self.plan, self.ctx)
        for t in techs:
            if t.wrap_optimizer is not None:
                self.optimizer = t.wrap_optimizer(self.optimizer, model, self.plan, self.ctx)
        self._contexts = [t.forward_context for t in techs if t.forward_context is not None]
        # fp16 needs loss scaling; with any other precision the scaler is a no-op (scale stays 1.0).
        self.scaler = torch.amp.GradScaler(self.ctx.device.type, enabled="fp16" in self.plan)
        self.accum = self.plan.get("accum", 1)
        self.tracker = tracker
        self.step_count = 0
        if tracker is not None:
            tracker.watch(model, self.optimizer)

    def _phase(self, name: str):
        return self.tracker.phase(name, self.step_count) if self.tracker is not None else contextlib.nullcontext()

    def forward_context(self) -> contextlib.ExitStack:
        """All forward contexts of the plan (autocast, saved-tensor hooks, attention backend)."""
        stack = contextlib.ExitStack()
        for make in self._contexts:
            stack.enter_context(make(self.plan, self.ctx))
        return stack

    def loss(self, x: torch.Tensor, y: torch.Tensor, n_tokens: torch.Tensor | int) -> torch.Tensor:
        """Summed token cross-entropy of (x, y) divided by the window's token count ``n_tokens``."""
        logits = logits_of(self.model(x))  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / n_tokens

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the effective batch (B, S); returns its mean token loss."""
        self.model.train()
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        n_tokens = (y != IGNORE_INDEX).sum().clamp(min=1)  # the whole window, not each micro-batch
        total = torch.zeros((), device=self.ctx.device)
        for xi, yi in split_micro(x, y, self.accum):
            with self._phase("forward"), self.forward_context():
                loss = self.loss(xi, yi, n_tokens)
            with self._phase("backward"):
                self.scaler.scale(loss).backward()
            total += loss.detach()
            del loss
        with self._phase("optimizer"):
            if self.ctx.max_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ctx.max_grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return float(total)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        with self.forward_context():
            return float(self.loss(x, y, (y != IGNORE_INDEX).sum().clamp(min=1)))

    # ----- checkpoints: everything needed for an exact resume --------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "plan": str(self.plan),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["plan"] != str(self.plan):
            raise PlanError(f"checkpoint was written with plan {state['plan']!r}, this run uses {str(self.plan)!r}: "
                            "resume with the same plan or start a fresh checkpoint directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self.step_count = state["step"]


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of every tensor in the state dict (names, dtypes, shapes, bytes): equal iff weights are equal."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
) -> dict[str, Any]:
    """Train for ``steps`` optimizer steps of ``batch`` sequences (the effective batch) and return
    the loss curve, step times, memory report and a hash of the final weights.

    ``live_plot`` (a :class:`colabkit.plots.LivePlot`) is redrawn from the tracker's samples;
    callbacks get ``{"step", "loss", "step_time_s", "trainer"}`` after each step. With
    ``checkpoint_dir`` and ``checkpoint_every`` a checkpoint is written every K steps;
    ``resume=True`` continues from it, seeing the same batches an uninterrupted run would.

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
        trainer = Trainer(model, plan, device=dev, lr=lr, max_grad_norm=max_grad_norm, model_name=name, tracker=tracker)
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
            with _oom_guard(tracker, model=name, batch=batch, seq=seq, plan=str(trainer.plan), trainer=trainer,
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
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps under the tracker and return one ``bench`` record.

    ``model_fn`` is a model name or a function returning a causal LM ((B, S) ids -> (B, S, V)
    logits, or a Hugging Face model). Errors (an OOM, a refused plan) come back as
    ``ok: False`` with the message, so a sweep goes on.

    The tracker's dispatch mode adds Python work to every op, which on a GPU is comparable to the
    kernels themselves; so on CUDA ``step_time_s`` comes from ``timing_steps`` (default 2) further
    steps run without it (``step_time_tracked_s`` keeps the tracked figure). On the CPU the ops
    dominate and the tracked steps are timed (``timing_steps=0``).
    """
    dev = _device(device)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    record: dict[str, Any] = {"plan": str(plan), "model": name, "params": None, "trainable_params": None,
                              "peak_bytes": None, "breakdown": None, "at_peak": None, "step_time_s": None,
                              "loss": None, "ok": False, "error": None, "device": str(dev),
                              "batch": batch, "seq": seq, "steps": steps}
    data = data or TextData()
    tracker = MemoryTracker(device=dev, on_sample=on_sample)
    try:
        plan = Plan.parse(plan)
        record["plan"] = str(plan)
        torch.manual_seed(seed)
        with tracker:
            model = load_model(model_fn, plan, seq=seq, device=dev) if isinstance(model_fn, str) else model_fn()
            trainer = Trainer(model, plan, device=dev, lr=lr, model_name=name, tracker=tracker)
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
            "peak_bytes", "breakdown", "at_peak", "peak_phase", "peak_reserved_bytes", "host_rss_peak")})
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

"""The train loop's events and the objects that receive them, named as ``transformers.TrainerCallback`` names them.

:func:`colabkit.train` is a short loop that fires events to a list of objects; each concern is one object
in its own module: checkpoints (:class:`colabkit.checkpoints.Checkpointing`: cadence, keep-N, resume), logs
(:class:`colabkit.logs.Logging`), memory alerts (:class:`colabkit.alerts.MemoryAlerts`), the progress bar
(:class:`colabkit.progress.ProgressBar`), the OOM handling (:class:`colabkit.oom.OOMHandling`) and the live
plot (:class:`LivePlotFeed`). A user's own object in ``train(callbacks=[obj])`` receives the same events;
a plain function there is called with the step's dict, as its ``on_step_end``.

The events, in the order one run fires them (every method gets the :class:`Run` first):

- ``on_init_end(run)``: the Trainer is built (:class:`~colabkit.checkpoints.Checkpointing` restores a checkpoint here)
- ``on_train_begin(run)``: ``run.step`` is where the run starts (a resumed run: its checkpoint's step)
- ``on_step_begin(run, step)``: ``step`` is the 1-based number of the optimizer step about to run
- ``on_oom(run, event)``: the step ran out of memory: ``{"step", "error", "recovered", "shrink"}``
- ``on_step_end(run, event)``: ``{"step", "loss", "step_time_s", "trainer"}`` (the dict plain functions get)
- ``on_save(run, path)``: a checkpoint was written (``run.step`` is its step)
- ``on_evaluate(run, step, loss)``: with ``eval_every``, after that step's ``on_step_end``
- ``on_train_end(run)``: last, also when a step raised (``run.error`` is then the exception)
- ``on_memory_sample(run, sample)``: each sample of the memory tracker (the live plot redraws from them)

>>> class Steps(Callback):
...     def __init__(self): self.seen = []
...     def on_step_end(self, run, event): self.seen.append(event["step"])
>>> run = Run(steps=2, callbacks=[Steps(), as_callback(lambda e: None)])
>>> run.fire("on_step_end", {"step": 1}); run.callbacks[0].seen
[1]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

EVENTS = ("on_init_end", "on_train_begin", "on_step_begin", "on_oom", "on_step_end", "on_save", "on_evaluate",
          "on_train_end", "on_memory_sample")


class Callback:
    """An object receiving the train loop's events; every method does nothing unless overridden.
    (Subclassing is optional: any object with some of these methods receives those events.)"""

    def on_init_end(self, run: "Run") -> None: ...
    def on_train_begin(self, run: "Run") -> None: ...
    def on_step_begin(self, run: "Run", step: int) -> None: ...
    def on_oom(self, run: "Run", event: dict[str, Any]) -> None: ...
    def on_step_end(self, run: "Run", event: dict[str, Any]) -> None: ...
    def on_save(self, run: "Run", path: str) -> None: ...
    def on_evaluate(self, run: "Run", step: int, loss: float) -> None: ...
    def on_train_end(self, run: "Run") -> None: ...
    def on_memory_sample(self, run: "Run", sample: dict[str, Any]) -> None: ...


class FunctionCallback(Callback):
    """A plain function ``fn(event)`` as an object: called after each step with the step's dict."""

    def __init__(self, fn: Callable[[dict], Any]):
        self.fn = fn

    def on_step_end(self, run: "Run", event: dict[str, Any]) -> None:
        self.fn(event)


def as_callback(obj: Any) -> Any:
    """``obj`` itself when it has any ``on_*`` event method, a plain callable as its ``on_step_end``.

    >>> type(as_callback(print)).__name__
    'FunctionCallback'
    """
    if any(c.__name__ == "TrainerCallback" and c.__module__.startswith("transformers") for c in type(obj).__mro__):
        raise TypeError(f"callbacks=[...]: a {type(obj).__name__} is a transformers.TrainerCallback (its events take "
                        "args, state, control): give it to transformers.Trainer(callbacks=...). colabkit.train's "
                        "events take the Run: subclass colabkit.Callback (e.g. on_step_end(self, run, event)); "
                        "train() tracks memory itself (its result's 'report')")
    if any(callable(getattr(obj, name, None)) for name in EVENTS):
        return obj
    if callable(obj):
        return FunctionCallback(obj)
    raise TypeError(f"callbacks=[...] takes objects with on_step_end/on_train_begin/... methods or functions "
                    f"f(event), got a {type(obj).__name__}")


class LivePlotFeed(Callback):
    """Feeds a live plot (anything with ``update(sample)``, e.g. :class:`colabkit.plots.LivePlot`) each
    sample of the run's memory tracker."""

    def __init__(self, plot: Any):
        self.plot = plot

    def on_memory_sample(self, run: "Run", sample: dict[str, Any]) -> None:
        self.plot.update(sample)


@dataclass
class Run:
    """What one ``train()`` run knows, passed to every event: its settings, the Trainer (once built; ``None``
    before ``on_init_end``), the tracker, and what happened so far (losses, step times, evaluations, OOM
    shrinks, the checkpoint it resumed from, an error that ended it)."""

    steps: int = 0
    batch: int = 0
    seq: int = 0
    seed: int = 0
    device: torch.device | None = None
    model_name: str | None = None
    data: Any = None  # step -> batch (colabkit.feed)
    callbacks: list[Any] = field(default_factory=list)
    tracker: Any = None
    trainer: Any = None
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    oom_shrinks: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: str | None = None
    complete: bool = False
    error: BaseException | None = None

    @property
    def step(self) -> int:
        """Optimizer steps done (a resumed run starts at its checkpoint's step)."""
        return self.trainer.step_count if self.trainer is not None else 0

    @property
    def identity(self) -> dict[str, Any]:
        """The data settings a resumed run must share with its checkpoint (it then sees the same batches)."""
        return {"batch": self.batch, "seq": self.seq, "seed": self.seed, **getattr(self.data, "identity", {})}

    @property
    def gpu(self) -> str | None:
        """The GPU profile the planner's suggestions use (a T4 on CUDA; none on the CPU)."""
        return "t4" if self.device is not None and self.device.type == "cuda" else None

    def fire(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback that has it, in list order."""
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is not None:
                method(self, *args)

    def on_sample(self, sample: dict[str, Any]) -> None:
        """The tracker's ``on_sample`` hook: fires ``on_memory_sample``."""
        self.fire("on_memory_sample", sample)

"""Memory logging to TensorBoard, Weights & Biases or a CSV file, one row per optimizer step.

``train(..., log=["tensorboard", "csv"])`` adds :class:`Logging`, which opens a logger per backend when the
run begins, writes each step's row at ``on_step_end`` and closes them at the end. Each
step logs the loss, the step time, the step's peak of tracked device memory and each category's
largest value in the step (from the tracker's phase-boundary samples), and the host RAM (RSS).
TensorBoard and W&B are optional: a missing package raises an error with the install line. W&B
runs offline unless you are logged in (``WANDB_API_KEY`` or ``wandb login``).

>>> import tempfile, os
>>> lg = make_loggers(["csv"], tempfile.mkdtemp())[0]
>>> lg.write(1, {"loss": 2.5}); lg.close(); os.path.basename(lg.path)
'metrics.csv'
"""
from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any, Callable, Sequence

from .callbacks import Callback, Run
from .memory import CATEGORIES
from .notices import warn

BACKENDS = ("tensorboard", "wandb", "csv")


def step_metrics(event: dict[str, Any]) -> dict[str, float]:
    """What a logger writes for one step, from the train loop's callback event (``step``, ``loss``,
    ``step_time_s``, ``trainer``): the memory figures come from the tracker's samples of that step."""
    out = {"loss": float(event["loss"]), "step_time_s": float(event["step_time_s"])}
    tracker = getattr(event.get("trainer"), "tracker", None)
    if tracker is not None:
        out.update(memory_metrics(tracker, event["step"] - 1))
    return out


def memory_metrics(tracker: Any, step: int) -> dict[str, float]:
    """``memory/*`` scalars of one (0-based) step from a tracker's phase samples: the step's peak, each
    category's largest value in it, the host RAM; empty when the tracker has no sample of that step."""
    samples = [s for s in tracker.timeline if s.get("step") == step and s.get("phase") != "setup"]
    if not samples:
        return {}
    out = {"memory/step_peak_bytes": float(max(max(s.get("phase_peak") or 0, s.get("phase_peak_cuda") or 0)
                                               for s in samples))}
    if samples[0].get("categories"):
        for c in CATEGORIES:
            out[f"memory/{c}_bytes"] = float(max(s["categories"][c] for s in samples))
    if samples[-1].get("host_rss"):
        out["memory/host_rss_bytes"] = float(samples[-1]["host_rss"])
    return out


class Logger(Callback):
    """A callback for ``train(callbacks=[...])``: writes :func:`step_metrics` at every step (also callable
    with the step's dict, as a plain-function callback)."""

    _warned = False

    def on_step_end(self, run: Run, event: dict[str, Any]) -> None:
        self(event)

    def __call__(self, event: dict[str, Any]) -> None:
        metrics = step_metrics(event)
        if "memory/step_peak_bytes" not in metrics and not self._warned:
            self._warned = True
            warn(f"colabkit: {type(self).__name__}: no memory figures to log (the run has no tracker), only loss "
                 "and step time: leave train(track=True) on to log memory")
        self.write(event["step"], metrics)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CSVLogger(Logger):
    """``metrics.csv`` in ``directory``: a header of every metric seen in the first row, one row a step."""

    def __init__(self, directory: str, resume_step: int | None = None):
        self.path = os.path.join(directory, "metrics.csv")
        kept: list[dict[str, str]] = []
        if resume_step is not None and os.path.exists(self.path):  # keep the rows up to the checkpoint's step
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self._f = open(self.path, "w", newline="")
        self._w: Any = None
        if kept:
            self._w = csv.DictWriter(self._f, fieldnames=list(kept[0]), extrasaction="ignore")
            self._w.writeheader()
            self._w.writerows(kept)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._w is None:
            self._w = csv.DictWriter(self._f, fieldnames=["step", *metrics], extrasaction="ignore")
            self._w.writeheader()
        self._w.writerow({"step": step, **metrics})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardLogger(Logger):
    """Scalars in a TensorBoard event file under ``directory`` (open with ``%tensorboard --logdir DIR``)."""

    def __init__(self, directory: str):
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError('log="tensorboard" needs the tensorboard package: pip install tensorboard '
                              '(or pip install "colabkit[logging]")')
        from torch.utils.tensorboard import SummaryWriter

        if any(f.startswith("events.out.tfevents.") for f in os.listdir(directory)):
            warn(f"colabkit: {directory!r} already holds a TensorBoard event file: TensorBoard shows both as one "
                 "run and mixes their steps; use a fresh log_dir per run (fine when resuming that run)")
        self.path = directory
        self._w = SummaryWriter(log_dir=directory)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class WandbLogger(Logger):
    """A Weights & Biases run: online when logged in, else ``mode="offline"`` (sync later with ``wandb sync``)."""

    def __init__(self, directory: str, project: str = "colabkit", config: dict | None = None):
        if importlib.util.find_spec("wandb") is None:
            raise ImportError('log="wandb" needs the wandb package: pip install wandb')
        import wandb

        logged_in = bool(os.environ.get("WANDB_API_KEY")) or _wandb_logged_in(wandb)
        self.mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
        self.path = directory
        self._run = wandb.init(project=project, dir=directory, mode=self.mode, config=config or {})

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _wandb_logged_in(wandb: Any) -> bool:
    """Credentials present (settings file, .netrc), without prompting or asking the server."""
    try:
        return bool(wandb.login(prompt=False, verify=False))  # wandb >= 0.2x: False when no key, no prompt
    except TypeError:  # older wandb without ``prompt=``: its (since deprecated) api object
        return bool(getattr(getattr(wandb, "api", None), "api_key", None))


_MAKERS: dict[str, Callable[[str], Logger]] = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}


def make_loggers(log: str | Sequence[str] | None, directory: str, resume_step: int | None = None) -> list[Logger]:
    """One logger per backend name (``"tensorboard"``, ``"wandb"``, ``"csv"``; a comma-separated string
    works too), all writing under ``directory``. ``resume_step``: a resumed run (the CSV keeps its rows up
    to that step; TensorBoard's new event file continues the same run)."""
    names = [n.strip().lower() for n in (log.split(",") if isinstance(log, str) else log or []) if n.strip()]
    bad = [n for n in names if n not in _MAKERS]
    if bad:
        raise ValueError(f"unknown log backend(s) {bad}: use {', '.join(BACKENDS)}")
    names = list(dict.fromkeys(names))  # "csv,csv" would open metrics.csv twice
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the log folder {directory!r} ({e.strerror or e}): pass a writable "
                         "log_dir (--log-dir)") from None
    made: list[Logger] = []
    try:
        for n in names:
            made.append(_MAKERS[n](directory, resume_step) if n == "csv" and resume_step is not None
                        else _MAKERS[n](directory))
    except BaseException:
        for lg in made:  # a later backend failed (package missing): close the files already opened
            lg.close()
        raise
    return made


class Logging(Callback):
    """``train(log=..., log_dir=...)``: the loggers of :func:`make_loggers`, opened when the run begins (once
    the plan is accepted, so a refused plan leaves no empty log files; a resumed run continues its CSV from the
    checkpoint's step), a row per step, closed at the end (also when a step raised: the logs are complete and a
    W&B run ended).

    >>> Logging("csv").dir == os.path.join("runs", "colabkit")
    True
    """

    def __init__(self, log: str | Sequence[str], log_dir: str | None = None):
        self.log, self.dir = log, log_dir or os.path.join("runs", "colabkit")
        self.loggers: list[Logger] = []

    def on_train_begin(self, run: Run) -> None:
        self.loggers = make_loggers(self.log, self.dir, resume_step=run.step if run.resumed_from else None)
        if self.loggers:
            first = self.loggers[0].path
            print(f"colabkit: logging {', '.join(type(lg).__name__[:-6].lower() for lg in self.loggers)} to "
                  f"{first if os.path.isdir(first) else os.path.dirname(first)}")

    def on_step_end(self, run: Run, event: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg(event)

    def on_train_end(self, run: Run) -> None:
        for lg in self.loggers:
            lg.close()

"""The progress bar of a ``train()`` run: tqdm (in a notebook, its widget) with the last loss.

:class:`ProgressBar` receives the train loop's events: the bar opens at the run's first step (a resumed
run starts at its checkpoint's step), advances with each step showing its loss, and closes at the end.
Without tqdm it shows nothing.

>>> ProgressBar().bar is None
True
"""
from __future__ import annotations

from typing import Any

from .callbacks import Callback, Run


class ProgressBar(Callback):
    """A tqdm bar over the run's steps, ``desc`` naming the plan, ``loss`` as its postfix."""

    def __init__(self):
        self.bar: Any = None

    def on_train_begin(self, run: Run) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.bar = tqdm(desc=f"train {run.trainer.plan}", initial=run.step, total=run.steps)

    def on_step_end(self, run: Run, event: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{event['loss']:.3f}", refresh=False)
            self.bar.update(1)

    def on_train_end(self, run: Run) -> None:
        if self.bar is not None:
            self.bar.close()

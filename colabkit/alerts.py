"""Memory alerts during a ``train()`` run: a warning, once, when memory nears its limit, with a plan that fits.

:class:`MemoryAlerts` receives the train loop's ``on_step_end``: once the tracked peak passes the tracker's
alert fraction of the budget (``train(budget_bytes=...)``), or host RAM passes 90% of ``host_limit``
(Colab's 12.7 GB), it warns once (:class:`~colabkit.notices.MemoryAlert`, shown by default) with what the tracker
recorded and the planner's cheapest plan that fits, through the hook :mod:`colabkit.oom` holds (the planner sits
above the train loop).

>>> MemoryAlerts().host_limit
12700000000
"""
from __future__ import annotations

from typing import Any

from .callbacks import Callback, Run
from .memory import fmt_bytes
from .notices import MemoryAlert, warn
from .oom import own_model_tip, suggest_plan

HOST_LIMIT_BYTES = int(12.7e9)  # Colab's host RAM


class MemoryAlerts(Callback):
    """Warn once per kind (device, host) when memory nears its limit, with the planner's cheapest plan."""

    def __init__(self, host_limit: int = HOST_LIMIT_BYTES):
        self.host_limit = host_limit
        self.sent: set[str] = set()

    def on_step_end(self, run: Run, event: dict[str, Any]) -> None:
        tracker = run.tracker
        if tracker is None:
            return
        host = (tracker.timeline[-1].get("host_rss") or 0) > 0.9 * self.host_limit if tracker.timeline else False
        for kind, hit in (("device", bool(tracker.alerts)), ("host", host)):
            if not hit or kind in self.sent:
                continue
            self.sent.add(kind)
            # the device's alert as the tracker recorded it when memory crossed the line (train's tracker records it
            # without warning: said once, here, with what the planner suggests)
            what = (tracker.alerts[0].removeprefix("colabkit: ").rstrip(".") if kind == "device"
                    else f"host RAM use is past 90% of {fmt_bytes(self.host_limit)} (Colab's limit)")
            tip = own_model_tip(run.device) if run.model_name is None else self._suggestion(run, tracker)
            warn(f"colabkit: {what}; {tip}", MemoryAlert)

    @staticmethod
    def _suggestion(run: Run, tracker: Any) -> str:
        """The planner's cheapest plan that fits the budget, in words (or why there is none)."""
        try:
            with tracker.paused():  # the planner's own work is not the run's memory
                s = suggest_plan(run.model_name, run.batch, run.seq, gpu=run.gpu, budget_bytes=tracker.budget_bytes)
        except Exception as e:  # noqa: BLE001  (an alert must never stop training)
            return f"no plan suggestion ({type(e).__name__}: {e})"
        if s is None:
            return ("none of the planner's candidate plans fits (they train every weight: lora:R / qlora:R, which train "
                    "adapters, are not among them): use a smaller batch, seq or model, or lora:R")
        return (f"cheapest plan that fits (planner): {s['plan']} (predicted peak {fmt_bytes(s['peak_bytes'])}, "
                f"step-time overhead {s['overhead']:+.0%})")

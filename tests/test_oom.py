"""OOM post-mortem by fault injection: an OutOfMemoryError raised inside a training step is caught,
memory is freed, a snapshot is written, the categories live at the OOM are reported, and the planner's
cheapest fitting plan is suggested."""
import json
import os

import pytest
import torch

from colabkit.memory import MemoryTracker
from colabkit.models import build_model, count_params
from colabkit.oom import OutOfMemoryWithAdvice, oom_guard
from colabkit.train import train


class _OOMOnCall(torch.nn.Module):
    """A GPT that raises a CUDA-style OOM at the end of its n-th forward (activations are live)."""

    def __init__(self, n: int):
        super().__init__()
        self.gpt, self.n, self.calls = build_model("gpt:2x64"), n, 0

    def forward(self, x):
        out = self.gpt(x)
        self.calls += 1
        if self.calls == self.n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return out


def test_train_oom_postmortem(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    model = _OOMOnCall(n=2)
    n = count_params(model)
    with pytest.raises(OutOfMemoryWithAdvice) as info:
        train(model, steps=3, batch=4, seq=32, device="cpu", progress=False)
    pm = info.value.postmortem
    assert isinstance(info.value, torch.OutOfMemoryError)  # still an OOM for callers that catch it
    at = pm["at_oom"]
    assert at["params"] == 4 * n
    assert at["optimizer"] == pytest.approx(8 * n, rel=1e-3)  # AdamW state from step 1 (+ step counters)
    assert at["activations"] > 0 and pm["freed_bytes"] >= at["activations"]  # the failed forward is freed
    with open(pm["snapshot"]) as f:
        snap = json.load(f)
    assert os.path.dirname(pm["snapshot"]) == str(tmp_path)
    assert sum(r["bytes"] for r in snap["live"]) == sum(at.values())
    assert "params" in str(info.value) and "Try:" in str(info.value)


def test_guard_suggests_cheapest_plan_that_fits(tmp_path):
    # a 40 MiB budget: gpt:4x128 at batch 8 x 128 needs ~49 MB plain and ~25 MB with checkpoint
    tracker = MemoryTracker(device="cpu", budget_bytes=40 * 2**20, alert_at=None)
    with tracker, oom_guard(tracker, model="gpt:4x128", batch=8, seq=128, reraise=False, verbose=False,
                            snapshot_dir=str(tmp_path), gpu=None,
                            candidates=["baseline", "checkpoint"]) as pm:
        big = torch.empty(1024, 1024)  # 4 MiB live at the OOM, in 'other' (no phase)
        raise torch.OutOfMemoryError("injected")
    assert pm.caught
    assert pm.report["at_oom"]["other"] >= big.numel() * 4
    assert pm.report["suggestion"]["plan"] == "checkpoint"
    assert pm.report["suggestion"]["peak_bytes"] <= 40 * 2**20


def test_guard_passes_through_without_oom():
    with oom_guard(reraise=True, verbose=False) as pm:
        x = torch.ones(3).sum()
    assert not pm.caught and float(x) == 3.0
    with pytest.raises(ValueError):  # other errors are not swallowed
        with oom_guard(verbose=False):
            raise ValueError("not an OOM")

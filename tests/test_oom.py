"""OOM post-mortem by fault injection: an OutOfMemoryError raised inside a training step is caught,
memory is freed, a snapshot is written, the categories live at the OOM are reported, and the planner's
cheapest fitting plan is suggested."""
import json
import os

import pytest
import torch

from colabkit.memory import MemoryTracker
from colabkit.models import build_model, count_params
from colabkit.notices import MemoryAlert
from colabkit.oom import OutOfMemoryWithAdvice, oom_guard
from colabkit.train import train


class _OOMOnCall(torch.nn.Module):
    """A GPT that raises a CUDA-style OOM at the end of its n-th forward (``upto``: of each of its first n);
    activations are live when it raises."""

    def __init__(self, n: int, upto: bool = False):
        super().__init__()
        self.gpt, self.n, self.upto, self.calls = build_model("gpt:2x64"), n, upto, 0

    def forward(self, x):
        out = self.gpt(x)
        self.calls += 1
        if self.calls == self.n or (self.upto and self.calls < self.n):
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


# ----- recovery by shrinking the micro-batch (train(..., on_oom="shrink")) --------------------------
class _OOMAbove(torch.nn.Module):
    """A GPT that raises an out-of-memory for any micro-batch larger than ``limit`` sequences, after
    its forward (the activations are live), as a GPU too small for that micro-batch would."""

    def __init__(self, limit: int, error=lambda: torch.OutOfMemoryError("CUDA out of memory (injected)")):
        super().__init__()
        torch.manual_seed(0)
        self.gpt, self.limit, self.error, self.sizes = build_model("gpt:2x64"), limit, error, []

    @property
    def config(self):
        return self.gpt.config

    def forward(self, x):
        out = self.gpt(x)
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise self.error()
        return out


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("error", [lambda: torch.OutOfMemoryError("CUDA out of memory (injected)"),
                                   lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                                        "can't allocate memory: you tried to allocate 2147483648 bytes")],
                         ids=["OutOfMemoryError", "DefaultCPUAllocator"])
def test_shrink_recovers_with_same_weights(error, capsys):
    kw = dict(steps=3, batch=8, seq=32, seed=1, device="cpu", progress=False)
    model = _OOMAbove(limit=2, error=error)
    out = train(model, on_oom="shrink", **kw)
    assert [(s["micro_batch"], s["to_micro_batch"], s["accum"]) for s in out["oom_shrinks"]] == [(8, 4, 2), (4, 2, 4)]
    assert out["accum"] == 4 and out["micro_batch"] == 2 and model.sizes[:3] == [8, 4, 2]
    assert "retrying with micro-batch 2 x accum 4 (effective batch 8)" in capsys.readouterr().out
    ref = train(_OOMAbove(limit=10**9), plan="accum:4", **kw)  # micro-batch 2 from the start
    assert _max_diff(out["trainer"].model.state_dict(), ref["trainer"].model.state_dict()) == 0  # the same sums
    # against the run that never shrank (one micro-batch of 8): the same computation, another fp32 summation order
    # (7e-7 here, ~1e-6 elsewhere: a bound on rounding would depend on the CPU) -- in float64 within 1e-12
    def wide(limit: int) -> _OOMAbove:
        m = _OOMAbove(limit=limit, error=error)
        m.gpt.double()
        return m
    shrunk64 = train(wide(2), on_oom="shrink", **kw)["trainer"].model.state_dict()
    whole64 = train(wide(10**9), **kw)["trainer"].model.state_dict()
    assert {v.dtype for v in whole64.values() if v.is_floating_point()} == {torch.float64}
    assert _max_diff(shrunk64, whole64) <= 1e-12
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-6)
    # negative control: halving the effective batch instead (what find_executable_batch_size does) changes them
    half = train(_OOMAbove(limit=10**9), **{**kw, "batch": 4})
    assert _max_diff(half["trainer"].model.state_dict(), ref["trainer"].model.state_dict()) > 1e-4


def test_stop_writes_checkpoint_and_postmortem(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    with pytest.raises(OutOfMemoryWithAdvice):
        train(_OOMAbove(limit=2), steps=2, batch=8, seq=32, device="cpu", progress=False,
              checkpoint_dir=str(tmp_path / "ck"))
    assert os.listdir(tmp_path / "ck") == ["ckpt-00000000.ckpt"]  # the state before the failed step


def test_shrink_goes_to_one_sequence_through_equal_parts(capsys):
    """A batch of 6 that fits one sequence at a time: 6 -> 3 -> 1 (3 cannot be halved into equal parts, 1 can take
    it; shrinking stopped at 3 until 2026-11-27), the weights those of accum:6."""
    kw = dict(steps=2, batch=6, seq=32, seed=1, device="cpu", progress=False)
    out = train(_OOMAbove(limit=1), on_oom="shrink", **kw)
    assert [(s["micro_batch"], s["to_micro_batch"], s["accum"]) for s in out["oom_shrinks"]] == [(6, 3, 2), (3, 1, 6)]
    ref = train(_OOMAbove(limit=10**9), plan="accum:6", **kw)
    assert _max_diff(out["trainer"].model.state_dict(), ref["trainer"].model.state_dict()) == 0


def test_shrink_gives_up_at_one_sequence(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    with pytest.raises(OutOfMemoryWithAdvice) as info:
        train(_OOMAbove(limit=0), steps=1, batch=4, seq=32, device="cpu", progress=False, on_oom="shrink")
    assert "CUDA out of memory" in str(info.value)


def test_other_errors_pass_untouched():
    err = ValueError("not an OOM")
    model = _OOMAbove(limit=0, error=lambda: err)
    with pytest.raises(ValueError) as info:
        train(model, steps=1, batch=4, seq=32, device="cpu", progress=False, on_oom="shrink")
    assert info.value is err and model.sizes == [4]  # no retry
    err = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError) as info:
        train(_OOMAbove(limit=0, error=lambda: err), steps=1, batch=4, seq=32, device="cpu", progress=False,
              on_oom="shrink")
    assert info.value is err


def test_memory_alerts_once_with_planner_suggestion(monkeypatch):
    from functools import partial

    import colabkit.oom
    from colabkit.estimate.planner import suggest

    # the real planner, asked about two candidates only to keep the test fast
    monkeypatch.setattr(colabkit.oom, "_SUGGESTER", partial(suggest, candidates=["baseline", "checkpoint"]))
    peak = train("gpt:2x64", steps=3, batch=8, seq=64, device="cpu", progress=False)["report"]["peak_bytes"]
    with pytest.warns(MemoryAlert) as rec:
        alerted = train("gpt:2x64", steps=3, batch=8, seq=64, device="cpu", progress=False,
                        budget_bytes=int(peak * 0.8), host_limit_bytes=1)
    # the planner's estimate behind the alert is not the run's memory: the measured peak is the run's own (its
    # real allocations -- replay profiles, the trace's builds -- were counted into it until 2026-11-27: +2.5x)
    assert alerted["report"]["peak_bytes"] == peak
    msgs = [str(w.message) for w in rec if "colabkit: " in str(w.message) and "plan" in str(w.message)]
    device = [m for m in msgs if "of the budget" in m]
    host = [m for m in msgs if "host RAM" in m]
    assert len(device) == 1 and len(host) == 1, msgs  # once each, not every step
    assert "cheapest plan that fits (planner): checkpoint" in device[0]

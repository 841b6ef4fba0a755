"""The estimator's fast path against its reference (issue 25): the optimizer step replayed from profiles of
the real step, traces cached per process, deep GPTs from 1- and 2-layer traces, the first step not traced
where the second dominates it. Each answer must be the full trace's (every step op by op, the whole model,
nothing cached: ``full_trace()``) within 0.5% -- peak, each category's own peak and the categories at the
peak, host bytes and the GPU overheads -- and each shortcut has a negative control the comparison catches."""
import subprocess
import sys

import pytest
import torch

import importlib

from colabkit.estimate import estimate, replay
from colabkit.estimate.trace import full_trace
from colabkit.memory import CATEGORIES
from colabkit.techniques.optimizers import AdamW4bit, state_bytes_per_param

trace_mod = importlib.import_module("colabkit.estimate.trace")  # the package exports a function named trace

# 4 layers: extrapolated from 2 and 3; 2 layers: traced whole. Batch x seq small: the check is exact, not statistical.
CASES = [("gpt:4x128", p) for p in ("baseline", "adamw4bit", "adamw8bit", "lion", "adafactor", "fused-step",
                                    "checkpoint+adamw4bit+fused-step", "accum:2", "fp16+checkpoint", "qlora:4",
                                    "offload:optimizer", "offload:params", "compress:int8+sgd:0.9")] + \
        [("gpt:2x64", p) for p in ("adamw4bit", "lora:4+adamw4bit")]


def _diffs(fast: dict, ref: dict) -> dict[str, float]:
    """Relative differences over every figure the fast path must reproduce (0 where the reference is 0)."""
    pairs = {"peak": (fast["peak_bytes"], ref["peak_bytes"]), "host": (fast["host_bytes"], ref["host_bytes"]),
             "params": (fast["params"], ref["params"])}
    for k in ("breakdown", "at_peak"):
        pairs.update({f"{k}.{c}": (fast[k][c], ref[k][c]) for c in CATEGORIES})
    pairs.update({f"overheads.{k}": (fast["overheads"][k], v) for k, v in ref.get("overheads", {}).items()})
    return {k: abs(a - b) / b if b else float(a != b) for k, (a, b) in pairs.items()}


def _compare(model: str, plan: str, batch: int = 2, seq: int = 32, gpu: str = "t4") -> dict[str, float]:
    with full_trace():
        ref = estimate(model, plan, batch=batch, seq=seq, gpu=gpu)
    fast = estimate(model, plan, batch=batch, seq=seq, gpu=gpu)
    return _diffs(fast, ref)


@pytest.mark.parametrize("model,plan", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_fast_path_equals_full_trace(model, plan):
    d = _compare(model, plan)
    assert max(d.values()) <= 0.005, {k: v for k, v in d.items() if v}


def test_fast_path_on_the_cpu_and_a_longer_model():
    with full_trace():
        ref = estimate("gpt:6x64", "checkpoint+adamw4bit", batch=2, seq=32, device="cpu")
    fast = estimate("gpt:6x64", "checkpoint+adamw4bit", batch=2, seq=32, device="cpu")
    d = _diffs(fast, ref)
    assert max(d.values()) <= 0.005, d


def test_replayed_state_is_the_published_formula():
    # the profile of the real step, recorded on a small instance, against state_bytes_per_param (independent:
    # the format's arithmetic): AdamW4bit 1 + 2*4/128 B/param plus its fp32 step count; AdamW 8 B/param + 4
    for cls, token, shape in ((AdamW4bit, "adamw4bit", (256, 64)), (torch.optim.AdamW, "adamw", (96, 32))):
        p = torch.nn.Parameter(torch.empty(shape))
        opt = cls([p], foreach=False) if cls is torch.optim.AdamW else cls([p])
        prof = replay.profile(opt, assume_grads=True)
        n = p.numel()
        assert prof.state_bytes == state_bytes_per_param(token, shape) * n + 4
        assert max(x for _, x in prof.steps[1]) > 0  # the update's fp32 scratch is seen


def test_a_setting_that_matters_changes_the_answer():
    # the cache is keyed by every setting: another batch, plan, rounding or width is another trace
    a = estimate("gpt:4x128", "adamw4bit", batch=2, seq=32, gpu="t4")
    for other in (dict(batch=4), dict(plan="adamw8bit"), dict(gpu=None, device="cpu"), dict(model="gpt:4x192")):
        kw = dict(model="gpt:4x128", plan="adamw4bit", batch=2, seq=32, gpu="t4") | other
        b = estimate(kw.pop("model"), kw.pop("plan"), **kw)
        assert b["peak_bytes"] != a["peak_bytes"], other


def test_negative_controls_break_each_shortcut(monkeypatch):
    # replay profiles cached without the parameters' shapes: the first one recorded replayed for every step
    monkeypatch.setattr(replay, "_key", lambda opt, signature, alloc_round: (type(opt), alloc_round))
    monkeypatch.setattr(replay, "_PROFILES", {})
    monkeypatch.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())
    assert max(_compare("gpt:2x64", "adamw4bit+fused-step").values()) > 0.005  # one profile per tensor shape
    monkeypatch.undo()
    # depth extrapolation that copies the 2-layer trace instead of extending it -> wrong peak at 3 layers
    monkeypatch.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())
    monkeypatch.setattr(trace_mod, "_affine", lambda t1, t2, cfg, depth: t2)
    assert max(_compare("gpt:5x128", "baseline").values()) > 0.005


def test_estimate_imports_no_optional_package():
    # bitsandbytes (seconds to import) and transformers stay off the estimate path when the plan needs neither
    code = ("import sys, colabkit; colabkit.estimate('gpt:2x64', 'adamw8bit+checkpoint', batch=2, seq=16); "
            "print(sorted(m for m in ('bitsandbytes', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"

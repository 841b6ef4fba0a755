"""A run's memory is released when it ends (found on CUDA, 2026-11-27, NVIDIA H200).

On the GPU, ``benchmarks/run.py`` measured every plan after ``fused-step`` about 2 GiB above its estimate: the
fused-step run's model, gradients and AdamW state were still allocated, and ``max_memory_allocated`` counted them
in each later run. A post-accumulate-grad hook bound to the optimizer made a cycle (parameter -> hook dict ->
method -> optimizer -> parameter) that Python's collector cannot break, since torch does not show a tensor's hook
dicts to it. On a CPU the tracker counts only what a run allocates, so nothing showed. These tests hold the CUDA
rule on the CPU: after ``measure`` returns, nothing of its model is alive.
"""
from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch

import colabkit
from colabkit.techniques._wrapper import weak_grad_hooks
from colabkit.techniques.fused_step import FusedStepOptimizer
from colabkit.techniques.offload_optimizer import HostOptimizer

trainer_mod = importlib.import_module("colabkit.trainer")


class _Owner:
    def __init__(self, params):
        self.params, self.seen = list(params), 0

    def hook(self, p):
        self.seen += 1


def test_bound_method_hook_leaks_negative_control():
    """The mechanism the tests below guard against: a bound-method hook survives gc.collect()."""
    w = torch.nn.Parameter(torch.ones(3))
    o = _Owner([w])
    w.register_post_accumulate_grad_hook(o.hook)
    ref = weakref.ref(o)
    del o, w
    gc.collect()
    assert ref() is not None  # leaked: torch hides the tensor's hook dict from the collector


def test_weak_hooks_run_then_go_with_their_owner():
    w = torch.nn.Parameter(torch.ones(3))
    o = _Owner([w])
    weak_grad_hooks(o, "hook", [w])
    (w * 2).sum().backward()
    assert o.seen == 1
    ref = weakref.ref(o)
    del o
    gc.collect()
    assert ref() is None and len(w._post_accumulate_grad_hooks) == 0
    (w * 2).sum().backward()  # no hook left: nothing runs, nothing raises


@pytest.mark.parametrize("make", ["fused", "host"])
def test_wrapped_optimizers_are_freed(make):
    m = torch.nn.Linear(8, 4)
    params = list(m.parameters())
    if make == "fused":
        opt = FusedStepOptimizer(torch.optim.AdamW(params, lr=1e-2), m)
    else:
        opt = HostOptimizer([{"params": params}], lambda g: torch.optim.AdamW(g, lr=1e-2))
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert len(opt.state) == 2  # the AdamW state exists (2 tensors x 2 params)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert all(len(p._post_accumulate_grad_hooks) == 0 for p in params)


@pytest.fixture
def captured(monkeypatch):
    refs = []
    orig = trainer_mod.Trainer.__init__

    def init(self, model, *a, **k):
        orig(self, model, *a, **k)
        refs.append(weakref.ref(next(self.model.parameters())))

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", init)
    return refs


@pytest.mark.parametrize("plan,sim", [("baseline", False), ("fused-step", False), ("chunked-ce", False),
                                      ("lora:8", False), ("offload:optimizer", True), ("offload:params", True),
                                      ("offload:activations", True), ("checkpoint+fused-step", False)])
def test_measure_leaves_nothing_of_its_model(captured, plan, sim):
    """With the collector off, what is alive after measure() returns is what measure itself left."""
    gc.collect()
    gc.disable()
    try:
        rec = colabkit.measure("gpt-tiny", plan, batch=2, seq=16, steps=2, device="cpu", offload_sim=sim)
        assert rec["ok"], rec["error"]
        assert len(captured) == 1
        assert captured[0]() is None, f"{plan}: the run's parameters are still allocated after measure() returned"
    finally:
        gc.enable()

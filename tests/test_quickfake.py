"""QuickFakeMode (the estimator's fake-tensor substrate) against torch's own FakeTensorMode, the reference: every op
a training step dispatches gives outputs of the same shapes, strides, dtypes, devices, storage sizes and aliasing,
and whole traces give the same report to the byte. Negative controls: a memo that forgets the dtype, and a direct
path that copies instead of aliasing, are both caught by the same comparison."""
import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import colabkit
from colabkit.estimate import quickfake
from colabkit.estimate.quickfake import QuickFakeMode
from colabkit.estimate.substitutes import trace_with_substitutes
from colabkit.models import build_model
from colabkit.plan import Plan

trace_mod = importlib.import_module("colabkit.estimate.trace")


class _Record(TorchDispatchMode):
    """Above the fake mode: each op's outputs as (shape, stride, offset, dtype, device, storage bytes, which input
    storage it shares or 'new')."""

    def __init__(self):
        super().__init__()
        self.rows: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        row = [str(func)]
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                st = id(o.untyped_storage())
                row.append((tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, str(o.device),
                            o.untyped_storage().nbytes(), inputs.index(st) if st in inputs else "new"))
        self.rows.append(tuple(row))
        return out


def _step_ops(mode_cls, autocast: bool = True, recorder: list | None = None, warm: bool = False) -> list:
    """Each op of two training steps of a small GPT (fp16 autocast on the CPU, a checkpointed block), as _Record
    sees it above ``mode_cls``; with the process's memo of op outputs emptied first unless ``warm``."""
    if not warm:
        quickfake._MEMO.clear()
    torch.manual_seed(0)
    rec = _Record()
    with mode_cls(allow_non_fake_inputs=True) as mode, rec:
        model = build_model("gpt:2x64", seq=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            x = torch.randint(0, 100, (2, 16))
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                h = model.drop(model.wte(x) + model.wpe(torch.arange(16)))
                h = torch.utils.checkpoint.checkpoint(model.blocks[0], h, use_reentrant=False)
                for b in model.blocks[1:]:
                    h = b(h)
                logits = model.lm_head(model.ln_f(h))
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), x.view(-1))
            # the same op on the same shapes in two dtypes (what a memo keyed without the dtype would confuse)
            _ = (logits.detach() * 2, logits.detach().float() * 2)
            # casts of a transposed and of an expanded (stride 0) tensor: the output's strides follow the input's
            _ = (logits.detach().transpose(0, 1).float(), model.wpe.weight[:1].expand(4, -1).to(torch.bfloat16))
            loss.backward()
            opt.step()
            opt.zero_grad()
    if recorder is not None:
        recorder.append(mode)
    return rec.rows


def test_each_op_of_a_step_matches_fake_tensor_mode():
    ref = _step_ops(FakeTensorMode)
    got = _step_ops(QuickFakeMode)
    assert len(ref) > 300
    assert got == ref
    assert _step_ops(QuickFakeMode, warm=True) == ref  # answered from the memo the first run filled


def test_most_ops_take_a_short_path():
    """The point of the module: in a step after the first, most ops are answered by the memo or the meta kernel
    directly, not by FakeTensorMode's dispatch (counted by the mode)."""
    modes: list = []
    _step_ops(QuickFakeMode, recorder=modes)
    memo, direct, slow = modes[0].served
    print(f"memo {memo}, meta kernel {direct}, FakeTensorMode {slow}")
    assert memo + direct >= 3 * slow > 0


class _ForgetsDtype(QuickFakeMode):
    def _arg(self, a):
        k = super()._arg(a)
        return k[:3] + k[4:] if isinstance(a, torch.Tensor) else k


class _CopiesViews(QuickFakeMode):
    def _run(self, func, types, args, kwargs, kind):
        out = super()._run(func, types, args, kwargs, kind)
        if kind & quickfake._PLAIN and isinstance(out, FakeTensor) and func is torch.ops.aten.t.default:
            with quickfake.in_kernel_invocation_manager(self):
                meta = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
            return self.fake_tensor_converter.from_meta_and_device(self, meta, out.fake_device)
        return out


@pytest.mark.parametrize("broken", [_ForgetsDtype, _CopiesViews])
def test_negative_controls_are_caught(broken):
    assert _step_ops(broken) != _step_ops(FakeTensorMode)


def test_data_dependent_ops_still_raise():
    """trace.values_needed turns FakeTensorMode's DynamicOutputShapeException into colabkit's refusal: the short
    paths must leave such ops to FakeTensorMode."""
    with QuickFakeMode():
        x = torch.empty(4)
        with pytest.raises(DynamicOutputShapeException):
            torch.nonzero(x)


def _report(model, plan, gpu=None):
    if gpu is not None:  # the whole estimate: GPU profile, offload split off, depth extrapolation, replays
        r = colabkit.estimate(model, plan, batch=2, seq=16, gpu=gpu, world_size=2 if "zero" in plan else 1)
        return {k: v for k, v in r.items() if k not in ("seconds",)}
    t = trace_with_substitutes(model, Plan.parse(plan), 2, 16, 2, 1, [])
    return {k: t[k] for k in ("peak_bytes", "breakdown", "at_peak", "peak_phase", "phase_peaks", "segment_peaks",
                              "counts", "params")}


@pytest.mark.parametrize("model,plan,gpu", [
    ("gpt:2x64", "baseline", None), ("gpt:2x64", "fp16+checkpoint+accum:2", None), ("gpt:2x64", "bf16+lora:4", None),
    ("gpt:2x64", "compress:int8+chunked-ce", None), ("gpt:2x64", "qlora:4+adamw8bit", None),
    ("llama:2x128", "fp16+checkpoint", None), ("gpt:6x64", "fp16+attention:math+offload:activations", "t4"),
    ("gpt:4x64", "zero:3+fp16", "t4")])
def test_traces_equal_fake_tensor_mode_to_the_byte(model, plan, gpu, monkeypatch):
    monkeypatch.setenv("COLABKIT_TRACE_CACHE", "off")
    monkeypatch.setattr(trace_mod, "_CACHE", type(trace_mod._CACHE)())
    got = _report(model, plan, gpu)
    monkeypatch.setattr(trace_mod, "_CACHE", type(trace_mod._CACHE)())
    for where in ("trace", "replay", "speed"):  # every estimator trace on the reference
        mod = importlib.import_module(f"colabkit.estimate.{where}")
        monkeypatch.setattr(mod, "QuickFakeMode", FakeTensorMode)
        if where == "replay":
            monkeypatch.setattr(mod, "_PROFILES", {})
            monkeypatch.setattr(mod, "_MADE", {})
    assert got == _report(model, plan, gpu)


def test_a_library_first_imported_by_a_trace_keeps_no_fake_tensor():
    """peft's LoHa has a ``torch.tensor(1)`` default argument: imported for the first time inside a trace's fake
    mode, it would keep a fake tensor for good (and the trace would count it). A fresh process traces lora first."""
    code = ("import importlib; tr = importlib.import_module('colabkit.estimate.trace'); "
            "tr.trace('gpt:2x64', 'lora:4', 2, 16); "
            "from peft.tuners.loha.layer import HadaWeight; "
            "print(type(HadaWeight.forward.__defaults__[-1]).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLABKIT_TRACE_CACHE": "off"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "Tensor"


@pytest.mark.parametrize("token", ["adamw", "sgd:0.9", "adafactor", "adamw8bit", "adamw4bit"])
def test_optimizer_replay_profiles_equal_fake_tensor_mode(token, monkeypatch):
    """The optimizer's step profiled on QuickFakeMode's fake parameters (estimate.replay) gives the profile
    FakeTensorMode gives: state bytes, scratch at each local peak, kernels counted."""
    replay = importlib.import_module("colabkit.estimate.replay")
    shapes = [(0.1, [((256, 128), torch.float32), ((1024, 128), torch.float32)]), (0.0, [((384,), torch.float32)])]
    call = [(0, [0, 1]), (1, [0])]

    def profile():
        monkeypatch.setattr(replay, "_PROFILES", {})
        monkeypatch.setattr(replay, "_MADE", {})
        opt = replay.optimizer_for(Plan.parse(token), 3e-4, shapes)
        assert opt is not None, token
        return replay.call_profile(opt, call, whole=True)
    got = profile()
    monkeypatch.setattr(replay, "QuickFakeMode", FakeTensorMode)
    assert got == profile()
    assert got.state_bytes > 0 or token.startswith("sgd")


def test_without_the_internals_it_is_fake_tensor_mode(monkeypatch):
    """Another torch without one of the internals the short paths call: every op goes through FakeTensorMode."""
    monkeypatch.setattr(quickfake, "_INTERNALS", False)
    modes: list = []
    assert _step_ops(QuickFakeMode, recorder=modes) == _step_ops(FakeTensorMode)
    assert modes[0].served[:2] == [0, 0]


def test_the_memo_keys_the_default_dtype():
    """A factory without ``dtype=`` (nn.Linear's weight) and ``int / 2`` make the default dtype: a model built
    under bf16 (``_from_config(cfg, dtype=torch.bfloat16)``) after an fp32 question must not get fp32 tensors from
    the memo (found by a review: a bf16-then-fp32 order halved the fp32 estimate)."""
    def ops(mode_cls):
        rec = _Record()
        with mode_cls() as mode, rec:
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                prev = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    torch.nn.Linear(8, 6)
                    torch.ones(3, 3, dtype=torch.int64) / 2
                finally:
                    torch.set_default_dtype(prev)
        return rec.rows
    quickfake._MEMO.clear()
    assert ops(QuickFakeMode) == ops(FakeTensorMode)


def test_trunc_normal_init_does_not_hang_a_trace():
    """torch's trunc_normal_ redraws while any value is out of bounds; a trace answers .item() with 1, so a module
    initialised with it (transformers' ViT, timm) looped for ever. In a subprocess with a time limit: estimated
    like the same module initialised with normal_ (the init writes no bytes)."""
    code = """
import torch, colabkit
class M(torch.nn.Module):
    def __init__(self, trunc):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        (torch.nn.init.trunc_normal_ if trunc else torch.nn.init.normal_)(self.lin.weight, std=0.02)
    def forward(self, x):
        return self.lin(x).square().mean()
inputs = {"x": torch.randn(4, 32)}
a = colabkit.estimate(lambda: M(True), "baseline", gpu=None, inputs=inputs, batch=4)["peak_bytes"]
b = colabkit.estimate(lambda: M(False), "baseline", gpu=None, inputs=inputs, batch=4)["peak_bytes"]
print(a, b)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLABKIT_TRACE_CACHE": "off"})
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = map(int, out.stdout.split()[-2:])
    assert a == b > 0

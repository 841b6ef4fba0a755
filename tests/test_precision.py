"""Mixed precision (fp16 / bf16): loss scaling in the style of PyTorch's own GradScaler tests, fp16
training against fp32, fp32 master weights, the bf16 refusal, and the activation saving."""
import math

import pytest
import torch

from colabkit import PlanError, TextData, Trainer, build_model, emulate_t4, measure, native_bf16
from colabkit.demos import fp16_overflow_demo
from colabkit.techniques.precision import autocast
from tests.conftest import requires_cuda


def _trainer(plan, seed=0):
    torch.manual_seed(seed)
    return Trainer(build_model("gpt-tiny"), plan, device="cpu")


def _batch(step=0):
    return TextData().batch(4, 32, step=step)


def test_inf_in_one_grad_skips_the_step_and_backs_off():
    t = _trainer("fp16")
    assert t.scaler.is_enabled() and t.scaler.get_scale() == 2.0**16
    p = t.model.blocks[0].fc.weight
    inject = {"on": True}
    p.register_hook(lambda g: torch.full_like(g, math.inf) if inject["on"] else g)
    before = [q.detach().clone() for q in t.model.parameters()]
    t.step(*_batch(0))
    # every weight unchanged (the step was skipped, not just the poisoned one) and the scale halved
    assert all(torch.equal(a, q) for a, q in zip(before, t.model.parameters()))
    assert t.scaler.get_scale() == 2.0**15
    # AdamW never updated: torch's fused kernel (colabkit's adamw, GradScaler-aware) allocates its moments but
    # leaves them at zero and rolls its step counter back on a found inf; the single-tensor path makes none
    assert all(not s or (float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any())
               for s in t.optimizer.state.values())
    inject["on"] = False
    t.step(*_batch(1))
    assert not torch.equal(before[0], next(t.model.parameters()))  # a clean step goes through
    assert t.scaler.get_scale() == 2.0**15  # growth only after growth_interval (2000) clean steps
    assert all(torch.isfinite(q).all() for q in t.model.parameters())


@pytest.mark.parametrize("plan", ["baseline", "bf16"])
def test_disabled_scaler_leaves_scale_at_one(plan):
    t = _trainer(plan)
    assert not t.scaler.is_enabled()
    loss = torch.tensor(2.5)
    assert t.scaler.scale(loss) is loss  # no multiplication at all
    t.step(*_batch(0))
    assert t.scaler.get_scale() == 1.0


def test_fp16_loss_tracks_fp32_and_weights_stay_fp32():
    fp32, fp16 = _trainer("baseline"), _trainer("fp16")
    l32 = [fp32.step(*_batch(s)) for s in range(6)]
    l16 = [fp16.step(*_batch(s)) for s in range(6)]
    assert l32[-1] < l32[0]  # it trains
    for a, b in zip(l32, l16):
        assert abs(a - b) / a < 5e-3, (l32, l16)
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())  # fp32 master weights


def _grads(plan):
    t = _trainer(plan)
    x, y = _batch(0)
    with t.forward_context():
        loss = t.loss(x, y, (y != -100).sum())
    t.scaler.scale(loss).backward()
    scale = t.scaler.get_scale()  # 2**16 for fp16, 1.0 (disabled) otherwise
    return torch.cat([p.grad.flatten() / scale for p in t.model.parameters()])


@pytest.mark.parametrize("plan,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_gradients_match_fp32_after_unscaling(plan, tol):
    # Rounding: fp16 keeps 11 mantissa bits (2**-11 ~ 5e-4), bf16 8 bits (2**-8 ~ 4e-3).
    g32, g16 = _grads("baseline"), _grads(plan)
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()
    rel = (g16 - g32).norm() / g32.norm()
    assert rel < tol, rel


def test_scaler_state_round_trips_through_the_checkpoint():
    t = _trainer("fp16")
    t.step(*_batch(0))
    t.scaler.update(1234.0)  # a non-default scale
    state = t.state_dict()
    t2 = _trainer("fp16")
    t2.load_state_dict(state)
    assert t2.scaler.get_scale() == 1234.0


def test_overflow_demo_skips_until_the_scale_fits():
    rows = fp16_overflow_demo(steps=10, init_scale=2.0**24, device="cpu")
    skipped = [r["skipped"] for r in rows]
    n = skipped.index(False)  # overflow steps come first, then every step goes through
    assert n >= 1 and not any(skipped[n:])
    for r in rows[:n]:
        assert r["next_scale"] == r["scale"] / 2
    assert rows[-1]["scale"] == 2.0**24 / 2**n


def test_bf16_refused_without_native_bf16_recommends_fp16():
    try:
        emulate_t4(True)
        assert not native_bf16()
        with pytest.raises(PlanError, match="fp16"):
            _trainer("bf16")
        _trainer("fp16")  # what it recommends works
    finally:
        emulate_t4(False)


def test_fp16_and_bf16_together_refused():
    with pytest.raises(PlanError, match="keep one"):
        _trainer("fp16+bf16")


def test_autocast_halves_what_matmuls_save():
    # Theory: fp32 master weights, so params/grads/optimizer are unchanged; matmul outputs and the
    # inputs they save are 2 bytes instead of 4. Norms, softmax and the fp32 loss stay fp32, so the
    # total activation saving is less than 2x at this size.
    base = measure("gpt:2x128", "baseline", batch=4, seq=64, steps=1, device="cpu")
    half = measure("gpt:2x128", "fp16", batch=4, seq=64, steps=1, device="cpu")
    assert half["ok"], half["error"]
    for c in ("params", "grads", "optimizer"):
        assert half["breakdown"][c] == base["breakdown"][c]
    ratio = half["breakdown"]["activations"] / base["breakdown"]["activations"]
    assert 0.5 <= ratio < 0.85, ratio
    assert abs(half["loss"] - base["loss"]) / base["loss"] < 1e-3


def test_autocast_fp32_is_a_disabled_autocast():
    with autocast("fp32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast("fp16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


@requires_cuda
def test_bf16_on_this_gpu_refused_or_runs():
    t = None
    if native_bf16():
        torch.manual_seed(0)
        t = Trainer(build_model("gpt-tiny"), "bf16", device="cuda")
        assert math.isfinite(t.step(*_batch(0)))
    else:
        with pytest.raises(PlanError, match="use fp16"):
            Trainer(build_model("gpt-tiny"), "bf16", device="cuda")


@requires_cuda
def test_fp16_on_cuda_tracks_fp32():
    losses = {}
    for plan in ("baseline", "fp16"):
        torch.manual_seed(0)
        t = Trainer(build_model("gpt-tiny"), plan, device="cuda")
        losses[plan] = [t.step(*_batch(s)) for s in range(4)]
    for a, b in zip(losses["baseline"], losses["fp16"]):
        assert abs(a - b) / a < 1e-2

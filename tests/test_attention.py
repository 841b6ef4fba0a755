"""attention:math|efficient|flash: same outputs and gradients across backends, the refusals, and
attention memory against sequence length (quadratic for math, linear for fused kernels)."""
import types

import pytest
import torch

from colabkit import PlanError, TextData, Trainer, build_model, emulate_t4, measure, sdpa_backends
from colabkit.techniques.attention import random_qkv, attention_memory, attention_run, quadratic_fit
from colabkit.plan import Context, Plan
from colabkit.techniques import attention as attention_mod
from tests.conftest import requires_cuda


def _compare(backends, device, dtype, atol):
    q, k, v = random_qkv(2, 4, 192, 64, torch.device(device), dtype, seed=1)
    ref_out, ref_grads = attention_run("math", q, k, v)
    for b in backends:
        out, grads = attention_run(b, q, k, v)
        assert torch.allclose(out.float(), ref_out.float(), atol=atol), (b, (out - ref_out).abs().max())
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g.float(), r.float(), atol=atol * 10, rtol=1e-2), (b, (g - r).abs().max())


def test_default_cpu_kernel_equals_math():
    _compare(["default"], "cpu", torch.float32, atol=1e-5)


def test_attention_math_plan_equals_plain_training():
    losses = {}
    for plan in ("baseline", "attention:math"):
        torch.manual_seed(0)
        t = Trainer(build_model("gpt-tiny"), plan, device="cpu")
        losses[plan] = [t.step(*TextData().batch(2, 64, step=s)) for s in range(3)]
    for a, b in zip(losses["baseline"], losses["attention:math"]):
        assert abs(a - b) / a < 1e-5


@pytest.mark.parametrize("token", ["attention:flash", "attention:efficient"])
def test_cpu_refuses_what_it_cannot_force(token):
    with pytest.raises(PlanError, match="only attention:math can be forced"):
        Trainer(build_model("gpt-tiny"), "fp16+" + token, device="cpu")
    with pytest.raises(PlanError, match="only attention:math"):
        attention_memory(token.split(":")[1], seqs=(64,), device="cpu")


def test_flash_needs_half_precision_on_any_device(monkeypatch):
    """On an H200 (2026-11-27) attention:flash in fp32 failed in its first forward ('No available kernel'):
    its kernels take fp16/bf16 only. Refused before anything runs, on any device, with what to add."""
    with pytest.raises(PlanError, match="fp16 and bf16 only.*'fp16\\+attention:flash'"):
        Trainer(build_model("gpt-tiny"), "attention:flash", device="cpu")
    # where the GPU has flash (an sm80+ card's facts), a half-precision plan passes the check
    monkeypatch.setattr(attention_mod, "sdpa_backends", lambda dev: ["math", "efficient", "flash"])
    ctx = Context(device=torch.device("cuda"))
    for plan in ("fp16+attention:flash", "bf16+attention:flash"):
        attention_mod._check(Plan.parse(plan), ctx)
    with pytest.raises(PlanError, match="fp16 and bf16 only"):
        attention_mod._check(Plan.parse("checkpoint+attention:flash"), ctx)


@pytest.mark.parametrize("token", ["attention", "attention:fast"])
def test_bad_backend_names_the_choices(token):
    with pytest.raises(PlanError, match="attention:math, attention:efficient or attention:flash"):
        Trainer(build_model("gpt-tiny"), token, device="cpu")


def test_hf_eager_attention_is_refused_not_ignored():
    model = build_model("gpt-tiny")
    model.config = types.SimpleNamespace(_attn_implementation="eager")
    with pytest.raises(PlanError, match="attn_implementation='sdpa'"):
        Trainer(model, "attention:math", device="cpu")


def test_math_attention_memory_is_quadratic_default_cpu_is_linear():
    seqs = (128, 256, 512)
    math_rows = attention_memory("math", seqs=seqs, device="cpu")
    fused_rows = attention_memory("default", seqs=seqs, device="cpu")
    # Theory: math keeps the softmax probabilities (one B·H·S² matrix) for backward and makes the
    # scores as another while running forward: at least 2 matrices in the S² term.
    fit = quadratic_fit(math_rows)
    assert fit["matrices"] >= 2, fit
    assert math_rows[-1]["activations"] / math_rows[-2]["activations"] > 3.3
    # The fused CPU kernel keeps the output and a (B, H, S) log-sum-exp: no S² term, doubling S doubles it.
    fit = quadratic_fit(fused_rows)
    assert abs(fit["matrices"]) < 0.01, fit
    assert 1.9 < fused_rows[-1]["activations"] / fused_rows[-2]["activations"] < 2.1
    assert math_rows[-1]["activations"] > 5 * fused_rows[-1]["activations"]


def test_attention_math_plan_adds_one_matrix_per_layer():
    # In a whole model the math backend keeps one probability matrix per layer beyond the fused kernel.
    L, B, H, S = 2, 2, 2, 256  # gpt:2x128 has 2 heads of 64
    base = measure("gpt:2x128", "baseline", batch=B, seq=S, steps=1, device="cpu")
    math_ = measure("gpt:2x128", "attention:math", batch=B, seq=S, steps=1, device="cpu")
    extra = math_["breakdown"]["activations"] - base["breakdown"]["activations"]
    matrix = B * H * S * S * 4
    assert 0.95 * L * matrix <= extra <= 1.5 * L * matrix, (extra, L * matrix)
    assert abs(math_["loss"] - base["loss"]) / base["loss"] < 1e-5


@requires_cuda
def test_cuda_backends_agree():
    have = [b for b in ("efficient", "flash") if b in sdpa_backends("cuda")]
    _compare(have, "cuda", torch.float16, atol=2e-3)


@requires_cuda
def test_cuda_efficient_is_linear_math_quadratic():
    seqs = (512, 1024, 2048)
    eff = attention_memory("efficient", seqs=seqs, device="cuda")
    mat = attention_memory("math", seqs=seqs, device="cuda")
    assert abs(quadratic_fit(eff)["matrices"]) < 0.05
    assert quadratic_fit(mat)["matrices"] >= 1
    assert 1.8 < eff[-1]["activations"] / eff[-2]["activations"] < 2.2


@requires_cuda
def test_t4_emulation_refuses_flash_recommends_efficient():
    try:
        emulate_t4(True)
        with pytest.raises(PlanError, match="use attention:efficient"):
            Trainer(build_model("gpt-tiny"), "fp16+attention:flash", device="cuda")
        Trainer(build_model("gpt-tiny"), "attention:efficient", device="cuda")
    finally:
        emulate_t4(False)


# ----- the backend inside recomputation (checkpoint, offload:params' streamed blocks) --------------
def _losses(plan, steps=2, **kw):
    torch.manual_seed(0)
    t = Trainer(build_model("gpt-tiny"), plan, device="cpu", **kw)
    return [t.step(*TextData().batch(2, 32, step=s)) for s in range(steps)]


def _spy_backends(monkeypatch):
    """Record, at each SDPA call, whether the forced backend's flags hold (only math enabled)."""
    import torch.nn.functional as F
    seen, real = [], F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled())
        return real(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def test_checkpoint_recomputes_under_the_same_backend(monkeypatch):
    # before the recompute context: the recompute ran torch's default CPU kernel -> CheckpointError
    ref = _losses("attention:math")
    seen = _spy_backends(monkeypatch)
    got = _losses("attention:math+checkpoint")
    for a, b in zip(ref, got):
        assert abs(a - b) / a < 1e-5
    n_layer = build_model("gpt-tiny").config.n_layer
    assert len(seen) == 2 * 2 * n_layer and all(seen), seen  # forward + recompute per block, each under math
    seen.clear()  # negative control: the checkpoint alone recomputes under torch's default flags
    _losses("checkpoint", steps=1)
    assert len(seen) == 2 * n_layer and all(seen) is False and not any(seen)


def test_streamed_blocks_recompute_under_the_same_backend(monkeypatch):
    ref = _losses("attention:math", offload_sim=True)
    seen = _spy_backends(monkeypatch)
    got = _losses("attention:math+offload:params", offload_sim=True)
    for a, b in zip(ref, got):
        assert abs(a - b) / a < 1e-5
    assert len(seen) >= 4 and all(seen), seen
    seen.clear()  # negative control: streamed blocks without the token recompute under the default flags
    _losses("offload:params", steps=1, offload_sim=True)
    assert seen and not any(seen)


def test_recompute_context_negative_control(monkeypatch):
    # without the recompute context the checkpointed recompute leaves math (the bug this guards)
    from colabkit.techniques import checkpoint as ck
    import contextlib
    monkeypatch.setattr(ck, "_context_fn", lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        _losses("attention:math+checkpoint", steps=1)


def test_cli_bench_attention_math_with_checkpoint(tmp_path):
    """The issue's command: `bench --plan attention:math+checkpoint` died with CheckpointError on the CPU."""
    import json
    from colabkit.__main__ import main
    path = str(tmp_path / "bench.json")
    assert main(["bench", "--model", "gpt-tiny", "--plan", "attention:math", "--plan", "attention:math+checkpoint",
                 "--batch", "2", "--seq", "32", "--steps", "2", "--device", "cpu", "--json", path]) == 0
    with open(path) as f:
        alone, both = json.load(f)["results"]
    assert alone["ok"] and both["ok"], both["error"]
    assert abs(both["loss"] - alone["loss"]) <= 1e-5 * alone["loss"]
    assert both["breakdown"]["activations"] < alone["breakdown"]["activations"]  # the checkpoint did act

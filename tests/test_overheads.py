"""The GPU overhead terms: each against its reference (torch's source constants, a measurement of the
optimizer's step on the CPU, hand arithmetic), the estimate's device need and verdict, the issue's
done-when figures, and the GPU profiles."""
import math

import pytest
import torch

from colabkit.env import GPU_PROFILES, profile_for
from colabkit.estimate import _fast_estimate, estimate, gpt2_shape, largest
from colabkit.estimate import overheads as ov
from colabkit.memory import MemoryTracker
from colabkit.models import GPT
from colabkit.plan import Context, REGISTRY
from tests.conftest import requires_cuda


def step_temporaries(**kw) -> tuple[int, int, int]:
    """Bytes torch.optim.AdamW allocates inside one step (state already exists), counted by the tracker."""
    shapes = [(512, 256), (256,), (1024, 256), (300, 300)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = torch.optim.AdamW(params, lr=1e-3, **kw)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    tracker = MemoryTracker(device="cpu", alert_at=None)
    with tracker:
        tracker.reset_peaks()
        opt.step()
    n = sum(p.numel() for p in params)
    return tracker.report()["peak_bytes"], n, max(p.numel() for p in params)


def test_adamw_foreach_allocates_4_bytes_per_param_fused_none():
    foreach, n, _ = step_temporaries(foreach=True)
    fused, _, _ = step_temporaries(fused=True)
    single, _, biggest = step_temporaries(foreach=False)
    # torch/optim/adamw.py _multi_tensor_adamw: torch._foreach_sqrt(exp_avg_sqs) -> one fp32 copy of every moment
    assert foreach == pytest.approx(ov.ADAMW_FOREACH_BYTES_PER_PARAM * n, rel=0.01)
    assert fused == 0
    assert single == pytest.approx(2 * 4 * biggest, rel=0.01)  # what the CPU trace sees: 2x the largest tensor


def test_baseline_adamw_is_fused_wherever_torch_has_the_kernel():
    """issue 25: torch has fused AdamW on the CPU too, so the adamw token uses it there (and on host
    copies of offloaded parameters, whatever the run's device); a parameter on a device without the
    kernel (meta here) gets torch's default."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    make = REGISTRY["adamw"].make_optimizer
    assert make([{"params": [p]}], None, Context(device=torch.device("cuda"))).defaults["fused"] is True  # host copies
    assert make([{"params": [p]}], None, Context(device=torch.device("cpu"))).defaults["fused"] is True
    meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    assert not make([{"params": [meta]}], None, Context(device=torch.device("cpu"))).defaults["fused"]


@requires_cuda
def test_baseline_adamw_is_fused_on_cuda():
    p = torch.nn.Parameter(torch.randn(4, 4, device="cuda"))
    opt = REGISTRY["adamw"].make_optimizer([{"params": [p]}], None, Context(device=torch.device("cuda")))
    assert opt.defaults["fused"] is True


def test_cublas_workspace_sizes_follow_torch():
    # aten/src/ATen/cuda/CublasHandlePool.cpp: ":4096:2:16:8" by default, ":4096:8" on sm90
    assert ov.cublas_workspace_bytes((7, 5), "") == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert ov.cublas_workspace_bytes((9, 0), "") == 32 * 2**20
    assert ov.cublas_workspace_bytes((7, 5), ":16:8") == 128 * 1024
    assert ov.cublas_workspace_bytes((7, 5), ":4096:2:16:8") == ov.cublas_workspace_bytes((7, 5), "")
    assert ov.cublas_workspace_bytes((7, 5), "junk") == ov.CUBLAS_DEFAULT  # torch warns and uses its default


def test_segment_tails_follow_the_caching_allocator():
    MiB = 2**20
    assert ov.segment_tail(9 * MiB) == 0          # 1-10 MiB: shares 20 MiB segments
    assert ov.segment_tail(10 * MiB) == 0         # already a multiple of 2 MiB
    assert ov.segment_tail(11 * MiB) == MiB       # rounded up to 12 MiB
    # gpt2's embedding 50257 x 768 fp32 = 154,389,504 B -> 148 MiB segment
    assert ov.segment_tail(50257 * 768 * 4) == 148 * MiB - 50257 * 768 * 4


def test_terms_by_plan():
    t4 = GPU_PROFILES["t4"]
    shapes = [(50257, 768)] + [(768, 3072)] * 4
    base = ov.terms(t4, "baseline", shapes, peak_bytes=2**30)
    assert base["fragmentation"].nbytes == int(ov.FRAGMENTATION * 2**30)
    # weight, grad, two AdamW moments: four 148 MiB segments for the embedding; 9 MiB matrices share segments
    assert base["allocator_rounding"].nbytes == 4 * ov.segment_tail(50257 * 768 * 4)
    assert base["cuda_context"].nbytes == ov.CONTEXT_LADDER["torch"][0] + ov.CONTEXT_LADDER["cublas"][0]
    q = ov.terms(t4, "qlora:16", [(768, 16)], peak_bytes=2**30, frozen=[(50257 * 768, False), (768 * 3072, True)])
    assert q["nf4_dequant"].nbytes == 2 * 768 * 3072  # fp16 copy of the largest quantized linear
    assert q["cuda_context"].nbytes > base["cuda_context"].nbytes  # bitsandbytes' kernels
    assert "nf4_dequant" not in base
    hf = ov.terms(t4, "baseline", shapes, 2**30, transformers_model=True)
    assert hf["cuda_context"].nbytes - base["cuda_context"].nbytes == ov.CONTEXT_LADDER["transformers"][0]
    # adamw8bit loads bitsandbytes' kernels only where bitsandbytes steps it (make_optimizer's rule): under
    # fused-step colabkit's own 8-bit kernel (plain torch) steps it, so no bitsandbytes context (control: without)
    bnb = ov.terms(t4, "adamw8bit", shapes, 2**30)["cuda_context"].nbytes
    own = ov.terms(t4, "adamw8bit+fused-step", shapes, 2**30)["cuda_context"].nbytes
    assert bnb - base["cuda_context"].nbytes == ov.CONTEXT_LADDER["bitsandbytes"][0]
    assert own == base["cuda_context"].nbytes
    assert ov.terms(t4, "paged-adamw8bit", shapes, 2**30)["cuda_context"].nbytes == bnb  # bitsandbytes' only


def test_estimate_json_has_overheads_and_device_need(monkeypatch, tmp_path):
    # issue 12 done-when: gpt2-124m, baseline, batch 1, seq 1024, t4
    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))  # no stored calibration
    r = estimate("gpt2-124m", "baseline", batch=1, seq=1024, gpu="t4")
    assert {"cuda_context", "cublas_workspace", "allocator_rounding", "fragmentation", "optimizer_step"} <= set(r["overheads"])
    dev = r["resources"]["device"]
    assert dev["need"] == r["peak_bytes"] + sum(r["overheads"].values())
    assert dev["uncertainty"] == sum(t["uncertainty"] for t in r["overhead_terms"].values()) > 0
    assert r["budget_bytes"] == GPU_PROFILES["t4"]["capacity_bytes"]
    assert r["verdict"] == "fits" and r["margin_bytes"] == r["budget_bytes"] - dev["need"]
    assert all(t["source"] for t in r["overhead_terms"].values())
    # the same need against a budget inside its uncertainty is "tight"; below the need, "does not fit"
    tight = estimate("gpt:2x64", "baseline", batch=2, seq=16, gpu="t4", budget_bytes=1)
    assert tight["verdict"] == "does not fit"
    need = estimate("gpt:2x64", "baseline", batch=2, seq=16, gpu="t4")["resources"]["device"]
    r2 = estimate("gpt:2x64", "baseline", batch=2, seq=16, gpu="t4", budget_bytes=need["need"] + need["uncertainty"] // 2)
    assert r2["verdict"] == "tight" and r2["fits"]


def test_overheads_keep_the_first_model_above_085b_off_a_t4(monkeypatch, tmp_path):
    """Fast twin of the test below (issue 12: largest baseline on a T4 at most 0.85B, moved there by the GPU
    terms) with two estimates instead of a bisection: the smallest GPT-2 shape above 0.85B does not fit
    while its tensors alone would (peak < budget < device need), and the smallest above 0.5B fits."""
    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))
    with torch.device("meta"):
        n = {w: sum(p.numel() for p in GPT(gpt2_shape(w)).parameters()) for w in (1408, 1472, 1728, 1792)}
    assert n[1472] > 0.5e9 >= n[1408] and n[1792] > 0.85e9 >= n[1728]  # the smallest such widths
    nxt = _fast_estimate(gpt2_shape(1792), "baseline", 1, 1024, "t4", None)
    assert not nxt["fits"]
    assert nxt["peak_bytes"] < nxt["budget_bytes"] < nxt["resources"]["device"]["need"]  # the tensors alone would fit
    assert _fast_estimate(gpt2_shape(1472), "baseline", 1, 1024, "t4", None)["fits"]


@pytest.mark.slow  # fast twin: test_overheads_keep_the_first_model_above_085b_off_a_t4
def test_largest_baseline_t4_with_overheads(monkeypatch, tmp_path):
    # issue 12 done-when: at most 0.85B (16 B/param plus the GPU terms); the overheads must be what moved it
    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))
    r = largest("baseline", seq=1024, batch=1, gpu="t4")
    assert 0.5e9 < r["params"] <= 0.85e9
    width = int(r["model"].split("x")[1].split(":")[0])
    nxt = _fast_estimate(gpt2_shape(width + 64), "baseline", 1, 1024, "t4", None)
    assert nxt["peak_bytes"] < nxt["budget_bytes"] < nxt["resources"]["device"]["need"]  # the tensors alone would fit


def test_profiles_have_capacity_and_sources():
    for key in ("t4", "t4x2", "p100", "l4", "a100"):
        p = GPU_PROFILES[key]
        assert p["capacity_bytes"] < p["total_bytes"] and p["source"] and p["host_ram_bytes"] > 0
        assert p["native_bf16"] == (p["capability"][0] >= 8)
        assert ("flash" in p["sdpa"]) == (p["capability"][0] >= 8)
    assert GPU_PROFILES["t4x2"]["count"] == 2
    assert profile_for("Tesla T4") == "t4"
    assert profile_for("Tesla T4", count=2, platform="kaggle") == "t4x2"
    assert profile_for("Tesla P100-PCIE-16GB", platform="kaggle") == "p100"
    assert profile_for("NVIDIA L4") == "l4"
    assert profile_for("NVIDIA A100-SXM4-40GB") == "a100"
    assert profile_for("NVIDIA A100-SXM4-80GB") == "a100-80gb" and profile_for("NVIDIA H100 80GB HBM3") == "h100"
    assert profile_for("NVIDIA GeForce RTX 3090") is None
    l4 = estimate("gpt:2x64", "baseline", batch=2, seq=16, gpu="l4")
    assert l4["budget_bytes"] == GPU_PROFILES["l4"]["capacity_bytes"]
    assert math.isclose(l4["overheads"]["cublas_workspace"], 2 * ov.CUBLAS_DEFAULT)  # sm89: the 8 MiB default

"""Low-memory optimizers: updates against the 32-bit reference (bitsandbytes-style, parameters
re-synced each step), exact state_dict round trips, state bytes measured against theory, and the
issue's "done when" bench on gpt:8x256."""
import io

import pytest
import torch

from colabkit.memory import MemoryTracker
from colabkit.plan import Context, Plan, PlanError
from colabkit.techniques.optimizers import (
    AdamW4bit, dequantize_signed4, dequantize_sqrt4, make_optimizer, optimizer_state_bytes, quantize_signed4,
    quantize_sqrt4,
)
from colabkit.train import measure

bnb = pytest.importorskip("bitsandbytes")

SHAPE = (64, 128)  # 8192 elements: above the 4096 threshold, so the state is quantized
KW = dict(lr=1e-3, weight_decay=0.0)


def _update_errors(make_q, make_ref, steps=20):
    """Relative error and cosine of the quantized update vs the reference update, re-syncing the
    parameters after every step (so errors do not compound), as bitsandbytes' own tests do."""
    p1 = torch.nn.Parameter(torch.randn(SHAPE) * 0.1)
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = make_q([p1]), make_ref([p2])
    rel, cos = [], []
    for _ in range(steps):
        g = torch.randn(SHAPE) * 0.01
        p1.grad, p2.grad = g.clone(), g.clone()
        before = p2.detach().clone()
        o1.step()
        o2.step()
        d1, d2 = (p1.detach() - before).flatten(), (p2.detach() - before).flatten()
        rel.append(((d1 - d2).norm() / d2.norm()).item())
        cos.append(torch.nn.functional.cosine_similarity(d1, d2, dim=0).item())
        p1.data.copy_(p2.data)
    return max(rel), min(cos)


# Tolerances from the quantizers' resolution: 8-bit dynamic blockwise moments err by ~1-2% of the
# update; 4-bit linear moments (15 levels for m, 16 for sqrt v, per 128 values) by ~20-25%;
# 8-bit Lion flips the sign of near-zero momentum entries (~10% of the update's norm).
@pytest.mark.parametrize("name,make_q,make_ref,max_rel,min_cos", [
    ("adamw8bit", lambda p: bnb.optim.AdamW8bit(p, **KW), lambda p: torch.optim.AdamW(p, **KW), 0.05, 0.998),
    ("adamw4bit", lambda p: AdamW4bit(p, **KW), lambda p: torch.optim.AdamW(p, **KW), 0.35, 0.94),
    ("lion8bit", lambda p: bnb.optim.Lion8bit(p, **KW), lambda p: bnb.optim.Lion(p, **KW), 0.20, 0.98),
])
def test_quantized_update_tracks_32bit_reference(name, make_q, make_ref, max_rel, min_cos):
    rel, cos = _update_errors(make_q, make_ref)
    assert rel < max_rel, f"{name}: update error {rel:.3f} vs 32-bit"
    assert cos > min_cos, f"{name}: update direction cosine {cos:.4f}"


def test_adamw4bit_small_tensors_are_exact_adamw():
    # under min_4bit_size the state stays fp32: the update must equal torch AdamW's
    p1 = torch.nn.Parameter(torch.randn(300))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = AdamW4bit([p1], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([p2], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(300)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(p1, p2)


def test_adamw4bit_chunked_update_equals_whole_tensor_update():
    # chunks bound the scratch memory; they must not change a single bit of the result
    p1 = torch.nn.Parameter(torch.randn(10000))  # not a multiple of the chunk or the block
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = AdamW4bit([p1], **KW), AdamW4bit([p2], **KW)
    o1.CHUNK = 256  # 40 chunks, the last one partial
    for _ in range(3):
        g = torch.randn(10000)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.equal(p1, p2)
    assert all(torch.equal(o1.state[p1][k], o2.state[p2][k]) for k in o1.state[p1])


def test_4bit_quantizers_error_bounds():
    x = torch.randn(4096)
    q, a = quantize_signed4(x)
    assert q.dtype == torch.uint8 and q.numel() == 2048 and a.numel() == 32
    err = (dequantize_signed4(q, a, x.shape) - x).abs().view(32, 128)
    assert (err <= a[:, None] / 14 + 1e-6).all()  # half a step of absmax/7
    v = torch.rand(4096) ** 4
    q, a = quantize_sqrt4(v)
    s = dequantize_sqrt4(q, a, v.shape).sqrt()
    assert (s > 0).all()  # no zero level: m / sqrt(v) stays finite
    err, true = (s - v.sqrt()).abs().view(32, 128), v.sqrt().view(32, 128)
    assert (err <= a[:, None] / 16 + 1e-6).all()  # below the first level: rounded up to absmax/16
    above = true >= a[:, None] / 32
    assert (err[above] <= (a[:, None] / 32).expand_as(err)[above] + 1e-6).all()  # half a level


def _roundtrip(make):
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(SHAPE))
    opt = make([p])
    for _ in range(3):
        p.grad = torch.randn(SHAPE)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = make([q])
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    return p, opt, q, opt2


@pytest.mark.parametrize("make", [lambda p: AdamW4bit(p, **KW), lambda p: bnb.optim.AdamW8bit(p, **KW),
                                  lambda p: bnb.optim.Lion8bit(p, **KW)], ids=["adamw4bit", "adamw8bit", "lion8bit"])
def test_state_dict_roundtrip_is_exact(make):
    p, opt, q, opt2 = _roundtrip(make)
    s1, s2 = opt.state[p], opt2.state[q]
    assert set(s1) == set(s2)
    quantized = [k for k, v in s1.items() if torch.is_tensor(v) and v.dtype == torch.uint8]
    assert quantized, "the state should hold quantized (uint8) tensors"
    for k, v in s1.items():
        if torch.is_tensor(v):
            assert v.dtype == s2[k].dtype and torch.equal(v, s2[k]), k
        else:
            assert v == s2[k], k
    g = torch.randn(SHAPE)  # the next step is identical too
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)


def test_param_groups_exclude_norms_and_biases_from_decay():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for tok in ("adamw4bit", "adafactor", "sgd", "adamw8bit", "lion"):
        opt = make_optimizer(m, tok, weight_decay=0.1)
        decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        assert decay == {id(m[0].weight)}, tok


def test_refusals_and_parsing():
    with pytest.raises(PlanError, match="nothing|no GPU memory"):
        Plan.parse("paged-adamw8bit").check(Context(device=torch.device("cpu")))
    with pytest.raises(PlanError, match="both choose the optimizer"):
        Plan.parse("lion+adamw8bit")
    with pytest.raises(PlanError, match="momentum"):
        Plan.parse("sgd:2")
    assert Plan.parse("sgd:0.9").get("sgd") == 0.9


def test_missing_bitsandbytes_is_a_clear_plan_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(PlanError, match="pip install bitsandbytes"):
        Plan.parse("adamw8bit").check(Context(device=torch.device("cpu")))


@pytest.mark.parametrize("tok", ["adamw", "adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "sgd:0.9"])
def test_measured_state_bytes_match_theory(tok):
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 64))
    opt = make_optimizer(m, tok)
    with MemoryTracker(m, opt, device="cpu") as mt:
        with mt.phase("forward"):
            loss = m(torch.randn(4, 256)).square().mean()
        with mt.phase("backward"):
            loss.backward()
        with mt.phase("optimizer"):
            opt.step()
    measured = mt.report()["breakdown"]["optimizer"]
    theory = optimizer_state_bytes(m, tok)
    # theory ignores per-tensor scalars (step counters, shared quantization maps): at most ~2 KiB here
    assert theory <= measured <= theory + 2048, (tok, measured, theory)


# ----- the "done when": bench on gpt:8x256, seq 128, batch 8, 2 steps, on the CPU --------
PLANS = ["baseline", "adamw8bit", "adamw4bit", "lion", "adafactor", "fused-step"]


@pytest.fixture(scope="module")
def bench():
    torch.manual_seed(0)
    return {p: measure("gpt:8x256", p, batch=8, seq=128, steps=2, device="cpu") for p in PLANS}


def test_done_when_bench(bench):
    base = bench["baseline"]
    assert all(r["ok"] for r in bench.values()), {p: r["error"] for p, r in bench.items()}
    opt = {p: r["breakdown"]["optimizer"] / base["breakdown"]["optimizer"] for p, r in bench.items()}
    assert opt["adamw8bit"] <= 0.30 and opt["adamw4bit"] <= 0.20, opt
    assert opt["lion"] <= 0.55 and opt["adafactor"] <= 0.15, opt
    assert bench["fused-step"]["breakdown"]["grads"] <= 0.2 * base["breakdown"]["grads"]
    for p, r in bench.items():
        assert abs(r["loss"] - base["loss"]) <= 0.05 * base["loss"], (p, r["loss"], base["loss"])

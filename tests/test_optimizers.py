"""Low-memory optimizers: updates against the 32-bit reference (bitsandbytes-style, parameters
re-synced each step), exact state_dict round trips, state bytes measured against theory, and the
issue's "done when" bench on gpt:8x256."""
import io
import math
import unittest.mock

import pytest
import torch

from colabkit.memory import MemoryTracker
from colabkit.plan import Context, Plan, PlanError
from colabkit.techniques.optimizers import (
    AdamW4bit, AdamW8bit, dequantize_signed4, dequantize_sqrt4, make_optimizer, optimizer_state_bytes, quantize_signed4,
    quantize_sqrt4,
)
from colabkit.train import measure
from tests.conftest import requires_cuda

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
                                  lambda p: AdamW8bit(p, **KW), lambda p: bnb.optim.Lion8bit(p, **KW)],
                         ids=["adamw4bit", "bnb-adamw8bit", "colabkit-adamw8bit", "lion8bit"])
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
        Plan.parse("lion8bit").check(Context(device=torch.device("cpu")))
    with pytest.raises(PlanError, match="pip install bitsandbytes"):  # on CUDA adamw8bit is bitsandbytes' kernel
        Plan.parse("adamw8bit").check(Context(device=torch.device("cuda")))
    Plan.parse("adamw8bit").check(Context(device=torch.device("cpu")))  # elsewhere colabkit's AdamW8bit: torch only


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


# ----- the "done when": bench on gpt:8x256, 2 steps, on the CPU --------------------------
PLANS = ["baseline", "adamw8bit", "adamw4bit", "lion", "adafactor", "fused-step"]


@pytest.fixture(scope="module")
def bench():
    # The issue ran batch 8 x seq 128; the optimizer-state and gradient bytes compared below are a function
    # of the weights alone, the same at batch 2 x seq 32 (4x less compute).
    torch.manual_seed(0)
    return {p: measure("gpt:8x256", p, batch=2, seq=32, steps=2, device="cpu") for p in PLANS}


def test_done_when_bench(bench):
    base = bench["baseline"]
    assert all(r["ok"] for r in bench.values()), {p: r["error"] for p, r in bench.items()}
    opt = {p: r["breakdown"]["optimizer"] / base["breakdown"]["optimizer"] for p, r in bench.items()}
    assert opt["adamw8bit"] <= 0.30 and opt["adamw4bit"] <= 0.20, opt
    assert opt["lion"] <= 0.55 and opt["adafactor"] <= 0.15, opt
    assert bench["fused-step"]["breakdown"]["grads"] <= 0.2 * base["breakdown"]["grads"]
    # Two steps cannot tell optimizers apart (Adam's first steps are lr·sign(g)): correctness is the
    # 20-step equivalence tests above; here only that every plan trained.
    assert all(math.isfinite(r["loss"]) for r in bench.values())


# ----- equivalence over 20 steps against independent references, each with a negative control --------
LR, WD, N_STEPS = 1e-3, 1e-2, 20


def lion_reference(params, lr=LR, betas=(0.9, 0.99), weight_decay=WD):
    """Lion as published (Chen et al. 2023, Algorithm 2): c = β1·m + (1-β1)·g; p ← p·(1-lr·λ) - lr·sign(c);
    m ← β2·m + (1-β2)·g."""
    class Lion(torch.optim.Optimizer):
        @torch.no_grad()
        def step(self):
            for grp in self.param_groups:
                b1, b2 = grp["betas"]
                for p in grp["params"]:
                    m = self.state[p].setdefault("m", torch.zeros_like(p))
                    p.mul_(1 - grp["lr"] * grp["weight_decay"]).add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-grp["lr"])
                    m.mul_(b2).add_(p.grad, alpha=1 - b2)
    return Lion(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))


def adamw_reference(**kw):
    kw = dict(dict(lr=LR, weight_decay=WD), **kw)
    return lambda params: torch.optim.AdamW(params, **kw)


def _pair(test, reference, device="cpu"):
    """A (64, 128) weight (quantized state: >= 4096 values) under colabkit's optimizer ``test`` (a plan
    token, or a factory) and a copy under ``reference``; bitsandbytes' setup: p ~ 0.1·N(0,1), g ~ 0.01·N(0,1)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(128, 64, bias=False, device=device)
    with torch.no_grad():
        m.weight.copy_(torch.randn(64, 128) * 0.1)
    ref = torch.nn.Parameter(m.weight.detach().clone())
    opt = make_optimizer(m, test, lr=LR, weight_decay=WD, device=device) if isinstance(test, str) else test([m.weight])
    return m.weight, opt, ref, reference([ref])


def _steps(p, opt, ref, ref_opt, resync):
    """Run N_STEPS on the same gradients; per step the fraction of weights not close in bitsandbytes'
    fp32 tolerances (atol 1e-5, rtol 1e-3); with ``resync`` the weights are copied back after each
    step as bitsandbytes' tests do (the error is per step, not compounded)."""
    start, not_close = ref.detach().clone(), []
    for _ in range(N_STEPS):
        g = torch.randn(p.shape, device=p.device) * 0.01
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        not_close.append((~torch.isclose(p, ref, atol=1e-5, rtol=1e-3)).float().mean().item())
        if resync:
            p.data.copy_(ref.data)
    drift = ((p - ref).norm() / (ref - start).norm()).item()  # weight error relative to how far they moved
    return max(not_close), drift


@pytest.mark.parametrize("ref,ok", [(adamw_reference(), True), (adamw_reference(betas=(0.8, 0.999)), False),
                                    (adamw_reference(lr=1.2 * LR), False)], ids=["adamw", "wrong-beta1", "wrong-lr"])
def test_adamw8bit_tracks_torch_adamw(ref, ok):
    """bitsandbytes-style: at every one of 20 steps at most 1% of the weights outside (1e-5, 1e-3)
    (measured: 0.9%); after 20 steps without re-syncing, the weights within 3% of the distance moved
    (measured 1.6%). A wrong beta1 or lr in the reference breaks both (>= 15%)."""
    frac, _ = _steps(*_pair("adamw8bit", ref), resync=True)
    _, drift = _steps(*_pair("adamw8bit", ref), resync=False)
    assert (frac <= 0.01 and drift <= 0.03) == ok, (frac, drift)


def torchao_adamw4bit(compiled=False, **kw):
    """torchao's AdamW4bit. Its step is ``torch.compile(single_param_adam)``; Inductor compiling it costs
    ~15-25 s of CPU per process, so by default the same function runs eagerly (the same ops on the same
    4-bit state: the same weights to the last bit, drift 0.28814 both ways, CPU, 2026-11-26);
    ``compiled=True`` runs torchao as shipped (the slow case)."""
    def make(params):
        opt = pytest.importorskip("torchao.optim").AdamW4bit(params, **dict(dict(lr=LR, weight_decay=WD), **kw))
        if not compiled:
            step = opt.step

            def eager_step(*args, **kwargs):
                with unittest.mock.patch.object(torch, "compile", lambda fn, **_: fn):
                    return step(*args, **kwargs)
            opt.step = eager_step
        return opt
    return make


@pytest.mark.parametrize("ref,tol,ok", [
    (adamw_reference(), 0.22, True), (adamw_reference(betas=(0.8, 0.999)), 0.22, False),
    (adamw_reference(lr=1.5 * LR), 0.22, False),
    (torchao_adamw4bit(), 0.32, True), (torchao_adamw4bit(betas=(0.6, 0.999)), 0.32, False),
    # fast twin: test_adamw4bit_tracks_adamw_and_torchao[torchao-adamw4bit] (the same step, run eagerly)
    pytest.param(torchao_adamw4bit(compiled=True), 0.32, True, marks=pytest.mark.slow),
], ids=["torch-adamw", "wrong-beta1", "wrong-lr", "torchao-adamw4bit", "torchao-wrong-beta1", "torchao-compiled"])
def test_adamw4bit_tracks_adamw_and_torchao(ref, tol, ok):
    """4-bit moments (15/16 levels per 128 values) on pure-noise gradients, the hardest case: after 20
    steps the weights are within 22% of the distance moved of torch's AdamW (measured 18%; torchao's
    own AdamW4bit is 22% from AdamW) and within 32% of torchao's AdamW4bit (measured 28%: two
    different 4-bit schemes). A wrong beta1 or lr in either reference lands outside."""
    _, drift = _steps(*_pair("adamw4bit", ref), resync=False)
    assert (drift <= tol) == ok, (drift, tol)


@pytest.mark.parametrize("betas,ok", [((0.9, 0.99), True), ((0.95, 0.99), False), ((0.9, 0.9), False)])
def test_lion_equals_the_published_update(betas, ok):
    """colabkit's lion (bitsandbytes, 32-bit state) against Lion written out from the paper: every
    weight within (1e-5, 1e-3) at every one of 20 steps, without re-syncing; other betas are detected."""
    frac, drift = _steps(*_pair("lion", lambda p: lion_reference(p, betas=betas)), resync=False)
    assert (frac == 0.0 and drift < 1e-4) == ok, (frac, drift)


@requires_cuda
def test_paged_adamw8bit_tracks_adamw_and_is_counted_on_the_device():
    """On a GPU: paged state (CUDA managed memory, CPU-looking tensors) updates like AdamW and the
    tracker counts it as device optimizer state (2 bytes per weight)."""
    p, opt, ref, ref_opt = _pair("paged-adamw8bit", adamw_reference(), device="cuda")
    frac, _ = _steps(p, opt, ref, ref_opt, resync=True)
    assert frac <= 0.01
    assert any(getattr(t, "is_paged", False) for t in opt.state[p].values() if torch.is_tensor(t))
    mt = MemoryTracker(device="cuda")
    mt.watch(optimizer=opt)
    assert mt.current()["optimizer"] >= 2 * p.numel()


def test_tracker_counts_paged_state_on_the_device():
    """bitsandbytes' paged state: tensors whose .device is the CPU, flagged ``is_paged`` (its get_paged).
    A CUDA tracker counts them as optimizer state; an unflagged CPU tensor is not on its device."""
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = torch.optim.SGD([p], lr=0.1)
    paged, plain = torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    paged.is_paged, paged.page_deviceid = True, 0
    opt.state[p] = {"state1": paged, "absmax1": plain}
    mt = MemoryTracker(device="cuda")  # never entered: classification only, no CUDA call
    mt.watch(optimizer=opt)
    assert mt.current()["optimizer"] == paged.numel()
    # a CPU tracker: managed memory is the GPU's, not counted (bitsandbytes refuses paging without CUDA)
    assert MemoryTracker(device="cpu").watch(optimizer=opt).current()["optimizer"] == plain.numel()
    paged.page_deviceid = 1
    assert MemoryTracker(device="cuda:0").watch(optimizer=opt).current()["optimizer"] == 0  # another GPU's pages


@pytest.mark.parametrize("tok", ["lion8bit"])  # the bitsandbytes-backed 8-bit token off CUDA (adamw8bit: on CUDA)
def test_8bit_optimizers_ignore_overrides_left_by_others(tok, monkeypatch):
    """transformers' Trainer registers its embeddings for 32-bit state on bitsandbytes' process-global
    GlobalOptimManager, which keeps them by position (group, index): every later bitsandbytes optimizer
    in the process would give its first parameters 32-bit state. colabkit's optimizers ignore that: their
    state is the same uint8 state as in a fresh process (the CI failure of test_cli_sigkill_resume_and_fallback)."""
    from bitsandbytes.optim.optimizer import GlobalOptimManager

    monkeypatch.setattr(GlobalOptimManager, "_instance", None)  # a fresh global manager, restored after the test
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 128))

    def first_states():
        opt = make_optimizer(model, tok, lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return [opt.state[p]["state1"].dtype for p in model.parameters() if p.numel() >= 4096]

    assert first_states() == [torch.uint8, torch.uint8]  # the reference: 8-bit state in a fresh process
    other = torch.nn.Embedding(64, 128)  # what transformers' Trainer does for an nn.Embedding with an 8-bit optim
    GlobalOptimManager.get_instance().register_module_override(other, "weight", {"optim_bits": 32})
    theirs = bnb.optim.AdamW8bit([other.weight, torch.nn.Parameter(torch.zeros(4096))])
    other.weight.grad = torch.ones_like(other.weight)
    theirs.step()  # the override is filed under position (0, 0), for every optimizer in the process
    assert GlobalOptimManager.get_instance().index2config == {(0, 0): {"optim_bits": 32}}
    assert first_states() == [torch.uint8, torch.uint8]


def _step_peak(cls, fake, chunk=None):
    """Peak bytes (and 'other': the step's temporaries) of two steps of ``cls`` on real or fake tensors."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from colabkit.estimate.trace import _HostScalars

    ctx = contextlib.ExitStack()
    if fake:
        ctx.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        ctx.enter_context(_HostScalars())
    with ctx:
        ps = [torch.nn.Parameter(torch.randn(700_001)), torch.nn.Parameter(torch.randn(300, 70)),
              torch.nn.Parameter(torch.randn(100))]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = cls(ps)
        if chunk is not None:
            opt.CHUNK = chunk
        with MemoryTracker(device="cpu", alert_at=None) as mt:
            mt.watch(optimizer=opt)
            for _ in range(2):
                with mt.phase("optimizer"):
                    opt.step()
        r = mt.report()
    return r["peak_bytes"], r["breakdown"]["other"]


@pytest.mark.parametrize("cls", [AdamW4bit, AdamW8bit])
def test_fake_trace_of_one_chunk_has_the_real_steps_peak(cls):
    """issue 25: on fake tensors (the estimator's trace) the blockwise step runs one chunk per tensor, not all
    of them; the tracker's peak and temporaries equal those of the real step over every chunk. Control: the
    same trace with a smaller chunk (other temporaries) is told apart."""
    real = _step_peak(cls, fake=False)
    assert _step_peak(cls, fake=True) == real and real[1] > 0
    assert _step_peak(cls, fake=True, chunk=cls.CHUNK // 4) != real

"""CPU offload: refused on a CPU run; the device-agnostic pieces (host optimizer, layer streaming,
phase-aware offload, host-RAM guard, save_on_cpu) checked against the plain computation here; the
VRAM effect measured on CUDA."""
import copy

import pytest
import torch

from colabkit.data import TextData
from colabkit.memory import MemoryTracker
from colabkit.models import build_model
from colabkit.plan import REGISTRY, Context, Plan, PlanError
from colabkit import device as dev
from colabkit.techniques import offload_activations, offload_optimizer, offload_params
from colabkit.train import measure
from tests.conftest import requires_cuda

CPU = Context(device=torch.device("cpu"))


def _loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(i=0):
    return TextData().batch(4, 32, step=i)


@pytest.mark.parametrize("tok", ["offload:optimizer", "offload:activations", "offload:params"])
def test_cpu_run_is_refused_plainly(tok):
    with pytest.raises(PlanError, match="nothing to offload to"):
        Plan.parse(tok).check(CPU)


@pytest.mark.parametrize("plan,kw,match", [
    ("offload:optimizer", {"max_grad_norm": 1.0}, "clipping"),
    ("offload:optimizer+fused-step", {}, "keep one"),
    ("offload:activations+compress:int8", {}, "keep one"),
    ("offload:params+checkpoint", {}, "drop 'checkpoint'"),
    ("offload:params+lora:8", {}, "offload:params. with .lora:8. is not supported: offload:params is made for full"),
])
def test_conflicts_are_refused(plan, kw, match):
    ctx = Context(device=torch.device("cuda"), **kw)
    with pytest.raises(PlanError, match=match):
        REGISTRY["offload"].check(Plan.parse(plan), ctx)
    with pytest.raises(PlanError, match="offload needs what"):
        Plan.parse("offload:gpu")


def test_host_ram_guard(monkeypatch):
    assert dev.host_ram_guard(1 << 30, "x", available=4 << 30) == 3 << 30
    with pytest.raises(PlanError, match="needs 4.0 GiB of host RAM but only 3.0 GiB"):
        dev.host_ram_guard(4 << 30, "x", available=3 << 30)
    with pytest.raises(PlanError, match="1.0 GiB kept in reserve"):  # fits, but leaves no room
        dev.host_ram_guard(int(2.5 * 2**30), "x", available=3 << 30)
    # the guard runs before anything moves: streaming a model bigger than free RAM is refused
    monkeypatch.setattr(dev.host, "host_ram", lambda: {"available": 2 << 20})
    with pytest.raises(PlanError, match="block parameters"):
        offload_params.stream_blocks(build_model("gpt:2x64"), "cpu")


def test_host_optimizer_matches_plain_adamw_with_accumulation_and_scheduler():
    torch.manual_seed(0)
    a = build_model("gpt:2x32", seq=32)
    b = copy.deepcopy(a)
    plain = torch.optim.AdamW(a.parameters(), lr=1e-3)
    host = offload_optimizer.HostOptimizer([{"params": list(b.parameters())}], lambda g: torch.optim.AdamW(g, lr=1e-3))
    sa = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1 / (s + 1))
    sb = torch.optim.lr_scheduler.LambdaLR(host.optimizer, lambda s: 1 / (s + 1))
    for step in range(3):
        for micro in range(2):  # accumulation: two backwards per step
            x, y = _batch(2 * step + micro)
            _loss(a, x, y).backward()
            _loss(b, x, y).backward()
            assert all(p.grad is None for p in b.parameters())  # each gradient left as it arrived
        plain.step(); plain.zero_grad(); sa.step()
        host.step(); host.zero_grad(); sb.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    n = sum(p.numel() for p in b.parameters())
    assert host.host_bytes() >= 4 * n * 4  # master + grad buffer + two moments, all fp32


def test_host_optimizer_under_grad_scaler_matches_plain_and_skips_inf():
    # fp16 + offload:optimizer: the GradScaler unscales and inf-checks the host gradient copies
    # (HostOptimizer.param_groups), skips the step on inf, and the next step starts clean.
    torch.manual_seed(0)
    a = build_model("gpt:2x32", seq=32)
    b = copy.deepcopy(a)
    plain = torch.optim.AdamW(a.parameters(), lr=1e-3)
    host = offload_optimizer.HostOptimizer([{"params": list(b.parameters())}], lambda g: torch.optim.AdamW(g, lr=1e-3))
    sc_a, sc_b = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    def poison(g):  # an inf in one gradient element, as it arrives
        g = g.clone()
        g[0, 0] = float("inf")
        return g

    for step in range(3):
        x, y = _batch(step)
        handles = [m.wte.weight.register_hook(poison) for m in (a, b)] if step == 1 else []
        before = [p.detach().clone() for p in b.parameters()]
        for sc, model, opt in ((sc_a, a, plain), (sc_b, b, host)):
            sc.scale(_loss(model, x, y)).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
        for h in handles:
            h.remove()
        if step == 1:  # skipped: weights unchanged, scale backed off on both
            assert all(torch.equal(p, q) for p, q in zip(before, b.parameters()))
            assert sc_b.get_scale() == sc_a.get_scale() == 512.0
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_stream_blocks_equals_plain_forward_backward():
    torch.manual_seed(0)
    a = build_model("gpt:3x32", seq=32)
    b = offload_params.stream_blocks(copy.deepcopy(a), "cpu", prefetch=True)
    streamer = b.blocks[0].streamer
    x, y = _batch()
    la, lb = _loss(a, x, y), _loss(b, x, y)
    assert streamer.copies == 3  # forward: each block's weights once
    la.backward()
    lb.backward()
    assert streamer.copies == 6 and not streamer._pending  # backward: once more each, none left over
    assert lb.item() == pytest.approx(la.item(), abs=1e-6)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert all(getattr(p, "_colabkit_host", False) for p in b.blocks.parameters())


def test_activation_offload_is_exact():
    torch.manual_seed(0)
    m = build_model("gpt:2x32", seq=32)
    x, y = _batch()
    _loss(m, x, y).backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    with offload_activations.activation_offload():
        _loss(m, x, y).backward()
    for r, p in zip(ref, m.parameters()):
        assert torch.equal(r, p.grad)


class _SavesHostScalar(torch.autograd.Function):
    """y = x * s with s a host scalar saved for backward: what SDPA's fused kernels do on CUDA (their random
    seed and offset are CPU tensors)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s, None


def test_activation_offload_leaves_host_tensors_in_place():
    """CUDA refuses record_stream on a CPU tensor; the twin refuses it on a host-tagged one (H200, 2026-11-27:
    offload:activations crashed on the first attention layer)."""
    pair = dev.DevicePair("cpu")
    s = dev.mark_host(torch.tensor(3.0))
    x = torch.randn(4, requires_grad=True)
    with offload_activations.activation_offload(pair):
        y = _SavesHostScalar.apply(x, s)
    assert pair.stats()["copies"] == 1  # x went out to a pinned block; s stayed where it was
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))


def test_twin_refuses_record_stream_on_a_host_tensor():
    """The rule the test above relies on (negative control): lending host memory to a stream is an error."""
    pair = dev.DevicePair("cpu")
    with pytest.raises(dev.TwinError, match="record_stream on a host tensor"):
        pair.lend(dev.mark_host(torch.tensor(3.0)))


def _trained(steps=2):
    torch.manual_seed(0)
    m = build_model("gpt:2x64", seq=32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for i in range(steps):
        _loss(m, *_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


@pytest.mark.parametrize("strategy", ["cpu", "pinned"])
def test_phase_offload_round_trip_is_exact(strategy):
    m, opt = _trained()
    ref_m, ref_opt = _trained()
    state0 = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    with offload_optimizer.offloaded(opt, m, strategy) as info:
        assert info["moved_bytes"] == sum(8 * p.numel() for p in m.parameters())
        assert all(s["exp_avg"] is None for s in opt.state.values())  # gone from the device
        m.eval()
        with torch.no_grad():
            _loss(m, *_batch(9))
    for s0, s in zip(state0, opt.state.values()):
        for k in s0:
            assert torch.equal(s0[k], s[k]), k
    for mm, oo in ((m, opt), (ref_m, ref_opt)):  # the next step is the same as without the offload
        mm.train()
        _loss(mm, *_batch(5)).backward()
        oo.step()
    for p, q in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(p, q)


def test_phase_offload_int8_and_drop_free_memory_measured():
    m, opt = _trained()
    moment_bytes = sum(8 * p.numel() for p in m.parameters() if p.numel() >= 4096)
    for strategy, min_freed in (("int8", 0.70), ("drop", 1.0)):  # int8 keeps 1/4 + absmax
        state0 = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        with MemoryTracker(m, opt, device="cpu") as mt:
            live0 = sum(mt.current().values())
            with offload_optimizer.offloaded(opt, m, strategy) as info:
                freed = live0 - sum(mt.current().values())
            assert info["moved_bytes"] >= moment_bytes
            assert freed >= min_freed * moment_bytes, (strategy, freed, moment_bytes)
        if strategy == "int8":  # back within half a quantization step of each 256-block's absmax
            for s0, s in zip(state0, opt.state.values()):
                for k in ("exp_avg", "exp_avg_sq"):
                    assert (s[k] - s0[k]).abs().max() <= s0[k].abs().max() / 254 + 1e-12
    assert len(opt.state) == 0  # drop: the moments restart at the next step


def test_int8_round_trip_error_bound():
    t = torch.randn(5000)
    q = offload_optimizer._q8(t)
    err = (offload_optimizer._dq8(q) - t).abs()
    absmax = q[1].repeat_interleave(256)[:5000]
    assert (err <= absmax / 254 + 1e-7).all()


# ----- on a GPU: the VRAM each kind saves, and the same weights as the plain run ----------------
@requires_cuda
@pytest.mark.parametrize("tok,cat", [("offload:optimizer", "optimizer"), ("offload:params", "params"),
                                     ("offload:activations", "activations")])
def test_gpu_offload_saves_vram_and_keeps_the_loss(tok, cat):
    base = measure("gpt:4x128", "baseline", batch=4, seq=64, steps=2, device="cuda")
    r = measure("gpt:4x128", tok, batch=4, seq=64, steps=2, device="cuda")
    assert r["ok"], r["error"]
    assert r["breakdown"][cat] < 0.5 * base["breakdown"][cat]
    assert r["loss"] == pytest.approx(base["loss"], rel=1e-3)


def test_stream_blocks_recompute_keeps_autocast():
    # backward recomputes each block: under autocast it must recompute in the same precision
    torch.manual_seed(0)
    a = build_model("gpt:2x32", seq=32)
    b = offload_params.stream_blocks(copy.deepcopy(a), "cpu")
    x, y = _batch()
    for m in (a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(m, x, y)
        loss.backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-4)

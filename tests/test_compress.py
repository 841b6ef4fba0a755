"""compress:int8: saved activations stored as blockwise int8. The forward is unchanged, gradients
stay within a few percent of plain, the saved bytes shrink ~4x (fp32) and the tracker sees it."""
import copy

import pytest
import torch

from colabkit import Plan, PlanError, build_model, measure, train
from colabkit.models import logits_of
from colabkit.techniques.compress import BLOCK, Packed, dequantize, pack_int8, quantize, unpack_int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 256), (3, 5, 67), (1000,)])
def test_roundtrip_error_within_half_a_step(dtype, shape):
    t = (torch.randn(shape) * torch.logspace(-3, 2, shape[-1])).to(dtype)  # blocks of very different range
    p = quantize(t)
    back = dequantize(p)
    assert back.shape == t.shape and back.dtype == dtype
    n_main = t.numel() // BLOCK * BLOCK
    flat, bflat = t.float().reshape(-1), back.float().reshape(-1)
    assert torch.equal(bflat[n_main:], flat[n_main:])  # the tail is kept exactly
    step = flat[:n_main].view(-1, BLOCK).abs().amax(1, keepdim=True) / 127
    err = (bflat[:n_main].view(-1, BLOCK) - flat[:n_main].view(-1, BLOCK)).abs()
    # half a quantisation step, plus the rounding of the result to dtype
    assert bool((err <= step / 2 * 1.001 + flat[:n_main].view(-1, BLOCK).abs() * torch.finfo(dtype).eps).all())
    assert p.q.dtype == torch.int8 and p.nbytes < t.numel() * t.element_size()


def test_params_ints_and_small_tensors_are_left_alone():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    kept, packed = [], []

    def spy(t):
        out = pack_int8(t)
        (packed if isinstance(out, Packed) else kept).append(t)
        return out

    with torch.autograd.graph.saved_tensors_hooks(spy, unpack_int8):
        h = lin(x).relu()  # addmm saves x (2048 values: packed) and weight.t() (a parameter view: kept)
        e = torch.nn.functional.embedding(torch.arange(8), lin.weight)  # int indices: kept
        small = (torch.randn(4, 4, requires_grad=True) * 3).sigmoid()  # 16 values: kept
    assert any(t.shape == (32, 64) and t.requires_grad for t in packed)
    assert any(isinstance(t._base, torch.nn.Parameter) for t in kept)
    assert any(not t.is_floating_point() for t in kept)
    assert any(t.numel() == 16 for t in kept)
    assert not any(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) for t in packed)
    (h.sum() + e.sum() + small.sum()).backward()


def test_same_forward_close_gradients_and_4x_smaller_saved_tensors():
    plain = build_model("gpt:2x128")
    comp = copy.deepcopy(plain)
    x = torch.randint(0, 256, (4, 64))
    out_p = logits_of(plain(x))
    out_p.float().logsumexp(-1).mean().backward()
    sizes = {"orig": 0, "packed": 0}

    def counting_pack(t):
        out = pack_int8(t)
        if isinstance(out, Packed):
            sizes["orig"] += t.numel() * t.element_size()
            sizes["packed"] += out.nbytes
        return out
    with torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack_int8):
        out_c = logits_of(comp(x))
        loss_c = out_c.float().logsumexp(-1).mean()
    loss_c.backward()
    assert torch.equal(out_c, out_p)  # only what backward reads is compressed
    # theory for fp32: 1 byte per value + a 4-byte scale per 64 values = (1 + 4/64) / 4 = 0.266
    assert sizes["packed"] / sizes["orig"] == pytest.approx((1 + 4 / BLOCK) / 4, abs=0.01)
    errs = []
    for (n, pp), pc in zip(plain.named_parameters(), comp.parameters()):
        rel = float((pc.grad - pp.grad).norm() / pp.grad.norm())
        errs.append(rel)
        assert rel < 0.05, n
    assert max(errs) > 0  # the gradients did go through int8


def test_tracker_sees_the_saving_and_training_follows_baseline():
    kw = dict(batch=4, seq=64, steps=1, device="cpu")
    base, comp = measure("gpt:4x128", "baseline", **kw), measure("gpt:4x128", "compress:int8", **kw)
    a0, a1 = base["breakdown"]["activations"], comp["breakdown"]["activations"]
    # saved tensors shrink to 0.27x; one block's fp32 temporaries are still live in the forward
    assert 0.25 * a0 < a1 < 0.6 * a0
    assert comp["loss"] == pytest.approx(base["loss"], rel=1e-6)  # step 1: the forward is identical
    runs = [train("gpt:2x64", plan=p, steps=8, batch=4, seq=32, lr=3e-3, progress=False, track=False)
            for p in ("baseline", "compress:int8")]
    lb, lc = runs[0]["losses"], runs[1]["losses"]
    assert lc[-1] < lc[0] - 0.3  # it trains
    assert lc[-1] == pytest.approx(lb[-1], rel=0.03)


def test_combines_with_checkpoint_and_refuses_bad_tokens():
    kw = dict(batch=2, seq=32, steps=2, device="cpu")
    base, both = measure("gpt:2x64", "baseline", **kw), measure("gpt:2x64", "checkpoint+compress:int8", **kw)
    assert both["ok"], both["error"]
    assert both["loss"] == pytest.approx(base["loss"], rel=5e-3)
    for bad, msg in (("compress", "no format"), ("compress:int4", "use compress:int8")):
        with pytest.raises(PlanError, match=msg):
            Plan.parse(bad)

"""Gradient accumulation: one optimizer step over K micro-batches equals one step on the whole
batch (fp32 tolerance), also with padded, variable-length micro-batches and a partial last
micro-batch, while per-micro-batch mean normalisation (the 2024 transformers bug) does not."""

import pytest
import torch

from colabkit import IGNORE_INDEX, Plan, PlanError, Trainer, build_model, measure
from colabkit.data import TextData
from colabkit.models import logits_of
from colabkit.techniques.accumulation import micro_batch_sizes, window_loss


def _padded_batch(batch=8, seq=24, seed=0):
    """Byte sequences of very different lengths, right-padded: labels IGNORE_INDEX past each end."""
    x, y = TextData().batch(batch, seq, step=0, seed=seed)
    lengths = torch.tensor([24, 3, 20, 5, 24, 2, 12, 7, 16, 9][:batch])
    pad = torch.arange(seq)[None, :] >= lengths[:, None]  # (B, S)
    return x.masked_fill(pad, 0), y.masked_fill(pad, IGNORE_INDEX)


def _one_step(plan, x, y, sgd=False):
    torch.manual_seed(0)
    model = build_model("gpt:2x64")
    trainer = Trainer(model, plan, device="cpu")
    if sgd:  # w1 = w0 - grad: the weights expose the gradient itself (Adam's first step hides its scale)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    loss = trainer.step(x, y)
    return loss, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("batch, k, padded", [(8, 4, False), (10, 4, False), (10, 4, True), (7, 7, True)])
def test_one_step_equals_one_big_batch(batch, k, padded):
    """10 sequences in 4 micro-batches: 3, 3, 2, 2 (a partial last window), equal thanks to the window
    normalisation. AdamW's first step is ~lr*g/(|g|+eps), which amplifies fp32 rounding for
    gradients near eps: its tolerance is 1% of lr; the SGD step (w - g) is held to 1e-6."""
    x, y = _padded_batch(batch) if padded else TextData().batch(batch, 24, step=0)
    for sgd, atol in ((False, 3e-6), (True, 1e-6)):
        loss_big, w_big = _one_step("baseline", x, y, sgd)
        loss_acc, w_acc = _one_step(f"accum:{k}", x, y, sgd)
        assert loss_acc == pytest.approx(loss_big, rel=1e-5)
        for n in w_big:
            torch.testing.assert_close(w_acc[n], w_big[n], rtol=1e-5, atol=atol, msg=n)


def test_partial_last_micro_batch_sizes():
    assert micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_batch_sizes(8, 4) == [2, 2, 2, 2]
    with pytest.raises(PlanError, match="use accum:2 or less"):
        micro_batch_sizes(2, 4)


def test_window_normalisation_vs_per_micro_mean_bug():
    """The negative control must fail: per-micro-batch means weight the 2-token micro-batch like the
    68-token one, so loss and gradient differ from the big batch."""
    torch.manual_seed(0)
    model = build_model("gpt:2x64")
    x, y = _padded_batch(8)

    def grads(chunks_fn):
        model.zero_grad()
        loss = chunks_fn()
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])

    def big():
        return window_loss([logits_of(model(x))], [y])

    def micro(per_micro_mean):
        xs, ys = x.tensor_split(4), y.tensor_split(4)
        return window_loss([logits_of(model(xi)) for xi in xs], ys, per_micro_mean=per_micro_mean)

    loss_big, g_big = grads(big)
    loss_ok, g_ok = grads(lambda: micro(False))
    loss_bug, g_bug = grads(lambda: micro(True))
    assert loss_ok == pytest.approx(loss_big, rel=1e-6)
    torch.testing.assert_close(g_ok, g_big, rtol=1e-5, atol=1e-7)
    # at init every token's loss is ~ln 256, so the weighting barely moves the loss; it moves the gradient
    assert loss_bug != pytest.approx(loss_big, rel=1e-5)
    assert (g_bug - g_big).norm() / g_big.norm() > 0.05


def test_batch_smaller_than_k_is_refused():
    trainer = Trainer(build_model("gpt:1x32"), "accum:4", device="cpu")
    x, y = TextData().batch(2, 8, step=0)
    with pytest.raises(PlanError, match="accum:4 needs at least 4 sequences.*use accum:2 or less"):
        trainer.step(x, y)
    rec = measure("gpt:1x32", "accum:4", batch=2, seq=8, steps=1, device="cpu")
    assert not rec["ok"] and "accum:2 or less" in rec["error"]


def test_plan_parsing():
    assert Plan.parse("accum:4").get("accum") == 4
    for bad in ("accum", "accum:0", "accum:-2", "accum:two"):
        with pytest.raises(PlanError):
            Plan.parse(bad)


def test_activations_shrink_k_fold():
    kw = dict(batch=8, seq=64, steps=1, device="cpu")
    base, acc2, acc4 = (measure("gpt:4x128", p, **kw) for p in ("baseline", "accum:2", "accum:4"))
    a0, a2, a4 = (r["breakdown"]["activations"] for r in (base, acc2, acc4))
    # theory: the forward of one micro-batch of B/K sequences is live at a time -> a0 / K
    assert a2 == pytest.approx(a0 / 2, rel=0.15)
    assert a4 == pytest.approx(a0 / 4, rel=0.15)
    assert acc4["loss"] == pytest.approx(base["loss"], rel=1e-5)


def test_combines_with_checkpoint_same_update():
    x, y = _padded_batch(8)
    _, w_big = _one_step("baseline", x, y, sgd=True)
    _, w_both = _one_step("accum:2+checkpoint", x, y, sgd=True)
    for n in w_big:
        torch.testing.assert_close(w_both[n], w_big[n], rtol=1e-5, atol=1e-6, msg=n)


def test_fused_step_is_refused():
    from colabkit.plan import Context

    with pytest.raises(PlanError, match="accum"):
        Plan.parse("accum:2+fused-step").check(Context(device=torch.device("cpu")))


"""Activation checkpointing: the same outputs and gradients as the plain run with dropout on, a
recompute proven by forward call counts, and the activation saving measured by the tracker."""
import copy

import pytest
import torch

from colabkit import PlanError, Plan, Trainer, build_model, measure
from colabkit.data import TextData
from colabkit.models import blocks_of, logits_of
from colabkit.techniques.checkpoint import checkpoint_blocks


def _run(model, x, seed=123):
    """Forward + backward with a fixed RNG; returns (logits, {name: grad})."""
    model.train()
    torch.manual_seed(seed)
    out = logits_of(model(x))
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _count_calls(modules):
    counts = [0]

    def hook(*_):
        counts[0] += 1

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    return counts, handles


@pytest.mark.parametrize("every", [1, 2])
def test_gpt_outputs_and_every_grad_match_plain_with_dropout(every):
    plain = build_model("gpt:4x64", dropout=0.2)
    ckpt = copy.deepcopy(plain)
    assert checkpoint_blocks(ckpt, every=every) == list(range(0, 4, every))
    x = torch.randint(0, 256, (2, 32))
    out_p, g_p = _run(plain, x)
    out_c, g_c = _run(ckpt, x)
    torch.testing.assert_close(out_c, out_p, rtol=1e-5, atol=1e-6)
    assert g_c.keys() == g_p.keys() and len(g_p) == len(list(plain.parameters()))
    for name in g_p:
        torch.testing.assert_close(g_c[name], g_p[name], rtol=1e-5, atol=1e-6, msg=name)
    # negative control: dropout is really on, so a different RNG stream gives other gradients
    plain.zero_grad()
    _, g_other = _run(plain, x, seed=7)
    assert not torch.allclose(g_other["blocks.0.fc.weight"], g_p["blocks.0.fc.weight"], atol=1e-6)


@pytest.mark.parametrize("plan, extra", [("baseline", 0), ("checkpoint", 4), ("checkpoint:2", 2), ("checkpoint:3", 2)])
def test_forward_call_counts_prove_recompute(plan, extra):
    model = build_model("gpt:4x64", dropout=0.1)
    trainer = Trainer(model, plan, device="cpu")
    counts, _ = _count_calls([b.attn for b in blocks_of(trainer.model)])
    x, y = TextData().batch(2, 16, step=0)
    trainer.step(x, y)
    assert counts[0] == 4 + extra  # one forward per block, plus one recompute per checkpointed block


def test_eval_does_not_recompute():
    model = build_model("gpt:2x64")
    checkpoint_blocks(model)
    counts, _ = _count_calls([b.attn for b in model.blocks])
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)))
    assert counts[0] == 2


def test_memory_saving_measured():
    kw = dict(batch=4, seq=64, steps=1, device="cpu")
    base, full, half = (measure("gpt:6x128", p, **kw) for p in ("baseline", "checkpoint", "checkpoint:2"))
    assert all(r["ok"] for r in (base, full, half)), [r["error"] for r in (base, full, half)]
    a0, a1, a2 = (r["breakdown"]["activations"] for r in (base, full, half))
    # all 6 blocks checkpointed: only block inputs (+ embeddings/head) stay; a block keeps ~10x its input
    assert a1 <= 0.35 * a0
    # half the blocks: the saving is linear in the number of checkpointed blocks (theory), within 15%
    assert abs(a2 - (a0 + a1) / 2) <= 0.15 * a0
    assert full["loss"] == pytest.approx(base["loss"], rel=1e-5)
    # at this size the total peaks in the optimizer step (grads + new Adam state), which checkpointing
    # does not touch; the bench test shows the peak falling on a model whose activations dominate
    assert full["peak_bytes"] <= base["peak_bytes"]


def test_plan_errors():
    with pytest.raises(PlanError, match="positive whole number"):
        Plan.parse("checkpoint:0")
    with pytest.raises(PlanError, match="positive whole number"):
        Plan.parse("checkpoint:x")
    assert Plan.parse("checkpoint").get("checkpoint") == 1


def _tiny_hf():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("plan, flags", [("checkpoint", [True] * 4), ("checkpoint:2", [True, False, True, False])])
def test_hf_model_uses_its_own_checkpointing_and_matches_plain(plan, flags):
    plain = _tiny_hf()
    hf = copy.deepcopy(plain)
    trainer = Trainer(hf, plan, device="cpu")
    layers = blocks_of(trainer.model)
    assert [bool(getattr(l, "gradient_checkpointing", False)) for l in layers] == flags
    counts, _ = _count_calls([l.mlp for l in layers])
    x = torch.randint(0, 256, (2, 16))
    out_p, g_p = _run(plain, x)
    out_c, g_c = _run(trainer.model, x)
    assert counts[0] == 4 + sum(flags)
    torch.testing.assert_close(out_c, out_p, rtol=1e-5, atol=1e-5)
    for name in g_p:
        torch.testing.assert_close(g_c[name], g_p[name], rtol=1e-4, atol=1e-6, msg=name)


def test_hf_checkpointing_recomputes_under_the_attention_backend(monkeypatch):
    # HF's own checkpointing gets colabkit's recompute context: attention:math holds in the recompute too
    import torch.nn.functional as F
    seen, real = [], F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled())
        return real(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    losses = {}
    for plan in ("attention:math", "attention:math+checkpoint"):
        seen.clear()
        trainer = Trainer(_tiny_hf(), plan, device="cpu")
        x = torch.randint(0, 256, (2, 16))
        losses[plan] = trainer.step({"input_ids": x, "labels": x})
    assert len(seen) == 8 and all(seen), seen  # 4 layers, forward + recompute, each under math
    assert abs(losses["attention:math"] - losses["attention:math+checkpoint"]) < 1e-5 * losses["attention:math"]
    seen.clear()  # negative control: checkpoint alone recomputes under torch's default flags
    Trainer(_tiny_hf(), "checkpoint", device="cpu").step({"input_ids": x, "labels": x})
    assert len(seen) == 8 and not any(seen)

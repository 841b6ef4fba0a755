"""Your own model and your own batches through colabkit.Trainer (issue 22, part A).

GPT-2, Llama and BERT from small transformers configs and a small conv net: every model x plan cell
trains 5 steps or is refused with a PlanError; with transformers-style batch dicts ``accum:4`` equals the
un-accumulated step (also when the model computes its own loss) and the loss equals ``model(**batch).loss``.
(transformers' Trainer: tests/test_hf_trainer.py.)
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from colabkit import IGNORE_INDEX, PlanError, Trainer  # noqa: E402
from colabkit.batches import make_batch  # noqa: E402
from colabkit.techniques import compress  # noqa: E402
from colabkit.techniques.fused_step import FusedStepOptimizer  # noqa: E402
from own_models import (B, MODELS, S, V, ConvNet, _cells, _check_model_side, bert, cls_batch, gpt2,  # noqa: E402
                        img_batch, llama, lm_batch)

_REFUSED = {("convnet", "checkpoint"): "checkpoint", ("convnet", "checkpoint+adamw4bit+fused-step"): "checkpoint"}


# What each plan must visibly have done (no silent no-op), checked after 5 steps.
def _check_effect(plan: str, name: str, t: Trainer, spy: dict) -> None:
    m = t.model
    if "checkpoint" in plan:
        assert getattr(m, "is_gradient_checkpointing", False)
    if plan == "accum:4":
        assert spy["micro"] == 5 * 4
    if plan == "adamw8bit":
        assert any(v.dtype == torch.uint8 for s in t.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    _check_model_side(plan, name, m)
    if plan == "compress:int8":
        assert spy["packed"] > 0
    if "fused-step" in plan:
        assert isinstance(t.optimizer, FusedStepOptimizer) and t.optimizer.steps_in_backward > 0


@pytest.mark.parametrize("name, plan", list(_cells()))
def test_every_cell_trains_or_is_refused(name, plan, monkeypatch):
    """5 steps with a finite, changing loss and the plan's effect visible -- or a PlanError saying why."""
    warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
    make, batch_of = MODELS[name]
    spy = {"micro": 0, "packed": 0}
    quantize = compress.quantize
    monkeypatch.setattr(compress, "quantize", lambda *a, **k: (spy.__setitem__("packed", spy["packed"] + 1), quantize(*a, **k))[1])
    micro = Trainer._micro
    monkeypatch.setattr(Trainer, "_micro", lambda self, *a: (spy.__setitem__("micro", spy["micro"] + 1), micro(self, *a))[1])
    torch.manual_seed(0)
    try:
        t = Trainer(make(), plan, device="cpu")
        losses = [t.step(batch_of(0)) for _ in range(5)]
    except PlanError as e:
        if (name, plan) in _REFUSED:
            assert _REFUSED[name, plan] in str(e)
            return
        if name == "convnet" and "lora" in plan:  # an image model without embeddings: refusing is a valid answer
            assert "lora" in str(e) or "embedding" in str(e)
            return
        raise
    assert (name, plan) not in _REFUSED, f"{plan} on {name} should have been refused"
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    _check_effect(plan, name, t, spy)


# ----- the loss: window normalisation, the model's own loss, from logits -----------------------------
class NoLabels(nn.Module):
    """Your own model around a transformers one: takes no labels, returns a tuple starting with the logits,
    so colabkit computes the loss from the logits (the other path)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return (self.inner(input_ids=input_ids, attention_mask=attention_mask).logits,)


def _run(make, plan: str, batches: list[dict], wrap: bool = False):
    torch.manual_seed(0)
    model = make()
    t = Trainer(NoLabels(model) if wrap else model, plan, device="cpu", lr=1e-3)
    losses = [t.step(b) for b in batches]
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("make, batch_of, wrap", [(gpt2, lm_batch, False), (gpt2, lm_batch, True),
                                                   (bert, cls_batch, False)],
                         ids=["gpt2-own-loss", "gpt2-from-logits", "bert-own-loss"])
def test_accum_equals_baseline_with_batch_dicts(make, batch_of, wrap):
    """Padded micro-batches of very different token counts: 3 steps of accum:4 equal 3 un-accumulated
    steps (loss and weights, 1e-5 relative), whether the model computes its own loss or colabkit does."""
    batches = [batch_of(seed) for seed in range(3)]
    base_l, base_w = _run(make, "baseline", batches, wrap)
    acc_l, acc_w = _run(make, "accum:4", batches, wrap)
    assert acc_l == pytest.approx(base_l, rel=1e-5)
    assert float((acc_w - base_w).norm() / base_w.norm()) < 1e-5
    assert float((base_w - _run(make, "baseline", batches[:1], wrap)[1]).norm()) > 0  # the steps moved the weights


def test_per_micro_batch_mean_is_detected(monkeypatch):
    """Negative control: averaging each micro-batch's own mean loss (transformers' pre-4.46 bug) gives other
    weights on the same padded batches, far outside the equivalence test's 1e-5. (At init every token's loss
    is about ln V, so the weighting barely moves the loss itself; it moves the gradient.)"""
    import colabkit.trainer as trainer
    from colabkit.batches import loss_of

    data = [lm_batch(seed) for seed in range(3)]
    base_l, base_w = _run(gpt2, "baseline", data)
    monkeypatch.setattr(trainer, "micro_loss", lambda out, b, head, n_window, n_micro, accum, *a: loss_of(out) / accum)
    bug_l, bug_w = _run(gpt2, "accum:4", data)
    assert float((bug_w - base_w).norm() / base_w.norm()) > 1e-3


@pytest.mark.parametrize("make, batch_of", [(gpt2, lm_batch), (llama, lm_batch), (bert, cls_batch)],
                         ids=["gpt2", "llama", "bert"])
def test_loss_equals_the_models_own(make, batch_of):
    """Trainer's loss (the step's and evaluate's) equals model(**batch).loss on the same batch, 1e-6; so does
    the loss colabkit computes from the logits of a model that takes no labels (causal shift included)."""
    torch.manual_seed(0)
    model = make()
    batch = batch_of(0)
    with torch.no_grad():
        ref = float(model(**batch).loss)
    t = Trainer(model, "accum:4", device="cpu")
    assert t.evaluate(batch) == pytest.approx(ref, rel=1e-6)
    if make is not bert:
        assert Trainer(NoLabels(model), "baseline", device="cpu").evaluate(
            {k: v for k, v in batch.items()}) == pytest.approx(ref, rel=1e-6)
    assert t.step(batch) == pytest.approx(ref, rel=1e-6)  # dropout is 0: the training forward is the same


def test_causal_shift_is_applied_to_batch_dicts():
    """Negative control for the shift: an unshifted cross-entropy (position i against label i) is far off."""
    torch.manual_seed(0)
    model = gpt2()
    batch = lm_batch(0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        unshifted = float(nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    loss = Trainer(NoLabels(model), "baseline", device="cpu").evaluate(batch)
    assert abs(loss - unshifted) > 1e-3


def test_images_and_tuples_and_xy_still_work():
    """(x, y) keeps working (colabkit's aligned targets); an image classifier trains from (x, y) and from a
    dict; a nanoGPT-style forward returning (logits, loss) trains on its own loss."""
    from colabkit import TextData, build_model

    x, y = TextData().batch(4, 16, step=0)
    assert math.isfinite(Trainer(build_model("gpt-tiny"), "accum:2", device="cpu").step(x, y))
    img = img_batch()
    for batch in ((img["pixel_values"], img["labels"]), img):
        assert math.isfinite(Trainer(ConvNet(), "accum:2", device="cpu").step(*batch) if isinstance(batch, tuple)
                             else Trainer(ConvNet(), "accum:2", device="cpu").step(batch))

    class NanoGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build_model("gpt-tiny")

        def forward(self, idx, labels=None):
            logits = self.net(idx)
            loss = None if labels is None else nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
            return logits, loss

    batch = {"input_ids": x, "labels": x}
    torch.manual_seed(0)
    a = Trainer(NanoGPT(), "baseline", device="cpu").step(batch)
    torch.manual_seed(0)
    b = Trainer(NanoGPT(), "accum:2", device="cpu").step(batch)
    assert a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("model, batch, y, match", [
    (bert, "tokens", "tokens", "classification head needs labels of shape"),  # LM targets: raw ValueError before
    (ConvNet, "img-no-labels", None, "no 'labels'"),
    (ConvNet, "img-extra-key", None, "also has \\['token_type_ids'\\]"),
    (gpt2, "x-only", None, "needs the targets"),
    (gpt2, "no-batch-dim", None, "splits every tensor"),
])
def test_what_cannot_become_a_loss_is_a_plan_error(model, batch, y, match):
    ids = torch.randint(0, V, (B, S))
    batches = {"tokens": ids, "x-only": ids, "img-no-labels": {"pixel_values": img_batch()["pixel_values"]},
               "img-extra-key": {**img_batch(), "token_type_ids": ids},
               "no-batch-dim": {**lm_batch(), "position_ids": torch.arange(S)[None]}}
    ys = {"tokens": ids}
    t = Trainer(model(), "accum:4" if batch == "no-batch-dim" else "baseline", device="cpu")
    with pytest.raises(PlanError, match=match):
        t.step(batches[batch], ys.get(y))


def test_own_loss_without_labels_key_refuses_accum():
    class QA(nn.Module):  # computes its own loss from keys colabkit cannot count
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, target):
            return nn.functional.mse_loss(self.lin(x).squeeze(-1), target)

    batch = {"x": torch.randn(8, 4), "target": torch.randn(8)}
    assert math.isfinite(Trainer(QA(), "baseline", device="cpu").step(batch))
    with pytest.raises(PlanError, match="name the targets 'labels'"):
        Trainer(QA(), "accum:2", device="cpu").step(batch)


def test_make_batch_passes_labels_to_a_model_that_takes_them():
    b = make_batch(gpt2(), lm_batch())
    assert "labels" in b.kwargs and b.args == ()
    assert "labels" not in make_batch(gpt2(), lm_batch(), labels_to_model=False).kwargs


# ----- estimate on your own model and batches ---------------------------------------------------------------
class NanoGPTish(nn.Module):
    """nanoGPT's convention: forward(idx, targets) -> (logits, loss), a vocabulary of 50 (below the 256 byte ids
    the estimator used to feed)."""

    def __init__(self, vocab: int = 50, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.mlp(self.emb(idx)))
        return logits, None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _measured_peak(make, batch: dict, plan: str = "baseline") -> int:
    """MemoryTracker around 2 real colabkit.Trainer steps on the batch (the window estimate predicts). The batch is
    made inside the tracked window, as a run holds it on its device (on a GPU it is copied there): built before
    the tracker it went uncounted, 49 KB of a ViT's 584 KB peak."""
    from colabkit import MemoryTracker

    torch.manual_seed(0)
    with MemoryTracker(device="cpu") as mt:
        t = Trainer(make(), plan, device="cpu", tracker=mt)
        mt.reset_peaks()
        for step in range(2):
            mt.set_step(step)
            t.step({k: v.clone() for k, v in batch.items()})
    return mt.report()["peak_bytes"]


def test_estimate_takes_your_model_and_a_batch_description():
    """A (logits, loss) model with a 50-token vocabulary, described by a sample batch or by shapes and dtypes,
    and a conv net on pixel_values: the estimate is within 1% of the measured peak of the same steps."""
    from colabkit import estimate

    sample = {"idx": torch.randint(0, 50, (B, S)), "targets": torch.randint(0, 50, (B, S))}
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in sample.items()}
    got = _measured_peak(NanoGPTish, sample)
    for desc in (sample, shapes):
        r = estimate(NanoGPTish, inputs=desc, device="cpu")
        assert (r["batch"], r["seq"]) == (B, S)
        assert r["peak_bytes"] == pytest.approx(got, rel=0.01)
    r = estimate(ConvNet, inputs=img_batch(), device="cpu")
    assert r["peak_bytes"] == pytest.approx(_measured_peak(ConvNet, img_batch()), rel=0.01)
    with pytest.raises(PlanError, match=r"inputs\['idx'\] = 8: describe each batch entry by a sample tensor"):
        estimate(NanoGPTish, inputs={"idx": 8}, device="cpu")


def test_estimate_takes_a_config_and_training_arguments(tmp_path):
    """A transformers config + TrainingArguments (batch 2 x accumulation 4, gradient checkpointing): the plan
    and batch are read from the arguments, the model built from the config's architecture, and the estimate is
    within 1% of the measured peak of colabkit.Trainer with that plan on the batch."""
    import transformers

    from colabkit import estimate

    cfg = bert().config
    cfg.architectures = ["BertForSequenceClassification"]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=4, gradient_checkpointing=True,
                                          optim="adamw_torch", report_to=[], use_cpu=True)
    one = {k: v[:2] for k, v in cls_batch().items()}  # what the dataloader yields: one micro-batch
    r = estimate(cfg, args=args, inputs=one, device="cpu")
    assert (r["plan"], r["batch"], r["seq"], r["model"]) == ("checkpoint+accum:4", B, S, "BertForSequenceClassification")
    assert r["peak_bytes"] == pytest.approx(_measured_peak(bert, cls_batch(), "checkpoint+accum:4"), rel=0.01)
    args8 = transformers.TrainingArguments(output_dir=str(tmp_path), optim="adamw_bnb_8bit", report_to=[], use_cpu=True)
    with pytest.raises(PlanError, match="overlap"):
        estimate(cfg, "lion", args=args8, inputs=one, device="cpu")


def test_measure_of_a_built_model_says_to_pass_a_factory():
    """measure() builds the model under the tracker: a built module (which it would call as a factory, forward()
    with no batch: a raw TypeError, or transformers' "exactly one of input_ids") is refused in the record."""
    from colabkit import build_model, measure

    r = measure(build_model("gpt:2x64"), "baseline", batch=2, seq=16, steps=1, device="cpu")
    assert not r["ok"] and "a function that builds the model, not a built GPT" in r["error"]
    ok = measure(lambda: build_model("gpt:2x64"), "baseline", batch=2, seq=16, steps=1, device="cpu")
    assert ok["ok"] and ok["peak_bytes"] > 0  # negative control: the factory form is measured


def test_labels_a_plain_classifier_cannot_take_get_colabkits_error(monkeypatch):
    """A plain module's classifier names no class count: colabkit learns it from the first logits (10) and
    refuses an id of 10 naming the shape, the dtype and the range -- before, F.cross_entropy's raw "Target 10 is
    out of bounds" (a device-side assert on a GPU). Float labels of one per example on a 3-class transformers
    classifier are neither regression (one output) nor multi-label ((B, 3)): refused before transformers' BCE
    error. Control: without learning the count, torch's IndexError is what the user sees."""
    import colabkit.trainer as trainer_mod

    img = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([3, 10])}
    with pytest.raises(PlanError, match=r"outside \[0, 10\).*shape \(2,\) and dtype torch.long"):
        Trainer(ConvNet(), "baseline", device="cpu").step(img)
    t = Trainer(ConvNet(), "baseline", device="cpu")
    t.step({**img, "labels": torch.tensor([3, 9])})
    with pytest.raises(PlanError, match=r"outside \[0, 10\)"):  # later batches: checked before their forward
        t._batch({**img, "labels": torch.tensor([3, 10])}, None)
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cls = LlamaForSequenceClassification(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2, num_labels=3,
                                                     pad_token_id=0))
    ids = torch.randint(1, V, (2, 8))
    with pytest.raises(PlanError, match=r"\(2,\) for regression \(one output\), \(2, 3\) for multi-label"):
        Trainer(cls, "baseline", device="cpu").step({"input_ids": ids, "labels": torch.tensor([0.0, 2.0])})
    monkeypatch.setattr(trainer_mod, "learn_classes", lambda *a: None)
    with pytest.raises(IndexError, match="out of bounds"):
        Trainer(ConvNet(), "baseline", device="cpu").step(img)

"""Your own model, your own batches, Hugging Face's Trainer (issue 22, part A).

GPT-2, Llama and BERT from small transformers configs and a small conv net: every model x plan cell
trains 5 steps or is refused with a PlanError; with transformers-style batch dicts ``accum:4`` equals the
un-accumulated step (also when the model computes its own loss) and the loss equals ``model(**batch).loss``;
``transformers.Trainer`` with ``training_arguments`` and ``MemoryCallback`` measures what a plain loop
under ``MemoryTracker`` measures, with the optimizer's state where it belongs.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from colabkit import IGNORE_INDEX, MemoryTracker, PlanError, Trainer  # noqa: E402
from colabkit import hf  # noqa: E402
from colabkit.batches import make_batch  # noqa: E402
from colabkit.techniques import compress  # noqa: E402
from colabkit.techniques.fused_step import FusedStepOptimizer  # noqa: E402

B, S, V = 8, 32, 512  # effective batch, sequence, vocabulary: tiny, so the matrix runs in seconds
PLANS = ["baseline", "checkpoint", "accum:4", "adamw8bit", "lora:8", "qlora:8", "compress:int8",
         "checkpoint+adamw4bit+fused-step"]


# ----- models and batches ---------------------------------------------------------------------------
def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def bert() -> nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=V,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class ConvNet(nn.Module):
    """A small image classifier (torchvision does not install here): (B, 3, 16, 16) -> (B, 10)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, pixel_values):
        return self.head(self.features(pixel_values).flatten(1))


def lm_batch(seed: int = 0, padded: bool = True) -> dict:
    """Right-padded sequences of very different lengths: attention_mask 0 and labels -100 past each end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, S), generator=g)
    lengths = torch.tensor([32, 3, 20, 5, 32, 2, 12, 7]) if padded else torch.full((B,), S)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def cls_batch(seed: int = 0) -> dict:
    b = lm_batch(seed)
    return {**b, "labels": torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))}


def img_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g), "labels": torch.randint(0, 10, (B,), generator=g)}


MODELS = {"gpt2": (gpt2, lm_batch), "llama": (llama, lm_batch), "bert": (bert, cls_batch), "convnet": (ConvNet, img_batch)}


def _quantized_share(model: nn.Module) -> float:
    """Share of the weights of linear and Conv1D layers (the head excepted) stored in 4 bits."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    q = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))  # packed: 2 per byte
    full = sum(m.weight.numel() for n, m in model.named_modules()
               if type(m) in (nn.Linear, Conv1D) and "lora_" not in n
               and not n.endswith(("lm_head", "classifier", "head", "score")))
    return q / max(q + full, 1)


def _head_trains(model: nn.Module) -> bool:
    """The task head's own weights train (not only adapters on it): peft's modules_to_save."""
    return any(p.requires_grad for n, p in model.named_parameters()
               if "classifier" in n and "lora_" not in n)


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
    if plan in ("lora:8", "qlora:8"):
        trainable = [n for n, p in m.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n or "classifier" in n or "head" in n for n in trainable)
        if name == "bert":
            assert _head_trains(m), "the classification head stays frozen"
    if plan == "qlora:8":
        assert _quantized_share(m) >= 0.9, f"qlora quantized {_quantized_share(m):.0%} of the base's linear weights"
    if plan == "compress:int8":
        assert spy["packed"] > 0
    if "fused-step" in plan:
        assert isinstance(t.optimizer, FusedStepOptimizer) and t.optimizer.steps_in_backward > 0


_NEEDS_I22B = {
    ("gpt2", "qlora:8"): "needs i22b: GPT-2's Conv1D layers quantized (today qlora quantizes nothing on GPT-2)",
    ("bert", "lora:8"): "needs i22b: the classification head trainable (peft's modules_to_save)",
    ("bert", "qlora:8"): "needs i22b: the classification head trainable (peft's modules_to_save)",
}
_REFUSED = {("convnet", "checkpoint"): "checkpoint", ("convnet", "checkpoint+adamw4bit+fused-step"): "checkpoint"}


def _cells():
    for name in MODELS:
        for plan in PLANS:
            marks = [pytest.mark.xfail(strict=True, reason=_NEEDS_I22B[name, plan])] if (name, plan) in _NEEDS_I22B else []
            yield pytest.param(name, plan, marks=marks, id=f"{name}-{plan}")


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
    (bert, "tokens", "tokens", "cannot make a loss from the model's output"),  # BERT given LM targets: raw ValueError before
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


# ----- transformers' Trainer: training_arguments, prepare_model, MemoryCallback -----------------------
def test_training_arguments_maps_every_loop_token():
    args = hf.training_arguments("fp16+checkpoint+accum:4+lion8bit", output_dir="o", report_to="none", use_cpu=True)
    assert (args.fp16, args.gradient_accumulation_steps, args.optim.value) == (True, 4, "lion_8bit")
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    for tok, optim in [("adamw8bit", "adamw_bnb_8bit"), ("lion", "lion_32bit"), ("adamw4bit", "adamw_torch_4bit"),
                       ("adafactor", "adafactor"), ("sgd", "sgd"), ("baseline", "adamw_torch")]:
        assert hf.training_arguments(tok, output_dir="o", use_cpu=True).optim.value == optim
    args = hf.training_arguments("sgd:0.9", output_dir="o", use_cpu=True)
    _, kw = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert kw["momentum"] == 0.9
    # model-side tokens are left to prepare_model, not dropped: the args remember the whole plan
    assert hf.training_arguments("lora:8+compress:int8", output_dir="o", use_cpu=True).colabkit_plan == "lora:8+compress:int8"


@pytest.mark.parametrize("plan, match", [
    ("fused-step", "steps each parameter inside backward"), ("adam-mini", "no Adam-mini"),
    ("galore:8", "slice of the whole SVD factor"), ("offload:optimizer", "builds and steps its own optimizer"),
    ("paged-adamw8bit", "no GPU memory to page"), ("zero:2", "shards through accelerate"),
])
def test_training_arguments_refuses_what_has_no_faithful_form(plan, match):
    with pytest.raises(PlanError, match=match):
        hf.training_arguments(plan, output_dir="o", use_cpu=True)
    if plan not in ("paged-adamw8bit",):
        with pytest.raises(PlanError, match=match):
            hf.prepare_model(gpt2(), plan, device="cpu")


def test_training_arguments_refuses_contradicting_keywords():
    with pytest.raises(PlanError, match="gradient_accumulation_steps=2 contradicts"):
        hf.training_arguments("accum:4", output_dir="o", use_cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(PlanError, match="optim='adamw_torch' contradicts"):
        hf.training_arguments("adamw8bit", output_dir="o", use_cpu=True, optim="adamw_torch")


def test_prepare_model_applies_the_model_side(monkeypatch):
    """lora through colabkit's LoRA, compress as a forward context around model.forward (the loss that
    transformers computes inside included), checkpoint:N on every N-th layer."""
    m = hf.prepare_model(gpt2(), "lora:8+compress:int8+accum:2", device="cpu")
    assert m._colabkit_plan == "lora:8+compress:int8+accum:2"
    assert all("lora_" in n for n, p in m.named_parameters() if p.requires_grad)
    packed = []
    quantize = compress.quantize
    monkeypatch.setattr(compress, "quantize", lambda *a, **k: packed.append(1) or quantize(*a, **k))
    m(**lm_batch()).loss.backward()
    assert packed, "compress:int8 packed nothing"
    m2 = hf.prepare_model(llama(), "checkpoint:2", device="cpu")
    assert m2.is_gradient_checkpointing


def _lm_dataset(n: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, V, (S,), generator=g)), "labels": ids.clone()} for _ in range(n)]


def _hf_args(plan: str, tmp_path, **kw):
    kw = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 5, "logging_steps": 1,
          "report_to": "none", "learning_rate": 1e-3, "save_strategy": "no", "disable_tqdm": True, "use_cpu": True,
          "seed": 0, **kw}
    return hf.training_arguments(plan, **kw)


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor in an optimizer's state, each storage once (independent of colabkit)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    seen = {}
    for s in inner.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _plain_loop_peak(plan_accum: int = 4, steps: int = 5) -> int:
    """What MemoryTracker measures around the same run written as a plain loop: GPT-2 with gradient
    checkpointing, bitsandbytes' 8-bit AdamW, 4 micro-batches of 2 normalised by the window's tokens,
    clipping at 1.0 as transformers does."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = gpt2().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = bnb.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}],
                          lr=1e-3, optim_bits=8)
    data = _lm_dataset()
    with MemoryTracker(model, opt) as mt:
        for step in range(steps):
            window = [{k: torch.stack([d[k] for d in data[(step * plan_accum + i) * 2:(step * plan_accum + i) * 2 + 2]])
                       for k in data[0]} for i in range(plan_accum)]
            n = sum(w["labels"][:, 1:].ne(IGNORE_INDEX).sum() for w in window)
            for w in window:
                with mt.phase("forward", step):
                    loss = model(**w, num_items_in_batch=n).loss
                with mt.phase("backward", step):
                    loss.backward()
                del loss
            with mt.phase("optimizer", step):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                model.zero_grad(set_to_none=True)
    return mt.report()["peak_bytes"]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_hf_trainer_with_memory_callback(tmp_path, monkeypatch):
    """transformers.Trainer + training_arguments('checkpoint+accum:4+adamw8bit') + MemoryCallback trains GPT-2 5
    steps on the CPU; the optimizer category equals bitsandbytes' state bytes; the peak is within 2% of a
    plain loop's under MemoryTracker; the memory scalars reach TensorBoard through report_to."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = "checkpoint+accum:4+adamw8bit"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    torch.manual_seed(0)
    model = hf.prepare_model(gpt2(), plan, device="cpu")
    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    assert isinstance(cb, transformers.TrainerCallback)
    trainer = transformers.Trainer(model=model, args=_hf_args(plan, tmp_path, report_to="tensorboard"),
                                   train_dataset=_lm_dataset(), callbacks=[cb])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 5 and len(logs) == 5 and all(math.isfinite(h["loss"]) for h in logs)
    r = cb.report()
    assert r["breakdown"]["optimizer"] == _state_bytes(trainer.optimizer) > 0
    assert {"forward", "backward", "optimizer"} <= set(r["phase_peaks"])
    plain = _plain_loop_peak()
    assert abs(r["peak_bytes"] - plain) <= 0.02 * plain, (r["peak_bytes"], plain)
    assert logs[-1]["memory/optimizer_bytes"] == r["breakdown"]["optimizer"]
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert "train/memory/optimizer_bytes" in tags and "train/memory/step_peak_bytes" in tags
    assert ea.Scalars("train/memory/optimizer_bytes")[-1].value == r["breakdown"]["optimizer"]


def test_a_tracker_around_train_files_the_optimizer_under_other(tmp_path):
    """The problem MemoryCallback solves: a tracker started before trainer.train() does not know the
    optimizer the Trainer builds, so AdamW's state is counted as 'other'."""
    torch.manual_seed(0)
    model = gpt2()
    trainer = transformers.Trainer(model=model, args=_hf_args("baseline", tmp_path, max_steps=2), train_dataset=_lm_dataset())
    with MemoryTracker(model) as mt:
        trainer.train()
    r = mt.report()
    assert r["breakdown"]["optimizer"] == 0 and r["breakdown"]["other"] >= _state_bytes(trainer.optimizer)


def test_memory_scalars_reach_reporters_listed_before_the_callback(monkeypatch):
    """MemoryCallback moves itself ahead of the reporters (which transformers lists first), so their on_log
    sees memory/*; negative control: left where it was, a reporter gets the log without them."""
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    class Reporter(transformers.TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.seen.append(dict(logs))

    for move in (True, False):
        if not move:
            monkeypatch.setattr(hf.MemoryCallback, "_go_first", lambda self: None)
        reporter, cb = Reporter(), hf.MemoryCallback(live_plot=False)
        handler = CallbackHandler([reporter, cb], None, None, None, None)
        args, state, control = transformers.TrainingArguments("o", report_to="none"), TrainerState(), TrainerControl()
        handler.on_init_end(args, state, control)
        cb._pending = {"memory/params_bytes": 1.0}
        handler.on_log(args, state, control, {"loss": 1.0})
        assert ("memory/params_bytes" in reporter.seen[-1]) is move


def test_the_run_must_carry_the_whole_plan(tmp_path):
    """A model-side token without prepare_model, or a prepared model with arguments that lack the loop-side
    tokens, stops train() at the start with a PlanError (nothing dropped silently)."""
    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    trainer = transformers.Trainer(model=gpt2(), args=_hf_args("lora:8+accum:2", tmp_path), train_dataset=_lm_dataset(),
                                   callbacks=[cb])
    with pytest.raises(PlanError, match="lora:8 live on the model: call colabkit.hf.prepare_model"):
        trainer.train()
    cb.close()
    model = hf.prepare_model(gpt2(), "fp16+lora:8", device="cpu")
    args = transformers.TrainingArguments(str(tmp_path / "o2"), report_to="none", use_cpu=True, max_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_dataset(), callbacks=[cb])
    with pytest.raises(PlanError, match="plan token 'fp16' needs TrainingArguments\\(fp16=True\\)"):
        trainer.train()
    cb.close()


@pytest.mark.parametrize("name, plan", [(n, p) for n in ("gpt2", "bert") for p in PLANS])
def test_hf_trainer_matrix(name, plan, tmp_path):
    """The same cells through transformers' Trainer: 5 steps with a finite loss, or a PlanError."""
    if (name, plan) in _NEEDS_I22B:
        pytest.xfail(_NEEDS_I22B[name, plan])  # checked by the colabkit.Trainer matrix, strictly
    make = gpt2 if name == "gpt2" else bert
    data = _lm_dataset() if name == "gpt2" else [{**d, "labels": torch.tensor(i % 3)} for i, d in enumerate(_lm_dataset())]
    try:
        model = hf.prepare_model(make(), plan, device="cpu")
        args = _hf_args(plan, tmp_path, per_device_train_batch_size=2 if "accum" in plan else 8)
    except PlanError as e:
        assert plan == "checkpoint+adamw4bit+fused-step" and "fused-step" in str(e)
        return
    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert cb.report()["peak_bytes"] > 0


def test_import_colabkit_does_not_import_transformers():
    code = "import sys, colabkit; assert 'transformers' not in sys.modules; print(colabkit.MemoryCallback.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "MemoryCallback", out.stderr[-2000:]


def test_load_hf_4bit_asks_for_one_device_and_the_installed_dtype_keyword(monkeypatch):
    """Issue 24 item 6, checked on the CPU: the whole model on the tracked device (not device_map='auto',
    which splits it over 2 T4s) and dtype= / torch_dtype= as the installed transformers understands."""
    from colabkit import hf_models

    seen = {}
    tf = hf_models._transformers()  # the module hf_models sees (an earlier test may have re-imported it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tf, "BitsAndBytesConfig", lambda **kw: kw)
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", lambda model_id, **kw: seen.update(kw) or nn.Linear(1, 1))
    hf_models.load_hf_4bit("some/model")
    assert seen["device_map"] == {"": 0}
    assert seen["dtype"] == torch.float16 and "torch_dtype" not in seen  # transformers 5.x here
    monkeypatch.setattr(tf, "__version__", "4.45.2")
    seen.clear()
    hf_models.load_hf_4bit("some/model")
    assert seen["torch_dtype"] == torch.float16 and "dtype" not in seen


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed")
def test_trl_sft_trainer_with_memory_callback(tmp_path):
    """TRL's SFTTrainer (a transformers.Trainer) takes training_arguments(..., cls=SFTConfig) and MemoryCallback."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(V - 2)]
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[i] for i in torch.randint(0, V - 2, (S - 2,), generator=g).tolist()) for _ in range(40)]
    plan = "accum:2+adamw8bit"
    args = _hf_args(plan, tmp_path, cls=trl.SFTConfig, max_length=S, per_device_train_batch_size=2)
    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    trainer = trl.SFTTrainer(model=hf.prepare_model(gpt2(), plan, device="cpu"), args=args,
                             train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tokenizer,
                             callbacks=[cb])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert cb.report()["breakdown"]["optimizer"] == _state_bytes(trainer.optimizer) > 0

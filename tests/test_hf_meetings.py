"""Where two things meet under transformers' Trainer and TRL's SFTTrainer (issue 36, a new user's review of
2026-11-27): checkpointing the Trainer turns on with an attention backend colabkit forces, accelerate's
mixed-precision wrapper with chunked-ce, the old name of gradient checkpointing, and a user's own nn.Module
with checkpoint, lora and attention:* -- each trains with its effect measured, or is stopped with its real
reason. Each has a control that puts the old behaviour back and must be caught.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from colabkit import PlanError, Trainer, build_model  # noqa: E402
from colabkit import hf, hf_witness  # noqa: E402
from colabkit.techniques import chunked_ce  # noqa: E402
from tests.test_hf_paths import (KINDS, STEPS, B, V, _fresh_bitsandbytes_overrides, baselines, data, needs_trl,  # noqa: E402,F401
                                 run, trl)


def _kinds():
    return [pytest.param(k, marks=[needs_trl] if k == "trl" else []) for k in KINDS]


def _losses(r) -> list[float]:
    return [h["loss"] for h in r.trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("kind", _kinds())
def test_checkpointing_the_trainer_turns_on_recomputes_under_the_forced_backend(kind, data, tmp_path, monkeypatch):
    """checkpoint (the Trainer's activation_checkpointing) with attention:math: the recompute in backward runs
    under the forward's SDPA backend, so it trains; checkpointing changes no number (losses equal attention:math
    alone within 1e-5) and frees activations. Control: without colabkit's context_fn on the Trainer's enabling
    call the recompute runs torch's default kernel, saves other shapes, and torch raises CheckpointError."""
    both = run(kind, "checkpoint+attention:math", data, tmp_path / "both")
    alone = run(kind, "attention:math", data, tmp_path / "alone")
    assert _losses(both) == pytest.approx(_losses(alone), rel=1e-5)
    assert both.acts < alone.acts
    assert both.model._colabkit_ran["attention:math"] == 2
    monkeypatch.setattr(hf, "for_trainer", lambda model: None)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        run(kind, "checkpoint+attention:math", data, tmp_path / "old")


def test_bf16_with_chunked_ce_under_accelerates_fp32_outputs(data, baselines, tmp_path, monkeypatch):
    """accelerate wraps the forward to cast fp16/bf16 outputs to fp32 and asks each output its dtype: the logits'
    stand-in answers float32 (what the chunked loss is computed in), so bf16+chunked-ce trains and the full
    logits never exist. Control: a stand-in without a dtype was refused as "the model uses its logits"."""
    r, bf16 = run("hf", "bf16+chunked-ce", data, tmp_path / "new"), run("hf", "bf16", data, tmp_path / "bf16")
    b, s = r.shapes[0]
    assert r.acts <= bf16.acts - b * s * V * 2, (r.acts, bf16.acts)  # at least the (B, S, V) bf16 logits
    assert r.model._colabkit_ran["chunked-ce"] == 2
    monkeypatch.delattr(chunked_ce.ChunkedLogits, "dtype")
    with pytest.raises(PlanError, match=r"uses its logits inside forward \(\.dtype\)"):
        run("hf", "bf16+chunked-ce", data, tmp_path / "old")


@needs_trl
def test_trl_fused_head_is_named_under_accelerates_wrappers(data, tmp_path):
    """Under bf16 accelerate wraps TRL's fused forward (autocast, outputs to fp32): the stop still names TRL's fused
    head, not a missing label (what it said while only the outermost forward was looked at)."""
    with pytest.raises(PlanError, match="did not run in the first training step") as e:
        run("trl", "bf16+chunked-ce", data, tmp_path)
    assert "TRL's fused LM head" in str(e.value) and "without labels" not in str(e.value)


@needs_trl
def test_trl_peft_config_on_top_of_the_plans_lora_is_stopped(data, tmp_path, monkeypatch):
    """SFTTrainer(peft_config=...) on a model prepared with lora:8 wraps it in get_peft_model, whose adapter has the
    same name ("default"): q_proj's rank-8 adapters become rank 4 while k/v/o keep colabkit's -- a mix neither asked
    for. MemoryCallback stops the Trainer's construction saying so. Controls: a peft_config on a model without a
    lora plan trains (the user's own PEFT, measured); with the check off the mix is really there."""
    import peft

    cfg = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])  # noqa: E731
    with pytest.raises(PlanError, match=r"another LoRA config was applied over colabkit's .*drop peft_config"):
        run("trl", "lora:8", data, tmp_path / "both", peft_config=cfg())
    own = run("trl", "baseline", data, tmp_path / "own", peft_config=cfg())
    assert {n.split(".")[-2] for n, p in own.trainer.model.named_parameters() if p.requires_grad} == {"default"}
    monkeypatch.setattr(hf_witness._lora, "adapter_shapes", lambda m: None)  # the record and the check both blind
    mixed = run("trl", "lora:8", data, tmp_path / "mixed", peft_config=cfg())
    ranks = {m.r["default"] for m in mixed.trainer.model.modules() if isinstance(getattr(m, "r", None), dict)}
    assert ranks == {4, 8}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))  # children "0" and "2"

    def forward(self, x):
        return x + self.ff(self.ln(x))


class MyLM(nn.Module):
    """A user's own language model: no config, no gradient_checkpointing_enable, attention-free blocks in a
    ModuleList (their names "0", "1" shared with the Sequential's), its own loss."""

    def __init__(self, d: int = 64, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, V)

    def forward(self, input_ids, labels=None, **kw):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"logits": logits, "loss": loss}


def test_own_module_under_the_trainer_checkpoints_and_takes_lora(data, tmp_path):
    """checkpoint: prepare_model checkpoints the blocks and answers the Trainer's enabling call (it raised
    AttributeError: no gradient_checkpointing_enable); the losses equal the plain run's and activations drop.
    lora:8: adapters on the Linear layers only (the Sequential's "0" is also block "0": given whole).
    Control: without prepare_model, MemoryCallback stops the run at the Trainer's construction with the reason."""
    plain = run("hf", "baseline", data, tmp_path / "plain", make=MyLM)
    ckpt = run("hf", "checkpoint", data, tmp_path / "ckpt", make=MyLM)
    assert _losses(ckpt) == pytest.approx(_losses(plain), rel=1e-5)
    assert ckpt.acts < 0.7 * plain.acts, (ckpt.acts, plain.acts)
    lora = run("hf", "lora:8", data, tmp_path / "lora", make=MyLM)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in lora.model.named_parameters() if ".lora_A" in n}
    assert "blocks.0.ff.0" in adapted and "blocks.0" not in adapted
    assert all("lora_" in n for n, p in lora.model.named_parameters() if p.requires_grad)
    args = hf.training_arguments("checkpoint", output_dir=str(tmp_path / "raw"), use_cpu=True, report_to="none")
    with pytest.raises(PlanError, match="MyLM has no such method: call colabkit.hf.prepare_model"):
        transformers.Trainer(model=MyLM(), args=args, train_dataset=data["hf"],
                             callbacks=[hf.MemoryCallback(live_plot=False, print_table=False)])


def test_attention_on_a_model_without_sdpa_is_stopped_in_both_loops(data, tmp_path):
    """attention:* acts only where the model calls scaled_dot_product_attention: a model that computes no SDPA is
    stopped at its first training forward -- under transformers' Trainer (its context was entered, which is not
    acting) and in colabkit's own Trainer. Control: a GPT, which calls SDPA, trains in both."""
    with pytest.raises(PlanError, match="no scaled_dot_product_attention call ran"):
        run("hf", "attention:math", data, tmp_path / "own", make=MyLM)
    ids = torch.randint(0, V, (2, 16))
    with pytest.raises(PlanError, match="no scaled_dot_product_attention call ran"):
        Trainer(MyLM(), "attention:math", device="cpu").step({"input_ids": ids, "labels": ids})
    run("hf", "attention:math", data, tmp_path / "gpt", make=lambda: build_model("llama:2x128"))
    assert Trainer(build_model("gpt:2x32:v256"), "attention:math", device="cpu").step(ids, ids) > 0


def _bad_batches(tmp_path, rows, check: bool):
    """transformers.Trainer on llama:2x128 (V rows) over ``rows``; MemoryCallback with its batch check on or off."""
    args = hf.training_arguments("baseline", output_dir=str(tmp_path), per_device_train_batch_size=B, max_steps=STEPS,
                                 report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    cb = hf.MemoryCallback(live_plot=False, print_table=False, check_batches=check)
    trainer = transformers.Trainer(model=build_model("llama:2x128"), args=args, train_dataset=rows, callbacks=[cb])
    try:
        trainer.train()
    finally:
        cb.close()
    return cb


@pytest.mark.parametrize("key,match,torch_error", [
    ("input_ids", r"input_ids hold 4 ids outside \[0, 256\) \(min 300, max 300\).*resize_token_embeddings",
     "index out of range"),
    ("labels", r"labels hold 4 ids outside \[0, 256\).*this causal-lm head needs labels of shape \(4, 64\)",
     "out of bounds")])
def test_ids_past_the_vocabulary_are_stopped_under_transformers_trainer(data, tmp_path, key, match, torch_error):
    """An id the embedding or the LM head has no row for (a tokenizer that does not match the model) is a device-side
    assert on a GPU, after which the CUDA context is gone with the model in it; MemoryCallback checks each batch
    before the forward and stops the run with colabkit's error, the tracker closed. Control: with the check off the
    same batch reaches torch's own error (what the GPU turns into the assert)."""
    rows = [{k: v.clone() for k, v in r.items()} for r in data["hf"]]
    for r in rows:  # one id past the vocabulary in every row: the first batch, whichever rows the shuffle draws
        r[key][5] = 300
    with pytest.raises(PlanError, match=match):
        cb = _bad_batches(tmp_path / "on", rows, check=True)
    with pytest.raises(IndexError, match=torch_error):
        _bad_batches(tmp_path / "off", rows, check=False)
    good = _bad_batches(tmp_path / "good", data["hf"], check=True)  # the check refuses nothing valid
    assert good.report()["peak_bytes"] > 0


def test_multiple_choice_labels_index_the_choices():
    """A ...ForMultipleChoice model's labels pick one of the choices (dim 1 of its (B, choices, S) inputs), not one of
    config.num_labels: with 4 choices label 3 trains to the model's own loss (it was refused against num_labels=2);
    label 4 is refused naming the choices. Control: torch's own loss on the same batch."""
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMultipleChoice(cfg)
    assert cfg.num_labels == 2
    x, y = torch.randint(0, V, (2, 4, 8)), torch.tensor([3, 1])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits, y).item()
    assert Trainer(model, "sgd", device="cpu").step({"input_ids": x, "labels": y}) == pytest.approx(want, rel=1e-6)
    with pytest.raises(PlanError, match=r"multiple-choice head needs labels of shape \(2,\).*in \[0, 4\)"):
        Trainer(model, "sgd", device="cpu").step({"input_ids": x, "labels": torch.tensor([4, 1])})


@needs_trl
def test_a_tokenizer_larger_than_the_model_is_stopped_under_trl(tmp_path):
    """SFTTrainer with a tokenizer of V + 8 words on a model of V rows (the classic mismatch: tokens added, the
    embedding not resized): MemoryCallback stops the first batch naming the fix, though TRL's fused head goes around
    model.forward (the check sits on the model's call). Control: with the check off, torch's own error."""
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(V + 6)]
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>",
                                                     unk_token="<unk>")
    ds = datasets.Dataset.from_dict({"text": [f"w1 w2 {words[-1]} w3" for _ in range(8)]})  # id V + 7 in each

    def sft(check: bool, out: str):
        args = hf.training_arguments("baseline", cls=trl.SFTConfig, max_length=16, output_dir=str(tmp_path / out),
                                     per_device_train_batch_size=B, max_steps=STEPS, report_to="none",
                                     save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
        cb = hf.MemoryCallback(live_plot=False, print_table=False, check_batches=check)
        trainer = trl.SFTTrainer(model=build_model("llama:2x128"), args=args, train_dataset=ds,
                                 processing_class=tokenizer, callbacks=[cb])
        try:
            trainer.train()
        finally:
            cb.close()

    with pytest.raises(PlanError, match=rf"input_ids hold 4 ids outside \[0, {V}\) \(min {V + 7}, max {V + 7}\)"):
        sft(True, "on")
    with pytest.raises(IndexError, match="index out of range"):
        sft(False, "off")


def test_evaluate_after_train_is_checked_too(data, tmp_path):
    """The batch check lives as long as the model, not the measured run: trainer.evaluate() after train() on a batch
    with an id past the vocabulary gets colabkit's error (it reached torch's: the callback's hooks ended with the
    run). Control: a callback with check_batches=False leaves torch's IndexError."""
    rows = [{k: v.clone() for k, v in r.items()} for r in data["hf"][:4]]
    for r in rows:
        r["input_ids"][3] = 300
    for check, err, match in ((True, PlanError, "input_ids hold"), (False, IndexError, "index out of range")):
        args = hf.training_arguments("baseline", output_dir=str(tmp_path / str(check)), per_device_train_batch_size=B,
                                     per_device_eval_batch_size=B, max_steps=1, report_to="none", save_strategy="no",
                                     disable_tqdm=True, use_cpu=True)
        cb = hf.MemoryCallback(live_plot=False, print_table=False, check_batches=check)
        trainer = transformers.Trainer(model=build_model("llama:2x128"), args=args, train_dataset=data["hf"],
                                       callbacks=[cb])
        trainer.train()
        with pytest.raises(err, match=match):
            trainer.evaluate(rows)

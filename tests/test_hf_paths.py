"""The HF path matrix (issue 36): each plan token given to hf.training_arguments / hf.prepare_model under
transformers.Trainer and TRL's SFTTrainer is applied with its effect measured against the same trainer's
plain run, or refused, or stopped by MemoryCallback at the first training forward -- each with its reason.
Nothing is dropped silently: TRL's fused LM head calls the backbone around model.forward, so the forward
contexts also sit on the backbone, and what still cannot run there (chunked-ce) stops the run.

A tiny llama (colabkit.build_model("llama:2x128")), 2 steps of batch 4, offline. The model-side tokens under
both trainers are the fast sample; the whole matrix is slow.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl") if importlib.util.find_spec("trl") else None

from colabkit import PlanError, build_model  # noqa: E402
from colabkit import hf  # noqa: E402
from tests.test_hf_trainer import _state_bytes  # noqa: E402  (the optimizer's own account of its state)

S, V, B, STEPS = 64, 256, 4, 2
KINDS = ["hf", "trl"]
needs_trl = pytest.mark.skipif(trl is None, reason="trl not installed")


@pytest.fixture(autouse=True)
def _fresh_bitsandbytes_overrides(monkeypatch):
    """transformers files its embeddings' 32-bit override on bitsandbytes' process-global manager, by
    parameter position: each test starts and leaves the process with an empty one."""
    optimizer = pytest.importorskip("bitsandbytes.optim.optimizer")
    monkeypatch.setattr(optimizer.GlobalOptimManager, "_instance", None)


@pytest.fixture(scope="module")
def data():
    """transformers.Trainer: token rows with their labels; SFTTrainer: texts of S-2 words and a word-level
    tokenizer over V ids (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, V, (S,), generator=g)), "labels": ids.clone()} for _ in range(16)]
    if trl is None:
        return {"hf": rows}
    import datasets

    words = [f"w{i}" for i in range(V - 2)]
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>",
                                                     unk_token="<unk>")
    texts = [" ".join(words[i] for i in torch.randint(0, V - 2, (S - 2,), generator=g).tolist()) for _ in range(16)]
    return {"hf": rows, "trl": (datasets.Dataset.from_dict({"text": texts}), tokenizer)}


class Run:
    """One run's model, trainer, MemoryCallback report, and the shapes of its training forwards."""

    def __init__(self, model, trainer, report, shapes):
        self.model, self.trainer, self.report, self.shapes = model, trainer, report, shapes

    @property
    def acts(self) -> int:
        return self.report["breakdown"]["activations"]


def run(kind: str, plan: str, data, tmp_path, offload_sim: bool = False, own_optimizer: str | None = None,
        make=lambda: build_model("llama:2x128"), **trainer_kw) -> Run:
    """Train ``STEPS`` steps of ``plan`` under transformers.Trainer ('hf') or SFTTrainer ('trl'); a refusal or a
    stop raises PlanError. ``own_optimizer``: the Trainer gets ``colabkit.make_optimizer(model, own_optimizer)``;
    ``make`` builds the model; ``trainer_kw`` go to the trainer (e.g. TRL's ``peft_config``)."""
    torch.manual_seed(0)
    model = hf.prepare_model(make(), plan, device="cpu", offload_sim=offload_sim)
    if own_optimizer is not None:
        import colabkit

        kw_opt = {"optimizers": (colabkit.make_optimizer(model, own_optimizer), None)}
    else:
        kw_opt = {}
    kw = dict(output_dir=str(tmp_path / f"{kind}-out"), per_device_train_batch_size=B, max_steps=STEPS,
              logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
              learning_rate=1e-3, offload_sim=offload_sim)
    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    shapes: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(
        lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)) if m.training and torch.is_grad_enabled() else None,
        with_kwargs=True)
    if kind == "hf":
        trainer = transformers.Trainer(model=model, args=hf.training_arguments(plan, **kw), train_dataset=data["hf"],
                                       callbacks=[cb], **kw_opt, **trainer_kw)
    else:
        ds, tokenizer = data["trl"]
        trainer = trl.SFTTrainer(model=model, args=hf.training_arguments(plan, cls=trl.SFTConfig, max_length=S, **kw),
                                 train_dataset=ds, processing_class=tokenizer, callbacks=[cb], **kw_opt,
                                 **trainer_kw)
    try:
        trainer.train()
    finally:
        cb.close()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == STEPS and len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    return Run(model, trainer, cb.report(), shapes)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, data):
    """The plain run of each trainer, once per module."""
    cache: dict[str, Run] = {}

    def get(kind: str) -> Run:
        if kind not in cache:
            cache[kind] = run(kind, "baseline", data, tmp_path_factory.mktemp(f"base-{kind}"))
        return cache[kind]
    return get


def _attention_probs_bytes(r: Run) -> int:
    """What forcing SDPA's math backend adds on the CPU (torch's default there is a fused flash kernel): math keeps
    the (B, H, S, S) fp32 softmax for backward where the fused kernel keeps a (B, H, S) log-sum-exp, per layer."""
    cfg = r.model.config
    b, s = r.shapes[0]
    return cfg.num_hidden_layers * b * cfg.num_attention_heads * (s * s - s) * 4


# ----- the expectations: what each token does under each trainer, measured against the plain run -----------
def less(cat: str, under: float = 0.95):
    def check(r: Run, base: Run) -> None:
        got, ref = r.report["breakdown"][cat], base.report["breakdown"][cat]
        assert got < under * ref, (cat, got, ref)
    return check


def without_logits(r: Run, base: Run) -> None:
    """chunked-ce: the activations lose at least the full (B, S, V) fp32 logits, which never exist."""
    b, s = r.shapes[0]
    assert r.acts <= base.acts - b * s * r.model.config.vocab_size * 4, (r.acts, base.acts)


def attention_math(r: Run, base: Run) -> None:
    assert r.model._colabkit_ran["attention:math"] == STEPS
    extra = r.acts - base.acts
    assert abs(extra - _attention_probs_bytes(r)) <= 0.05 * _attention_probs_bytes(r), (extra, _attention_probs_bytes(r))


def witnessed(tok: str, then):
    def check(r: Run, base: Run) -> None:
        assert r.model._colabkit_ran[tok] == STEPS, r.model._colabkit_ran
        then(r, base)
    return check


def accumulated(k: int):
    def check(r: Run, base: Run) -> None:
        assert len(base.shapes) == STEPS and len(r.shapes) == k * STEPS  # K micro-batches per optimizer step
        assert r.trainer.args.gradient_accumulation_steps == k
    return check


def adapters(quantized: bool):
    def check(r: Run, base: Run) -> None:
        import bitsandbytes as bnb

        trainable = [(n, p) for n, p in r.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n, _ in trainable)
        # gradients only for the adapters: the grads category is the adapters' fp32 bytes
        assert r.report["breakdown"]["grads"] == sum(p.numel() * 4 for _, p in trainable)
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in r.model.modules()) is quantized
        if quantized:
            assert r.report["breakdown"]["params"] < 0.5 * base.report["breakdown"]["params"]
    return check


def optimizer(cls_name: str, low: float, high: float):
    """The Trainer built ``cls_name``; its state (the tracker's optimizer category, equal to the optimizer's own
    bytes) is ``low``..``high`` bytes per trainable parameter (AdamW: 8; 8-bit: ~2 with transformers' 32-bit
    embedding override; Lion: 4; 4-bit: ~1; factored Adafactor ~0; SGD without momentum: 0)."""
    def check(r: Run, base: Run) -> None:
        opt = getattr(r.trainer.optimizer, "optimizer", r.trainer.optimizer)
        assert type(opt).__name__ == cls_name
        state = r.report["breakdown"]["optimizer"]
        # the category's own peak: Adafactor replaces each parameter's 0-dim fp32 RMS every step, so an old one
        # can coexist with its replacement at that peak (4 bytes per parameter at most); the others are exact
        assert _state_bytes(opt) <= state <= _state_bytes(opt) + (4 * len(opt.state) if cls_name == "Adafactor" else 0)
        n = sum(p.numel() for p in r.model.parameters() if p.requires_grad)
        assert low <= state / n <= high, state / n
    return check


def stopped(match: str):
    return ("stopped", match)


def stopped_at_start(match: str):
    return ("stopped at start", match)


def refused(match: str):
    return ("refused", match)


OFFLOAD_SIM = {"offload:activations"}
_REFUSALS = [("fused-step", "steps each parameter inside backward"), ("adam-mini", "no Adam-mini"),
             ("galore:8", "slice of the whole SVD factor"), ("offload:optimizer", "builds and steps its own optimizer"),
             ("offload:params", "moves the whole model to the device"),
             ("offload:disk", "builds and steps its own optimizer"), ("zero:2", "shards through accelerate"),
             ("paged-adamw8bit", "no GPU memory to page"), ("fp16", "neither autocasts nor scales the loss there"),
             ("zero:1", "shards through accelerate"), ("zero:3", "shards through accelerate"),
             ("attention:efficient", "on the CPU only attention:math can be forced"),
             ("auto", "choose it first -- plan = colabkit.choose_plan")]
# token -> (transformers.Trainer, TRL's SFTTrainer): a check against the same trainer's plain run, or a refusal/stop
MATRIX = {
    "compress:int8": (witnessed("compress:int8", less("activations", 0.9)),) * 2,
    "attention:math": (attention_math,) * 2,
    "offload:activations": (witnessed("offload:activations", less("activations", 0.9)),) * 2,
    "chunked-ce": (witnessed("chunked-ce", without_logits), stopped("TRL's fused LM head")),
    # (under SFTTrainer the activations also hold TRL's fused head's buffers, which checkpointing leaves alone)
    "checkpoint": (less("activations", 0.5), less("activations", 0.9)),
    "checkpoint:2": (witnessed("checkpoint:2", less("activations")),) * 2,
    "bf16": (less("activations", 0.9),) * 2,
    "accum:2": (accumulated(2),) * 2,
    "lora:4": (witnessed("lora:4", adapters(False)),) * 2,
    "qlora:4": (witnessed("qlora:4", adapters(True)),) * 2,
    "adamw": (optimizer("AdamW", 8.0, 8.01),) * 2,
    "adamw8bit": (optimizer("AdamW", 1.9, 3.0),) * 2,
    "adamw4bit": (stopped_at_start("torch.compile\\(fullgraph=True\\)"),) * 2,
    "lion": (optimizer("Lion", 4.0, 4.01),) * 2,
    "lion8bit": (optimizer("Lion", 0.9, 1.6),) * 2,
    "adafactor": (optimizer("Adafactor", 0.0, 0.1),) * 2,
    "sgd": (optimizer("SGD", 0.0, 0.0),) * 2,
    **{tok: (refused(why),) * 2 for tok, why in _REFUSALS},
}
FAST = {"compress:int8", "attention:math", "offload:activations", "chunked-ce", "fused-step", "auto"}


def check_cell(kind: str, tok: str, data, baselines, tmp_path) -> None:
    expect = MATRIX[tok][KINDS.index(kind)]
    if isinstance(expect, tuple) and expect[0] == "refused":
        with pytest.raises(PlanError, match=expect[1]):
            run(kind, tok, data, tmp_path)
        return
    if isinstance(expect, tuple) and expect[0] == "stopped at start":  # MemoryCallback's on_train_begin
        with pytest.raises(PlanError, match=expect[1]):
            run(kind, tok, data, tmp_path)
        # what the reason offers instead runs and measures: colabkit's 4-bit AdamW, ~1 byte per parameter
        optimizer("AdamW4bit", 0.9, 1.6)(run(kind, "baseline", data, tmp_path, own_optimizer=tok), baselines(kind))
        return
    if isinstance(expect, tuple) and expect[0] == "stopped":
        with pytest.raises(PlanError, match="did not run in the first training step") as e:
            run(kind, tok, data, tmp_path, offload_sim=tok in OFFLOAD_SIM)
        assert expect[1] in str(e.value)
        return
    expect(run(kind, tok, data, tmp_path, offload_sim=tok in OFFLOAD_SIM), baselines(kind))


def _cells(fast: bool):
    for tok in MATRIX:
        for kind in KINDS:
            if (tok in FAST) is fast:
                yield pytest.param(kind, tok, id=f"{kind}-{tok}", marks=[needs_trl] if kind == "trl" else [])


@pytest.mark.parametrize("kind, tok", list(_cells(fast=True)))
def test_model_side_tokens_apply_or_stop(kind, tok, data, baselines, tmp_path):
    """Each model-side token under transformers.Trainer and SFTTrainer: applied (its context entered every
    step) with its effect measured -- int8 activations smaller, the math backend's S² softmax bytes, activations
    moved to the (simulated) host, the chunked loss without the logits -- or stopped with the reason."""
    check_cell(kind, tok, data, baselines, tmp_path)


@pytest.mark.slow  # fast twin: test_model_side_tokens_apply_or_stop
@pytest.mark.parametrize("kind, tok", list(_cells(fast=False)))
def test_hf_path_matrix(kind, tok, data, baselines, tmp_path):
    """Every other plan token under both trainers: applied with its effect measured, or refused with the reason."""
    check_cell(kind, tok, data, baselines, tmp_path)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[needs_trl] if k == "trl" else []) for k in KINDS])
def test_a_users_peft_model_takes_the_model_side_tokens(kind, data, tmp_path):
    """The user's own peft PeftModel (adapters by peft.get_peft_model) given compress:int8: the plan is found on the
    model under the wrapper, the contexts reach its backbone under both trainers, activations shrink. Reference:
    the same PeftModel without the token."""
    peft = pytest.importorskip("peft")

    def make():
        return peft.get_peft_model(build_model("llama:2x128"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    plain, packed = (run(kind, plan, data, tmp_path / plan, make=make) for plan in ("baseline", "compress:int8"))
    assert packed.model.get_base_model()._colabkit_ran["compress:int8"] == STEPS
    assert packed.acts < 0.95 * plain.acts, (packed.acts, plain.acts)  # SFTTrainer: TRL's head buffers stay


@needs_trl
def test_trl_bypass_is_caught_when_the_backbone_is_not_wrapped(data, baselines, tmp_path, monkeypatch):
    """Negative control for the fix: with the contexts on model.forward only (as before), TRL's fused head runs
    the backbone without compress:int8 -- and MemoryCallback stops the run at the first forward, naming TRL's
    fused head, before any optimizer step."""
    wrap = hf._with_contexts

    def outer_only(model, makers, plan, ctx):
        base = model.base_model
        keep = base.forward
        wrap(model, makers, plan, ctx)
        base.forward = keep  # undo the backbone's wrapper

    monkeypatch.setattr(hf, "_with_contexts", outer_only)
    with pytest.raises(PlanError, match="'compress:int8' did not run in the first training step") as e:
        run("trl", "compress:int8", data, tmp_path)
    assert "TRL's fused LM head" in str(e.value)


def test_training_arguments_keep_sftconfig_defaults_off_the_plan():
    """SFTConfig defaults bf16 and gradient checkpointing on; under a plan without them they are off, and asking
    for them by keyword outside the plan is refused (the plan is what is applied, checked and reported)."""
    cls = trl.SFTConfig if trl is not None else transformers.TrainingArguments
    args = hf.training_arguments("baseline", cls=cls, output_dir="o", use_cpu=True, report_to="none")
    ckpt = hf._checkpoint_field()
    assert (args.bf16, args.fp16, getattr(args, ckpt)) == (False, False, False)
    if trl is not None:  # negative control: SFTConfig on its own turns both on
        raw = trl.SFTConfig(output_dir="o", use_cpu=True, report_to="none")
        assert raw.bf16 and raw.gradient_checkpointing
    args = hf.training_arguments("bf16+checkpoint", cls=cls, output_dir="o", use_cpu=True, report_to="none")
    assert args.bf16 and getattr(args, ckpt)
    with pytest.raises(PlanError, match="bf16=True is not in the plan 'checkpoint': add 'bf16'"):
        hf.training_arguments("checkpoint", output_dir="o", use_cpu=True, bf16=True)


def test_check_ran_sees_a_model_side_token_that_stopped_applying():
    """checkpoint:2 is witnessed by its checkpointed layers' calls: a training forward passes check_ran; after
    gradient_checkpointing_disable (nothing is recomputed any more) the same forward is stopped with the reason."""
    model = hf.prepare_model(build_model("llama:2x128"), "checkpoint:2", device="cpu").train()
    ids = torch.randint(0, V, (2, 16))
    model._colabkit_ran.clear()
    model(input_ids=ids, labels=ids)
    assert model._colabkit_ran == {"checkpoint:2": 1}  # one of the two layers
    hf.check_ran(model)
    model.gradient_checkpointing_disable()
    model._colabkit_ran.clear()
    model(input_ids=ids, labels=ids)
    with pytest.raises(PlanError, match="'checkpoint:2' did not run in the first training step \\(no checkpointed layer ran\\)"):
        hf.check_ran(model)


def test_chunked_ce_without_labels_is_stopped(data, tmp_path):
    """transformers.Trainer with a compute_loss_func calls the model without labels: the full logits are built and
    colabkit's chunked loss never runs -- stopped at the first forward, saying so (a reason true for this case).
    Reference: the same run without compute_loss_func trains (test_model_side_tokens_apply_or_stop[hf-chunked-ce])."""
    model = hf.prepare_model(build_model("llama:2x128"), "chunked-ce", device="cpu")
    args = hf.training_arguments("chunked-ce", output_dir=str(tmp_path / "o"), per_device_train_batch_size=B,
                                 max_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)

    def loss_func(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    cb = hf.MemoryCallback(live_plot=False, print_table=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data["hf"], compute_loss_func=loss_func,
                                   callbacks=[cb])
    from colabkit.memory_hooks import _RESIZING
    with pytest.raises(PlanError, match="'chunked-ce' did not run .* called without labels"):
        trainer.train()
    # the stopped run leaves no tracker on (its dispatch mode broke torch.compile in later cells and tests)
    assert cb.tracker is None and _RESIZING == [] and cb.report()["peak_bytes"] > 0


@needs_trl
def test_trl_casting_qlora_adapters_to_bf16_is_stopped(data, tmp_path):
    """SFTTrainer casts the trainable parameters of a 4-bit hub model (is_loaded_in_4bit) to bf16; colabkit's
    qlora trains its adapters in fp32: MemoryCallback stops the run at the start, saying so. The fix it names
    (casting them back after building the trainer) trains with fp32 adapters. Stand-in for the hub model: the
    attributes from_pretrained(quantization_config=...) leaves (test_hf_trainer's)."""
    import types

    def hub_4bit():
        m = build_model("llama:2x128")
        m.is_quantized = m.is_loaded_in_4bit = True
        m.hf_quantizer = types.SimpleNamespace(is_trainable=True, is_qat_trainable=False,
                                               quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
        return m

    with pytest.raises(PlanError, match="adapters of 'qlora:4' train in torch.bfloat16, not fp32 \\(TRL's SFTTrainer"):
        run("trl", "qlora:4", data, tmp_path, make=hub_4bit)
    ds, tokenizer = data["trl"]
    model = hf.prepare_model(hub_4bit(), "qlora:4", device="cpu")
    args = hf.training_arguments("qlora:4", cls=trl.SFTConfig, max_length=S, output_dir=str(tmp_path / "o"),
                                 per_device_train_batch_size=B, max_steps=1, report_to="none", save_strategy="no",
                                 disable_tqdm=True, use_cpu=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer,
                             callbacks=[hf.MemoryCallback(live_plot=False, print_table=False)])
    for p in model.parameters():
        p.data = p.data.float() if p.requires_grad else p.data
    trainer.train()
    assert trainer.state.global_step == 1
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}

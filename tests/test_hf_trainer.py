"""transformers' Trainer with colabkit (issue 22, part A): training_arguments maps each loop-side plan
token to its native form or refuses it, prepare_model applies the model-side ones, and MemoryCallback
measures what a plain loop under MemoryTracker measures -- the optimizer's state where it belongs, the
memory scalars in every reporter's log; TRL's SFTTrainer too.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from colabkit import IGNORE_INDEX, MemoryTracker, PlanError  # noqa: E402
from colabkit import hf  # noqa: E402
from colabkit.techniques import compress  # noqa: E402
from own_models import S, V, _cells, _check_model_side, bert, gpt2, llama, lm_batch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_bitsandbytes_overrides(monkeypatch):
    """transformers' Trainer files its embeddings' 32-bit override on bitsandbytes' process-global manager,
    by parameter position: each test starts and leaves the process with an empty one."""
    optimizer = pytest.importorskip("bitsandbytes.optim.optimizer")
    monkeypatch.setattr(optimizer.GlobalOptimManager, "_instance", None)


# ----- transformers' Trainer: training_arguments, prepare_model, MemoryCallback -----------------------
def test_training_arguments_maps_every_loop_token():
    args = hf.training_arguments("bf16+checkpoint+accum:4+lion8bit", output_dir="o", report_to="none", use_cpu=True)
    assert (args.bf16, args.gradient_accumulation_steps, args.optim.value) == (True, 4, "lion_8bit")
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
    ("fp16", "neither autocasts nor scales the loss there"),
])
def test_training_arguments_refuses_what_has_no_faithful_form(plan, match):
    with pytest.raises(PlanError, match=match):
        hf.training_arguments(plan, output_dir="o", use_cpu=True)
    if plan not in ("paged-adamw8bit",):
        with pytest.raises(PlanError, match=match):
            hf.prepare_model(gpt2(), plan, device="cpu")


def test_bf16_arguments_on_a_cpu_machine_need_no_use_cpu(tmp_path, monkeypatch):
    """The refusal of fp16 on a CPU says to use bf16; on a machine without a GPU, training_arguments("bf16") gives
    arguments for a CPU run (use_cpu=True set, as the device is the CPU) instead of transformers' "Your setup
    doesn't support bf16/gpu". Control: transformers' own TrainingArguments(bf16=True) without use_cpu raises."""
    monkeypatch.setattr(hf, "default_device", lambda: torch.device("cpu"))  # as on a machine without a GPU
    args = hf.training_arguments("bf16", output_dir=str(tmp_path), report_to="none")
    assert args.bf16 and args.use_cpu
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cpu"):
            transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to="none")


def test_training_arguments_refuses_contradicting_keywords():
    with pytest.raises(PlanError, match="gradient_accumulation_steps=2 contradicts"):
        hf.training_arguments("accum:4", output_dir="o", use_cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(PlanError, match="optim='adamw_torch' contradicts"):
        hf.training_arguments("adamw8bit", output_dir="o", use_cpu=True, optim="adamw_torch")
    # outside the plan: accumulation asked by keyword is refused as bf16 and checkpointing are
    with pytest.raises(PlanError, match="gradient_accumulation_steps=4 is not in the plan 'baseline': add 'accum:4'"):
        hf.training_arguments("baseline", output_dir="o", use_cpu=True, gradient_accumulation_steps=4)
    assert hf.training_arguments("baseline", output_dir="o", use_cpu=True, gradient_accumulation_steps=1)


def test_the_old_name_of_gradient_checkpointing_is_read_as_the_new_one():
    """transformers 5.x reads gradient_checkpointing(_kwargs) only when activation_checkpointing is unset, which
    training_arguments always sets: the old name was silently overruled (checkpointing off under plan 'baseline'
    with gradient_checkpointing=True; on under 'checkpoint' with gradient_checkpointing=False)."""
    if hf._checkpoint_field() != "activation_checkpointing":
        pytest.skip(f"transformers {transformers.__version__} has gradient_checkpointing only (no alias to read)")
    with pytest.raises(PlanError, match="activation_checkpointing=True is not in the plan 'baseline'"):
        hf.training_arguments("baseline", output_dir="o", use_cpu=True, gradient_checkpointing=True)
    with pytest.raises(PlanError, match="activation_checkpointing=False contradicts the plan 'checkpoint'"):
        hf.training_arguments("checkpoint", output_dir="o", use_cpu=True, gradient_checkpointing=False)
    args = hf.training_arguments("checkpoint", output_dir="o", use_cpu=True, gradient_checkpointing=True)
    assert args.activation_checkpointing and args.gradient_checkpointing
    with pytest.raises(PlanError, match="disagree"):
        hf.training_arguments("checkpoint", output_dir="o", use_cpu=True, gradient_checkpointing=False,
                              activation_checkpointing=True)
    # control: transformers itself, given both names as training_arguments passes them, keeps the new one
    raw = transformers.TrainingArguments(output_dir="o", use_cpu=True, gradient_checkpointing=True,
                                         activation_checkpointing=False)
    assert raw.activation_checkpointing is False


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
    for m in model.modules():  # as transformers' Trainer does for an 8-bit bitsandbytes optim: 32-bit embedding state
        if isinstance(m, nn.Embedding):
            bnb.optim.GlobalOptimManager.get_instance().register_module_override(m, "weight", {"optim_bits": 32})
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
    model = hf.prepare_model(gpt2(), "bf16+lora:8", device="cpu")
    args = transformers.TrainingArguments(str(tmp_path / "o2"), report_to="none", use_cpu=True, max_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_dataset(), callbacks=[cb])
    with pytest.raises(PlanError, match="plan token 'bf16' needs TrainingArguments\\(bf16=True\\)"):
        trainer.train()
    cb.close()


@pytest.mark.parametrize("name, plan", list(_cells(("gpt2", "bert"))))
def test_hf_trainer_matrix(name, plan, tmp_path):
    """The same cells through transformers' Trainer: 5 steps with a finite loss and the model-side tokens
    visible on the model, or a PlanError."""
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
    _check_model_side(plan, name, model)


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


def test_the_readme_snippets_run(tmp_path, monkeypatch):
    """The three ways in, as the README's "In your own notebook" shows them, run as they are."""
    import re

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme[readme.index("Three ways to bring your own model"):readme.index("`training_arguments` maps")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), scope)
    assert math.isfinite(scope["loss"]) and scope["trainer"].state.global_step == 5


def _hub_4bit_stand_in(model: nn.Module) -> nn.Module:
    """What from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True)) leaves on a model (its
    quantizer's preprocessing sets is_quantized and hf_quantizer), on a CPU model colabkit's qlora quantizes."""
    import types

    model.is_quantized = True
    model.hf_quantizer = types.SimpleNamespace(
        is_trainable=True, is_qat_trainable=False, quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
    return model


def test_qlora_on_a_4bit_hub_model_builds_and_trains_in_hf_trainer(tmp_path):
    """Issue 34 item 2: a 4-bit hub model (is_quantized, hf_quantizer) given adapters by prepare_model('qlora:R')
    is flagged as transformers' add_adapter flags it, so transformers.Trainer.__init__ (its
    validate_quantization_for_training) builds and trains the adapters. Negative control: the same adapters
    injected without prepare_model's flag are refused by transformers as "purely quantized"."""
    import bitsandbytes as bnb

    from colabkit.techniques.lora import apply_lora

    data = _lm_dataset(8)
    bare = apply_lora(_hub_4bit_stand_in(llama()), 4, quantize=True, device="cpu")
    with pytest.raises(ValueError, match="purely quantized"):
        transformers.Trainer(model=bare, args=_hf_args("qlora:4", tmp_path, max_steps=1), train_dataset=data)
    torch.manual_seed(0)
    model = hf.prepare_model(_hub_4bit_stand_in(llama()), "qlora:4", device="cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = transformers.Trainer(model=model, args=_hf_args("qlora:4", tmp_path, max_steps=2), train_dataset=data,
                                   callbacks=[hf.MemoryCallback(live_plot=False, print_table=False)])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert before and all("lora_" in n for n in before)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_B" in n)
    assert model._hf_peft_config_loaded and list(model.peft_config) == ["default"]  # as add_adapter leaves it

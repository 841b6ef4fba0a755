"""Hugging Face's Trainer with colabkit: measure it, and give it a plan.

Three pieces for ``transformers.Trainer`` (and TRL's ``SFTTrainer``, a subclass of it):

- :class:`MemoryCallback`: :class:`colabkit.MemoryTracker` during ``trainer.train()`` -- forward,
  backward and optimizer phases, the categories (the optimizer the Trainer builds included), the live
  plot in a notebook, ``memory/*`` scalars in every log (so TensorBoard, W&B or whatever ``report_to``
  names receive them) and the tracker's table at the end.
- :func:`training_arguments`: ``TrainingArguments`` with each loop-side plan token in its
  transformers-native form.
- :func:`prepare_model`: the model-side tokens applied to the model.

The same plan goes to both functions; each token is applied by exactly one of them, and a token that
neither can apply faithfully is refused by both, saying what to do instead. At the start of training
``MemoryCallback`` checks that the model and the arguments carry the whole plan, and after the first training
forward that each model-side token ran (its context entered, its hook fired, its loss computed): a caller that
goes around ``model.forward`` -- TRL's fused LM head calls the backbone and the head's weight itself -- gets the
forward contexts on the backbone, and what still did not run stops the run with the reason (chunked-ce under
TRL's fused head). Arguments classes with defaults of their own (TRL's ``SFTConfig``: bf16, gradient
checkpointing) follow the plan.

============================  ===========  ==================================================================
token                         applied by   transformers-native form
============================  ===========  ==================================================================
fp16, bf16                    arguments    ``fp16=True`` / ``bf16=True`` (autocast; fp16 with a GradScaler; fp16
                                           refused on the CPU, where accelerate would run it in fp32)
checkpoint                    arguments    ``gradient_checkpointing=True`` (non-reentrant; 5.x:
                                           ``activation_checkpointing``); prepare_model gives the Trainer's
                                           enabling call colabkit's recompute context (attention:* recomputes
                                           under its backend), and checkpoints a plain module's blocks itself
accum:K                       arguments    ``gradient_accumulation_steps=K`` (per_device_train_batch_size is
                                           then the micro-batch)
adamw, adamw8bit, lion, ...   arguments    ``optim=``: adamw_torch(_fused), adamw_bnb_8bit, paged_adamw_8bit,
                                           lion_32bit, lion_8bit, adamw_torch_4bit (torchao's 4-bit AdamW,
                                           blocks of 256), adafactor, sgd (+ ``optim_args="momentum=M"``)
lora:R, qlora:R               model        colabkit's LoRA (peft adapters; qlora: bitsandbytes NF4 base)
compress:int8, attention:X    model        their forward context around ``model.forward`` and the backbone's
checkpoint:N, offload:acts.   model        every N-th layer / saved activations to host RAM (as above)
chunked-ce, chunked-ce:C      model        the LM head returns its input, and the model, given labels while
                                           training, computes the chunked loss itself (``num_items_in_batch``);
                                           stopped under TRL's fused LM head, which computes its own
fused-step, adam-mini,        refused      the message says what to do (colabkit.Trainer, or
galore:R, offload:optimizer/                ``Trainer(optimizers=(colabkit.make_optimizer(model, tok), None))``)
params/disk, zero:N
============================  ===========  ==================================================================

>>> sorted(loop_arguments("fp16+accum:4+adamw8bit", "cuda").items())
[('fp16', True), ('gradient_accumulation_steps', 4), ('optim', 'adamw_bnb_8bit')]
>>> loop_arguments("fused-step")
Traceback (most recent call last):
...
colabkit.plan.PlanError: 'fused-step': transformers' Trainer clips and steps after backward; fused-step steps each parameter inside backward. Use colabkit.Trainer(model, plan) for fused-step, or drop it for transformers' Trainer
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from .batches import check_call, unwrap
from .env import default_device, env
from .hf_models import build_llama, dtype_kwarg, llama_config, llama_intermediate, load_hf_4bit, single_device_map  # noqa: F401
from .hf_witness import (_spelled, _with_contexts, _witness_adapters, _witness_checkpoint, _witness_chunked,
                         check_adapters, check_ran)
from .logs import memory_metrics
from .memory import MemoryTracker, format_report
from .notices import warn
from .plan import Context, Plan, PlanError
from .plots import LivePlot
from .techniques.checkpoint import for_trainer
from .techniques.chunked_ce import loss_in_forward
from .techniques.optimizers import HF_OPTIM

__all__ = ["MemoryCallback", "training_arguments", "prepare_model", "split_plan", "loop_arguments", "check_run",
           "check_ran", "check_adapters", "check_measurable", "check_one_device",
           # re-exported from colabkit.hf_models: loading Hugging Face models
           "build_llama", "dtype_kwarg", "llama_config", "llama_intermediate", "load_hf_4bit", "single_device_map"]

_OPTIM = HF_OPTIM
_MAKE_OPT = "pass colabkit's: Trainer(..., optimizers=(colabkit.make_optimizer(model, {tok!r}), None)) and drop {tok!r} from the plan"
_REFUSED = {
    "fused-step": "transformers' Trainer clips and steps after backward; fused-step steps each parameter inside "
                  "backward. Use colabkit.Trainer(model, plan) for fused-step, or drop it for transformers' Trainer",
    "adam-mini": "transformers has no Adam-mini optim: " + _MAKE_OPT,
    "galore": "transformers' galore_adamw keeps each projector as a slice of the whole SVD factor (min(m, n)^2 "
              "floats instead of rank x min(m, n): see colabkit/techniques/galore.py) and projects nn.Linear layers "
              "only: " + _MAKE_OPT,
    "offload:optimizer": "transformers' Trainer builds and steps its own optimizer on the device: use "
                         "colabkit.Trainer(model, plan), or DeepSpeed ZeRO-Offload (TrainingArguments(deepspeed=...))",
    "offload:disk": "transformers' Trainer builds and steps its own optimizer on the device: use colabkit.Trainer(model, plan)",
    "offload:params": "transformers' Trainer moves the whole model to the device: use colabkit.Trainer(model, plan), or "
                      "load the model with accelerate's device_map offload",
    "zero": "transformers' Trainer shards through accelerate (TrainingArguments(fsdp=...), launched by accelerate "
            "or torchrun); colabkit's zero:N runs with colabkit.train(..., world_size=N)",
}
_MODEL_SIDE = ("lora", "qlora", "compress", "attention", "chunked-ce")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("colabkit.hf needs transformers: pip install 'colabkit[hf]'") from e
    return transformers


def _parse(plan: Plan | str) -> Plan:
    """``Plan.parse``, with ``auto`` refused saying how to choose a plan for transformers' Trainer."""
    if isinstance(plan, str) and "auto" in plan.split("+"):
        raise PlanError("plan='auto' picks a plan for colabkit's own loop; for transformers' Trainer choose it first -- "
                        "plan = colabkit.choose_plan(model, batch, seq)['plan'] -- and give that plan to "
                        "colabkit.hf.prepare_model and colabkit.hf.training_arguments")
    return Plan.parse(plan)


def _checkpoint_field() -> str:
    fields = getattr(_transformers().TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def split_plan(plan: Plan | str, device: str | torch.device = "cpu") -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The plan's tokens by where they live with transformers' Trainer: ``({token: TrainingArguments
    keywords}, [model-side tokens])``; a token with no faithful form there is a PlanError.

    >>> split_plan("lora:8+accum:2+compress:int8")
    ({'accum:2': {'gradient_accumulation_steps': 2}}, ['compress:int8', 'lora:8'])
    """
    plan, cuda = _parse(plan), torch.device(device).type == "cuda"
    loop: dict[str, dict[str, Any]] = {}
    model: list[str] = []
    for name, value in plan.values:
        tok = _spelled(plan, name)
        toks = [f"offload:{k}" for k in sorted(value)] if name == "offload" else [tok]
        for t in toks:
            reason = _REFUSED.get(t) or _REFUSED.get(name)
            if reason:
                raise PlanError(f"{t!r}: {reason.format(tok=t)}")
        if name in _MODEL_SIDE or toks == ["offload:activations"] or (name == "checkpoint" and value > 1):
            model.append(tok)
        elif name == "checkpoint":
            key = _checkpoint_field()  # transformers 5.x renamed gradient_ to activation_checkpointing
            loop[tok] = {key: True, f"{key}_kwargs": {"use_reentrant": False}}
        elif name in ("fp16", "bf16"):
            if name == "fp16" and torch.device(device).type == "cpu":  # accelerate: no native fp16 AMP on a CPU
                raise PlanError("'fp16' on the CPU: transformers' Trainer (accelerate) neither autocasts nor scales "
                                "the loss there, so the run would be fp32 with fp16 in its name; use bf16 on the "
                                "CPU, colabkit.Trainer(model, plan) for fp16, or a GPU")
            loop[tok] = {name: True}
        elif name == "accum":
            loop[tok] = {"gradient_accumulation_steps": value}
        elif name in _OPTIM:
            loop[tok] = {"optim": "adamw_torch_fused" if name == "adamw" and cuda else _OPTIM[name]}
            if name == "sgd" and value:
                loop[tok]["optim_args"] = f"momentum={value}"
        else:
            raise PlanError(f"{tok!r} has no transformers Trainer form in colabkit yet: use colabkit.Trainer(model, plan)")
    return loop, model


def loop_arguments(plan: Plan | str, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The ``TrainingArguments`` keywords of a plan's loop-side tokens, colabkit's AdamW when it names
    no optimizer (see :func:`training_arguments`)."""
    plan = _parse(plan)
    out: dict[str, Any] = {}
    for kw in split_plan(plan, device)[0].values():
        out.update(kw)
    if plan.optimizer == "adamw" and "optim" not in out:
        out.update(split_plan("adamw", device)[0]["adamw"])
    return out


def _norm(v: Any) -> Any:
    return getattr(v, "value", v)  # OptimizerNames.ADAMW_TORCH -> "adamw_torch"


def training_arguments(plan: Plan | str = "baseline", device: str | torch.device | None = None, cls: type | None = None,
                       offload_sim: bool = False, **kwargs: Any):
    """``transformers.TrainingArguments(**kwargs)`` with the plan's loop-side tokens in their native form
    (the table in this module's docstring). Model-side tokens are left to :func:`prepare_model`; a
    keyword that contradicts a token, or a token with no faithful form, is a PlanError. ``device`` (default:
    the GPU if there is one, the CPU with ``use_cpu=True``) decides e.g. the fused AdamW and bf16's check;
    ``cls`` is the arguments class (default ``TrainingArguments``; e.g. TRL's ``SFTConfig``, whose defaults -- bf16,
    gradient checkpointing -- give way to the plan); ``offload_sim`` as given to :func:`prepare_model`.

    >>> args = training_arguments("checkpoint+accum:4+adamw8bit", output_dir="out", report_to="none")
    >>> args.gradient_accumulation_steps, args.per_device_train_batch_size, str(args.optim.value)
    (4, 8, 'adamw_bnb_8bit')
    """
    tf = _transformers()
    plan = _parse(plan)
    dev = torch.device(device or ("cpu" if kwargs.get("use_cpu") else default_device()))
    if dev.type == "cpu":  # a CPU run (also where no GPU is): transformers checks bf16 against the GPU unless told
        kwargs.setdefault("use_cpu", True)
    mapped = loop_arguments(plan, dev)  # first: what transformers' Trainer cannot do, then colabkit's own refusals
    plan.check(Context(device=dev, env=env(), offload_sim=offload_sim))  # (bf16 on a T4, paged on a CPU, ...)
    ckpt = _checkpoint_field()
    if ckpt == "activation_checkpointing":  # 5.x: gradient_checkpointing(_kwargs) are aliases, read as the new names
        for old in ("gradient_checkpointing", "gradient_checkpointing_kwargs"):
            new = old.replace("gradient", "activation")
            if old in kwargs and new in kwargs and kwargs[old] != kwargs[new]:
                raise PlanError(f"{old}={kwargs[old]!r} and {new}={kwargs[new]!r} disagree (the first is the "
                                "second's old name): give one")
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
    for key, value in mapped.items():
        if key in kwargs and _norm(kwargs[key]) != value:
            raise PlanError(f"{key}={kwargs[key]!r} contradicts the plan {str(plan)!r}, which sets {key}={value!r}: "
                            "drop the keyword or change the plan")
    accum = kwargs.get("gradient_accumulation_steps")
    if "gradient_accumulation_steps" not in mapped and accum not in (None, 1):
        raise PlanError(f"gradient_accumulation_steps={accum!r} is not in the plan {str(plan)!r}: add 'accum:{accum}' "
                        "to the plan (the plan is what colabkit applies, checks and reports) and drop the keyword")
    for key, tok in (("fp16", "fp16"), ("bf16", "bf16"), (ckpt, "checkpoint")):
        # off unless the plan says so: TRL's SFTConfig defaults bf16 and gradient checkpointing on
        if key not in mapped:
            if kwargs.get(key):
                raise PlanError(f"{key}=True is not in the plan {str(plan)!r}: add {tok!r} to the plan (the plan is "
                                "what colabkit applies, checks and reports) and drop the keyword")
            kwargs[key] = False
    kwargs.setdefault("output_dir", "trainer_output")
    args = (cls or tf.TrainingArguments)(**{**mapped, **kwargs})
    args.colabkit_plan = str(plan)  # what MemoryCallback checks the run against
    if "sgd" in plan and plan.get("sgd"):  # older transformers build SGD without parsing optim_args
        _, opt_kwargs = tf.Trainer.get_optimizer_cls_and_kwargs(args)
        if float(opt_kwargs.get("momentum", 0.0)) != plan.get("sgd"):
            raise PlanError(f"{_spelled(plan, 'sgd')!r}: this transformers ({tf.__version__}) ignores SGD's momentum "
                            "in optim_args: upgrade transformers, or " + _MAKE_OPT.format(tok=_spelled(plan, "sgd")))
    return args


def _mark_adapters(model: torch.nn.Module) -> None:
    """Flag peft adapters injected into a quantized transformers model as transformers' own
    ``model.add_adapter`` does (``_hf_peft_config_loaded``; peft already set ``model.peft_config``): a model
    loaded in 4 bits (``is_quantized``, e.g. :func:`load_hf_4bit`) is otherwise "purely quantized" to
    ``transformers.Trainer``, which refuses to build. ``save_pretrained`` then writes the adapters only,
    in peft's format, as for a model given adapters by ``add_adapter``."""
    if getattr(model, "is_quantized", False) and hasattr(model, "peft_config") and hasattr(model, "active_adapters"):
        model._hf_peft_config_loaded = True


def prepare_model(model: torch.nn.Module, plan: Plan | str, device: str | torch.device | None = None,
                  offload_sim: bool = False) -> torch.nn.Module:
    """Apply the plan's model-side tokens to ``model`` (a transformers model, or any ``nn.Module``) and move
    it to ``device`` (default: the GPU if there is one): lora/qlora through colabkit's LoRA (peft
    adapters, bitsandbytes NF4 base), compress/attention/offload:activations as forward contexts,
    checkpoint:N on every N-th layer. Loop-side tokens are left to :func:`training_arguments`.

    >>> from colabkit.models import build_model, count_params
    >>> m = prepare_model(build_model("gpt-tiny"), "lora:4+accum:2", device="cpu")
    >>> count_params(m, trainable_only=True), m._colabkit_plan
    (8192, 'lora:4+accum:2')
    """
    plan = _parse(plan)
    dev = torch.device(device or default_device())
    ctx = Context(device=dev, env=env(), model=model, offload_sim=offload_sim)
    side = split_plan(plan, dev)[1]
    plan.check(ctx)
    names = {t.partition(":")[0] for t in side}
    for t in plan.techniques():
        if t.prepare_model is not None and t.name in names and t.name != "offload":
            model = t.prepare_model(model, plan, ctx)
    if names & {"lora", "qlora"}:
        _mark_adapters(model)
        _witness_adapters(model, next(t for t in side if t.partition(":")[0] in ("lora", "qlora")))
    if ctx.loss_scaling and "fp16" not in plan:
        raise PlanError(f"on {dev} the plan's lora/qlora base computes in fp16, which needs loss scaling: add fp16 to "
                        "the plan (transformers' Trainer then uses a GradScaler)")
    if "checkpoint" in plan and "checkpoint" not in names:  # the Trainer turns it on: with colabkit's recompute
        for_trainer(model)
    if "checkpoint" in names:
        _witness_checkpoint(model, _spelled(plan, "checkpoint"))
    if "chunked-ce" in names:  # transformers' Trainer gives the labels to the model: it computes the chunked loss
        loss_in_forward(model, plan.get("chunked-ce"))
        _witness_chunked(model, _spelled(plan, "chunked-ce"))
    makers = [("offload:activations" if t.name == "offload" else _spelled(plan, t.name), t.forward_context)
              for t in plan.techniques()
              if t.forward_context is not None and t.name in names and t.name in ("compress", "attention", "offload")]
    if makers:
        _with_contexts(model, makers, plan, ctx)
    if not getattr(model, "_colabkit_placed", False):
        model = model.to(dev)
    model._colabkit_plan = unwrap(model)._colabkit_plan = str(plan)  # a PeftModel keeps its own attributes
    return model


def check_run(args: Any, model: torch.nn.Module) -> None:
    """PlanError unless the model carries the model-side tokens and ``args`` the loop-side tokens of the
    plan given to :func:`training_arguments` and/or :func:`prepare_model` (nothing is dropped silently)."""
    on_args, on_model = getattr(args, "colabkit_plan", None), getattr(unwrap(model), "_colabkit_plan", None)
    applied = Plan.parse(on_model).tokens if on_model is not None else ()
    for text in dict.fromkeys(t for t in (on_args, on_model) if t is not None):
        loop, side = split_plan(text, getattr(args, "device", "cpu"))
        missing = [t for t in side if t not in applied]
        if missing:
            raise PlanError(f"plan token(s) {', '.join(missing)} live on the model: call "
                            f"colabkit.hf.prepare_model(model, {text!r}) before building the Trainer")
        for tok, kws in loop.items():
            for key, value in kws.items():
                if _norm(getattr(args, key, None)) != value:
                    raise PlanError(f"plan token {tok!r} needs TrainingArguments({key}={value!r}), the Trainer has "
                                    f"{key}={getattr(args, key, None)!r}: build them with "
                                    f"colabkit.hf.training_arguments({text!r}, ...)")


def check_measurable(optimizer: Any) -> None:
    """PlanError for an optimizer whose step cannot run under the tracker: torchao's low-bit AdamW (the
    Trainer's ``adamw_torch_4bit``, the ``adamw4bit`` token) compiles its step with ``torch.compile(fullgraph=True)``,
    which fails under the tracker's dispatch mode -- said at the start instead of a compile error mid-step.

    >>> check_measurable(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if type(inner).__module__.startswith("torchao"):
        raise PlanError(f"MemoryCallback cannot measure torchao's {type(inner).__name__} (adamw_torch_4bit): it compiles "
                        "its step with torch.compile(fullgraph=True), which cannot run under the tracker's dispatch "
                        "mode; give the Trainer colabkit's 4-bit AdamW instead -- Trainer(..., optimizers="
                        "(colabkit.make_optimizer(model, 'adamw4bit'), None)) with adamw4bit dropped from "
                        "training_arguments' plan -- or train without MemoryCallback")


def check_one_device(model: torch.nn.Module) -> None:
    """Warn when ``device_map`` split the model over several GPUs: the tracker measures one device (the
    current one), so the figures would leave out the other GPUs' share. colabkit loads on one device
    (:func:`single_device_map`); a model too big for one T4 is a case for ``zero:3``, where each rank measures
    its own GPU.

    >>> import warnings
    >>> m = torch.nn.Linear(1, 1); m.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cuda:1"}
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always"); check_one_device(m)
    >>> "split over 2 GPUs" in str(w[0].message)
    True
    """
    placed = getattr(unwrap(model), "hf_device_map", None) or {}
    gpus = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in placed.values()} - {"cpu", "disk", "meta"}
    gpus = {"cuda:0" if g == "cuda" else g for g in gpus}
    if len(gpus) > 1:
        warn(f"colabkit: the model is split over {len(gpus)} GPUs ({', '.join(sorted(gpus))}, device_map) but "
                      "MemoryCallback measures one: load it on one device (device_map={'': 0}, as "
                      "colabkit.hf.load_hf_4bit does), or shard it with zero:3")


class MemoryCallback:
    """A ``transformers.TrainerCallback`` that measures ``trainer.train()`` with :class:`colabkit.MemoryTracker`.

    Phases: a forward hook on the model labels forward (``eval`` in evaluation) and backward; the
    optimizer step is labelled between ``on_pre_optimizer_step`` and ``on_step_end``. The optimizer the
    Trainer builds is watched from ``on_train_begin``, so its state counts as optimizer state. In a
    notebook the live plot (:class:`colabkit.LivePlot`) is redrawn in place; every training log gets
    ``memory/*`` scalars (the callback moves itself first among the Trainer's callbacks, so the reporters
    -- TensorBoard, W&B, ... -- see them); at the end it prints the tracker's table. ``report()`` gives
    the tracker's report, ``tracker`` the tracker itself. A run that raises leaves the tracker on until the
    next ``train()`` or :meth:`close`. Each batch's token ids and labels are checked before the forward, as
    colabkit's own loop checks them (``check_batches``: :func:`colabkit.batches.check_call`), also in
    ``evaluate()`` after ``train()``.

    >>> trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[MemoryCallback()])  # doctest: +SKIP
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # transformers is imported here, not by `import colabkit`: the instance's class is MemoryCallback
        # with transformers.TrainerCallback as a second base (isinstance works for both).
        base = _transformers().TrainerCallback
        if not issubclass(cls, base):
            cls = _callback_class(cls, base)
        return object.__new__(cls)

    def __init__(self, live_plot: "LivePlot | bool | None" = None, budget_bytes: int | None = None,
                 print_table: bool = True, alert_at: float | None = 0.9, check_batches: bool = True):
        self.check_batches = check_batches
        self.live_plot = LivePlot(budget_bytes=budget_bytes) if live_plot in (None, True) else (live_plot or None)
        self.budget_bytes, self.print_table, self.alert_at = budget_bytes, print_table, alert_at
        self.tracker: MemoryTracker | None = None
        self._phase: Any = None  # the open phase context
        self._hooks: list[Any] = []
        self._optimizer: Any = None
        self._pending: dict[str, float] = {}
        self._step = 0
        self._report: dict[str, Any] | None = None
        self._verify: Any = None

    # ----- the Trainer's events --------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._go_first()
        if model is not None:  # adapters added on top of the plan's at construction (TRL's peft_config)
            check_adapters(model, dtypes=False)
            self._watch_batches(model)
        if getattr(args, _checkpoint_field(), False) and model is not None and not any(
                hasattr(model, n) for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable")):
            raise PlanError(f"the arguments turn checkpointing on, which transformers' Trainer asks of the model "
                            f"(activation_checkpointing_enable), and {type(unwrap(model)).__name__} has no such method: "
                            "call colabkit.hf.prepare_model(model, plan) first -- it checkpoints the model's blocks")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._go_first()
        self.close()  # a tracker left on by a run that raised
        check_run(args, model)
        check_one_device(model)
        check_measurable(optimizer)
        check_adapters(model)
        self.tracker = MemoryTracker(model, optimizer, budget_bytes=self.budget_bytes, alert_at=self.alert_at,
                                     on_sample=self.live_plot.update if self.live_plot is not None else None)
        self._optimizer = optimizer
        self.tracker.__enter__()
        self._step = state.global_step
        self.tracker.set_step(self._step)
        self._hooks = [model.register_forward_pre_hook(self._before_forward),
                       model.register_forward_hook(self._after_forward)]
        self._watch_batches(model)
        self._verify = model  # the model-side tokens are checked after the first training forward
        getattr(unwrap(model), "_colabkit_ran", {}).clear()

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self._switch(None)
        if self.tracker is None:  # added after train() began: nothing to measure until the next train()
            return
        if optimizer is not None and optimizer is not self._optimizer:  # built or re-wrapped after train begin
            self._optimizer = optimizer
            self.tracker.watch(optimizer=optimizer)
        self._step = state.global_step

    def on_substep_end(self, args, state, control, **kwargs):
        self._switch(None)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._switch("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self._switch(None)
        self._pending = memory_metrics(self.tracker, state.global_step - 1) if self.tracker is not None else {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None and "loss" in logs:
            logs.update(self._pending)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        if self._report is not None and self.print_table:
            print(format_report(self._report))

    # ----- results -------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The tracker's report: peak, each category's own peak, the categories at the peak, per phase."""
        if self._report is not None:
            return self._report
        if self.tracker is None:
            raise RuntimeError("MemoryCallback has measured nothing yet: pass it to a Trainer and call train()")
        return self.tracker.report()

    def close(self) -> None:
        """End the measurement (called at the end of training): remove the hooks, stop the tracker."""
        if self.tracker is None:
            return
        self._switch(None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.tracker.__exit__(None, None, None)
        self._report = self.tracker.report()
        if self.live_plot is not None:
            self.live_plot.close()
        self.tracker = None

    # ----- phases ----------------------------------------------------------------------------------
    def _switch(self, name: str | None) -> None:
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        if name is not None and self.tracker is not None:
            self._phase = self.tracker.phase(name, self._step)
            self._phase.__enter__()

    def _before_forward(self, module, args):
        self._switch("forward" if module.training else "eval")

    def _watch_batches(self, model: torch.nn.Module) -> None:
        """The batch check on ``model`` from the Trainer's construction on, for as long as the model lives: also
        ``trainer.evaluate()`` and ``predict()`` after ``train()`` (the measurement's hooks end with the run)."""
        if self.check_batches and not getattr(model, "_colabkit_batch_check", False):
            model.register_forward_pre_hook(self._check_batch, with_kwargs=True)
            model._colabkit_batch_check = True

    def _check_batch(self, module, args, kwargs):
        """Each batch's token ids and labels checked before the forward (:func:`colabkit.batches.check_call`): on a
        GPU an id past the embedding's or the head's rows is a device-side assert, after which the session's CUDA
        context is lost (the model with it). Costs one device sync a forward; ``check_batches=False`` skips it."""
        try:
            check_call(module, args, kwargs)
        except PlanError:
            self.close()  # the tracker's dispatch mode and hooks end with the run (nothing to end outside one)
            raise

    def _after_forward(self, module, args, output):
        if module.training and torch.is_grad_enabled() and self._verify is not None:
            self._verify = None
            try:
                check_ran(module)  # before any backward or optimizer step: the run stops with the reason
            except PlanError:
                self.close()  # the tracker's dispatch mode and hooks end with the run, not in the next cell
                raise
        if module.training and torch.is_grad_enabled():
            self._switch("backward")  # the loss is computed inside transformers' forward; backward follows

    def _go_first(self) -> None:
        """Move this callback to the front of the Trainer's callback list (the ``CallbackHandler`` calling
        this event), so that its ``on_log`` adds the memory scalars before the reporters send the log."""
        frame = sys._getframe(1)
        for _ in range(4):
            frame = frame.f_back
            if frame is None:
                break
            handler = frame.f_locals.get("self")
            callbacks = getattr(handler, "callbacks", None)
            if isinstance(callbacks, list) and any(c is self for c in callbacks):
                callbacks.remove(self)
                callbacks.insert(0, self)
                return
        warn("colabkit: MemoryCallback could not find the Trainer's callback list: memory/* scalars reach "
             "state.log_history and the callbacks after it only")


@functools.lru_cache(maxsize=None)
def _callback_class(cls: type, base: type) -> type:
    return type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__})

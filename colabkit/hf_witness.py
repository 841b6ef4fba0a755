"""Model-side plan tokens where the trainer's path goes, and proof that they ran.

:func:`colabkit.hf.prepare_model` puts the forward contexts (compress, attention, offload:activations) around
``model.forward`` and around the backbone's (``model.base_model``): TRL's fused LM head (``SFTTrainer``,
``DPOTrainer``, ...) calls the backbone and the head's weight itself, around ``model.forward``. Each token's
running is counted -- its context entered, its adapter's or checkpointed layer's call, its chunked loss computed --
and :func:`check_ran` (which :class:`colabkit.hf.MemoryCallback` calls after the first training forward) stops
the run naming each token that did not run, and why.

>>> from colabkit.models import build_model
>>> from colabkit.hf import prepare_model
>>> m = prepare_model(build_model("gpt-tiny"), "compress:int8", device="cpu")
>>> _ = m(torch.zeros(1, 8, dtype=torch.long)); m._colabkit_ran
{'compress:int8': 1}
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .batches import unwrap
from .plan import REGISTRY, Context, Plan, PlanError
from .techniques import lora as _lora
from .techniques.attention import NO_SDPA
from .techniques.chunked_ce import ChunkedLogits


def _spelled(plan: Plan, name: str) -> str:
    return next((t for t in plan.tokens if t == name or t.startswith(name + ":")), name)


def _ran(model: torch.nn.Module) -> dict[str, int]:
    """``{token: times it ran}`` for the model-side tokens :func:`prepare_model` can witness (their forward
    context entered, their hook fired, their loss computed); :class:`MemoryCallback` checks it at the first
    training step."""
    model = unwrap(model)  # a peft PeftModel: the transformers model under it, where check_ran looks
    if "_colabkit_ran" not in model.__dict__:
        model._colabkit_ran, model._colabkit_witnessed = {}, set()
    return model._colabkit_ran


def _witness(model: torch.nn.Module, tok: str) -> dict[str, int]:
    """Register ``tok`` as one whose running is counted (and checked by :func:`check_ran`); the counts."""
    ran = _ran(model)
    unwrap(model)._colabkit_witnessed.add(tok)
    return ran


def _with_contexts(model: torch.nn.Module, makers: list, plan: Plan, ctx: Context) -> None:
    """Run ``model.forward`` inside the techniques' forward contexts (saved-tensor hooks, SDPA backend): what
    is saved for backward in the forward -- the loss included, which transformers computes inside -- is
    packed; backward unpacks it wherever it runs. The backbone (``model.base_model``) gets the same contexts
    for callers that go around ``model.forward`` -- TRL's fused LM head calls the backbone itself -- entered
    once: not again inside the model's own forward. ``makers``: ``[(token, make)]``; each entry is counted
    in :func:`_ran`."""
    ran = _ran(model)
    for tok, _ in makers:
        _witness(model, tok)
    entered = unwrap(model).__dict__.setdefault("_colabkit_entered", set())  # contexts entered, acting or not
    model._colabkit_inside = False

    def wrap(module: torch.nn.Module) -> None:
        inner = module.forward

        @functools.wraps(inner)  # keeps the signature transformers inspects (labels, loss kwargs)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if model._colabkit_inside:  # the backbone inside the model's own forward: entered already
                return inner(*args, **kwargs)
            with contextlib.ExitStack() as stack:
                for tok, make in makers:
                    stack.enter_context(make(plan, ctx))
                    witness = REGISTRY[tok.partition(":")[0]].witness
                    if witness is not None and not ran.get(tok):  # until it acted (attention:*: an SDPA call ran)
                        entered.add(tok)
                        context, why = witness(plan, ctx)
                        stack.enter_context(context)
                        stack.callback(lambda t=tok, why=why: why() is None and ran.__setitem__(t, ran.get(t, 0) + 1))
                    else:
                        ran[tok] = ran.get(tok, 0) + 1
                model._colabkit_inside = True
                try:
                    return inner(*args, **kwargs)
                finally:
                    model._colabkit_inside = False

        module.forward = forward

    wrap(model)
    backbone = getattr(unwrap(model), "base_model", model)  # under a PeftModel: the transformers model's backbone
    if isinstance(backbone, torch.nn.Module) and backbone is not model and backbone is not unwrap(model):
        wrap(backbone)


def _witness_chunked(model: torch.nn.Module, tok: str) -> None:
    """Count the forwards whose loss colabkit's chunked cross-entropy computed (logits left as ChunkedLogits)."""
    inner, ran = model.forward, _witness(model, tok)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if isinstance(getattr(out, "logits", None), ChunkedLogits):
            ran[tok] = ran.get(tok, 0) + 1
        return out

    model.forward = forward


def _witness_adapters(model: torch.nn.Module, tok: str) -> None:
    """Count the forwards of the first LoRA layer (a forward hook)."""
    layer = next((m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")), None)
    if layer is not None:
        ran = _witness(model, tok)
        layer.register_forward_hook(lambda *_: ran.__setitem__(tok, ran.get(tok, 0) + 1))


def _witness_checkpoint(model: torch.nn.Module, tok: str) -> None:
    """Count the checkpointed calls of transformers' checkpointing layers (their ``_gradient_checkpointing_func``,
    set by ``gradient_checkpointing_enable`` on every N-th layer)."""
    top = unwrap(model)
    layers = [m for m in top.modules() if getattr(m, "gradient_checkpointing", False) is True
              and callable(getattr(m, "_gradient_checkpointing_func", None)) and m is not getattr(top, "base_model", None)]
    if not layers:
        return
    ran = _witness(model, tok)
    for layer in layers:
        def counted(*args: Any, _inner=layer._gradient_checkpointing_func, **kwargs: Any) -> Any:
            ran[tok] = ran.get(tok, 0) + 1
            return _inner(*args, **kwargs)
        layer._gradient_checkpointing_func = counted


_FUSED_HEAD = ("TRL's fused LM head (SFTTrainer, DPOTrainer, ...) calls the backbone and scores the tokens from the "
               "head's weight itself (logits in chunks of 32768 token rows), around model.forward")
_HOW = {"chunked-ce": "colabkit's chunked cross-entropy never computed the loss",
        "attention": NO_SDPA,
        "checkpoint": "no checkpointed layer ran",
        "lora": "no LoRA adapter ran", "qlora": "no LoRA adapter ran"}


def _trl_fused(model: torch.nn.Module) -> bool:
    """True when TRL's ``add_fused_lm_head`` replaced ``model.forward`` (its code object keeps its name), also
    under accelerate's mixed-precision wrappers (autocast, outputs to fp32: ``__wrapped__`` chains)."""
    fn, seen = getattr(model, "forward", None), set()
    while fn is not None and id(fn) not in seen:  # each link: the bound method's function, then what it wraps
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            return True
        fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return False


def check_ran(model: torch.nn.Module) -> None:
    """PlanError naming each model-side token of :func:`colabkit.hf.prepare_model` that did not run in the forward just
    done (its forward context never entered, its hook never fired, its loss never computed), and why where
    known: nothing applied is dropped silently. :class:`colabkit.hf.MemoryCallback` calls it after the first training
    forward, before any backward or optimizer step.

    >>> from colabkit.models import build_model
    >>> from colabkit.hf import prepare_model
    >>> m = prepare_model(build_model("gpt-tiny"), "compress:int8", device="cpu")
    >>> m._colabkit_ran
    {}
    >>> check_ran(m)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: plan token 'compress:int8' did not run in the first training step (its forward context was never entered): the model was called around model.forward, where colabkit.hf.prepare_model applied it; call the model itself, or drop 'compress:int8' from the plan
    """
    model = unwrap(model)
    ran, witnessed = getattr(model, "_colabkit_ran", None), getattr(model, "_colabkit_witnessed", ())
    if ran is None:
        return
    missing = [t for t in sorted(witnessed) if not ran.get(t)]
    if not missing:
        return
    fused = _trl_fused(model)
    why = []
    for t in missing:
        how = _HOW.get(t.partition(":")[0], "its forward context was never entered")
        if fused:
            fix = ("drop it for TRL's trainers (their fused head computes the logits in chunks itself), or train "
                   "with transformers.Trainer" if t.startswith("chunked-ce") else f"drop {t!r} from the plan")
            why.append(f"plan token {t!r} did not run in the first training step ({how}): {_FUSED_HEAD}; {fix}")
        elif t in getattr(model, "_colabkit_entered", ()):  # entered, and its witness saw it not act
            why.append(f"plan token {t!r} did not run in the first training step ({how}); drop {t!r} from the plan")
        elif t.startswith("chunked-ce"):
            why.append(f"plan token {t!r} did not run in the first training step ({how}): the model was called "
                       "without labels (a compute_loss_func or label smoothing computes the loss from the full logits) "
                       f"or around model.forward; let the model compute the loss from its labels, or drop {t!r}")
        else:
            why.append(f"plan token {t!r} did not run in the first training step ({how}): the model was called around "
                       f"model.forward, where colabkit.hf.prepare_model applied it; call the model itself, or drop "
                       f"{t!r} from the plan")
    raise PlanError("; ".join(why))


def check_adapters(model: torch.nn.Module, dtypes: bool = True) -> None:
    """PlanError when the LoRA adapters of a lora/qlora plan no longer train in fp32 (colabkit's LoRA keeps them
    in fp32 whatever the base's dtype, and its estimates count them so): TRL's SFTTrainer casts the trainable
    parameters of a 4-bit model (``is_loaded_in_4bit``) to bf16 at construction, following the QLoRA paper
    (``dtypes``: checked at the start of training, after the user's chance to cast them back). Also when
    adapters were added on top of the plan's (TRL's ``peft_config``: checked at the Trainer's construction).

    >>> check_adapters(torch.nn.Linear(2, 2))  # no colabkit plan: nothing to check
    """
    top = unwrap(model)
    plan = getattr(top, "_colabkit_plan", None)
    if plan is None or not ({"lora", "qlora"} & {t.partition(":")[0] for t in plan.split("+")}):
        return
    made = (getattr(model, "_colabkit_lora", None) or {}).get("adapters")
    now = _lora.adapter_shapes(model)
    if made is not None and now != made:  # TRL's peft_config (get_peft_model on top), or the user's own
        def say(shapes: list) -> str:
            return ", ".join(sorted({f"{a} rank {r} scale {s:g}" for layer in shapes for a, r, s in layer}))
        raise PlanError(f"the plan's {plan!r} put LoRA adapters on {len(made)} layers ({say(made)}); the model now has "
                        f"{len(now)} LoRA layers ({say(now)}): another LoRA config was applied over colabkit's -- TRL's "
                        "SFTTrainer(peft_config=...) or peft's get_peft_model -- and would train a mix of both. Use one: "
                        "drop peft_config (the plan's lora:R is the adapter colabkit measures and estimates), or drop "
                        "lora:R/qlora:R from the plan and let peft add yours")
    if not dtypes:  # at the Trainer's construction: TRL's cast has a fix the user applies after it
        return
    cast = sorted({str(p.dtype) for n, p in top.named_parameters() if p.requires_grad and "lora_" in n} - {"torch.float32"})
    if cast:
        raise PlanError(f"the LoRA adapters of {plan!r} train in {', '.join(cast)}, not fp32 (TRL's SFTTrainer casts the "
                        "trainable parameters of a 4-bit model to bf16): cast them back after building the trainer -- "
                        "for p in model.parameters(): p.data = p.data.float() if p.requires_grad else p.data -- or "
                        "train with transformers.Trainer")

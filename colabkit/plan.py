"""The Plan: a set of technique tokens joined by ``+`` (``fp16+checkpoint+adamw8bit+accum:4``),
parsed against a registry that technique modules fill, validated as a whole before anything runs.

Each technique is a value in the plan (``plan.get("accum", 1)``) plus the registry entry that knows
how to apply it: transform the model, give a context for the forward pass, build or wrap the
optimizer. Conflicts are refused with a message that names them and says what to use instead.

>>> p = Plan.parse("baseline")
>>> str(p), p.get("accum", 1), p.optimizer
('baseline', 1, 'adamw')
>>> Plan.parse("adamw+adamw")
Traceback (most recent call last):
...
colabkit.plan.PlanError: 'adamw' appears twice in the plan: keep one
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

Hook = Callable[..., Any]


class PlanError(ValueError):
    """A plan that cannot run as asked; the message says why and what to use instead."""


def plain_words(reason: str) -> str:
    """A plan check's reason in a learner's words: a GPU generation as its compute capability
    ("sm75" -> "compute capability 7.5"), no mention of colabkit's T4 emulation (the check asks as a T4).

    >>> plain_words("bf16: T4 emulation is on and a T4 (sm75) has no native bf16; use fp16")
    'bf16: a T4 (compute capability 7.5) has no native bf16; use fp16'
    >>> plain_words("attention:flash needs sm80+; a T4 (T4 emulation is on) (sm75) has math")
    'attention:flash needs compute capability 8.0+; a T4 (compute capability 7.5) has math'
    """
    reason = reason.replace("T4 emulation is on and a T4", "a T4").replace(" (T4 emulation is on)", "")
    return re.sub(r"\bsm(\d)(\d)\b", r"compute capability \1.\2", reason)


@dataclass
class Context:
    """What a technique may need to know about the run it is applied to."""

    device: torch.device
    env: dict[str, Any] = field(default_factory=dict)
    model_name: str | None = None
    lr: float = 3e-4
    weight_decay: float = 0.1
    max_grad_norm: float | None = None
    model: Any = None  # the model being trained, once built (optimizers that need names, e.g. adam-mini)
    offload_sim: bool = False  # offload tokens on a CPU run: simulated host side (techniques/offload.py)
    # Set by techniques that compute in fp16 (fp16; lora/qlora on a GPU without bf16): the Trainer's
    # GradScaler is enabled by this value, so small gradients do not underflow in fp16.
    loss_scaling: bool = False
    # Set by a technique that computes the loss from the LM head's input itself (the token, e.g. chunked-ce):
    # the Trainer then keeps the labels from the model (it would compute its own loss from full logits).
    loss_from_head: str | None = None
    # make_scaler(device_type, enabled) -> the loss scaler, when a technique needs another kind than
    # torch.amp.GradScaler (zero:2/3 + fp16: gradients are DTensor shards, found-inf agreed across ranks)
    make_scaler: Callable[[str, bool], Any] | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def flag(arg: str | None) -> bool:
    if arg is not None:
        raise PlanError(f"this token takes no argument (got ':{arg}')")
    return True


def check_batch(plan: "Plan", batch: int, world_size: int = 1) -> None:
    """PlanError for a batch or world size ``plan`` cannot run with, as every command refuses it (train, bench,
    measure, estimate): accum:K must divide the batch; several ranks need a zero:N token.

    >>> check_batch(Plan.parse("accum:3"), 4)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: accum:3 does not divide batch 4: micro-batches would differ in size; use a batch that is a multiple of 3 (e.g. 3) or accum:K with K dividing 4
    """
    k = plan.get("accum", 1)
    if 0 < batch < k:
        raise PlanError(f"accum:{k} needs at least {k} sequences per step, got batch {batch}: "
                        f"use accum:{batch} or less, or a larger batch")
    if batch % k:
        raise PlanError(f"accum:{k} does not divide batch {batch}: micro-batches would differ in size; "
                        f"use a batch that is a multiple of {k} (e.g. {k * max(1, batch // k)}) or accum:K with K "
                        f"dividing {batch}")
    if world_size > 1 and "zero" not in plan:
        raise PlanError(f"plan {str(plan)!r} has no zero:N token: on several ranks each would train its own copy; "
                        "add zero:1, zero:2 or zero:3, or run it without --world-size")


def positive_int(arg: str | None, default: int | None = None) -> int:
    if arg is None:
        if default is None:
            raise PlanError("this token needs a number, e.g. ':4'")
        return default
    if not arg.isdigit() or int(arg) < 1:
        raise PlanError(f"':{arg}' is not a positive whole number")
    return int(arg)


@dataclass
class Technique:
    """A registry entry. Tokens are ``name`` or ``name:arg``; ``parse(arg)`` gives the plan's value.

    Hooks (all optional), called in ``order``:
      check(plan, ctx)                        raise PlanError for what cannot work here
      prepare_model(model, plan, ctx) -> model   order < 50 runs before the model moves to the device
      forward_context(plan, ctx) -> context manager around each forward + loss
      make_optimizer(param_groups, plan, ctx) -> optimizer   (techniques in group "optimizer")
      wrap_optimizer(optimizer, model, plan, ctx) -> optimizer-like (step/zero_grad/state_dict)
      load_model(name, plan, ctx, seq) -> model, or None to build it normally (e.g. qlora loading a
          hub model straight into 4-bit, so the 16-bit weights never exist)
      witness(plan, ctx) -> (context, why): the context around the first training forward, and why()
          afterwards: None when the technique acted, else the reason it did not (nothing dropped silently)
    """

    name: str
    help: str
    parse: Callable[[str | None], Any] = flag
    group: str | None = None
    multi: bool = False  # may repeat with different args (offload:optimizer+offload:activations)
    examples: tuple[str, ...] = ()
    check: Hook | None = None
    prepare_model: Hook | None = None
    forward_context: Hook | None = None
    make_optimizer: Hook | None = None
    wrap_optimizer: Hook | None = None
    load_model: Hook | None = None
    witness: Hook | None = None
    # places_model(plan): True when prepare_model puts the model on the device itself (FSDP2 shards it
    # there block by block), so the Trainer does not move the whole model first
    places_model: Callable[[Any], bool] | None = None
    order: int = 60

    def tokens(self) -> tuple[str, ...]:
        return self.examples or (self.name,)


REGISTRY: dict[str, Technique] = {}


def register(technique: Technique) -> Technique:
    """Add (or replace) a technique in the plan vocabulary."""
    REGISTRY[technique.name] = technique
    return technique


@dataclass(frozen=True)
class Plan:
    """A parsed plan: ``values`` maps technique name -> value, ``tokens`` keeps the user's spelling."""

    values: tuple[tuple[str, Any], ...] = ()
    tokens: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: "str | Plan | Iterable[str]") -> "Plan":
        if isinstance(text, Plan):
            return text
        parts = [t.strip() for t in (text.split("+") if isinstance(text, str) else text)]
        parts = [t for t in parts if t]
        if parts == ["baseline"] or not parts:
            return cls()
        if "baseline" in parts:
            raise PlanError("'baseline' means no technique: use it alone, or list only the techniques")
        values: dict[str, Any] = {}
        groups: dict[str, str] = {}
        for tok in parts:
            name, _, arg = tok.partition(":")
            tech = REGISTRY.get(tok) or REGISTRY.get(name)  # an exact token (offload:disk) before its family
            if tech is None:
                known = sorted(t for tq in REGISTRY.values() for t in tq.tokens())
                close = difflib.get_close_matches(tok, known, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise PlanError(f"unknown plan token {tok!r}.{hint} Known tokens: {', '.join(known)}")
            if tech is REGISTRY.get(tok):
                name, arg = tok, ""
            try:
                value = tech.parse(arg if arg != "" else None)
            except PlanError as e:
                raise PlanError(f"{tok!r}: {e}") from None
            if tech.multi:
                values[name] = frozenset(values.get(name, frozenset()) | {value})
            elif name in values:
                raise PlanError(f"{name!r} appears twice in the plan: keep one")
            else:
                values[name] = value
            if tech.group:
                if tech.group in groups and groups[tech.group] != name:
                    raise PlanError(f"{groups[tech.group]!r} and {tok!r} both choose the {tech.group}: keep one")
                groups[tech.group] = name
        return cls(tuple(sorted(values.items())), tuple(parts))

    def __str__(self) -> str:
        return "+".join(self.tokens) or "baseline"

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.values).get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in dict(self.values)

    def with_tokens(self, *tokens: str) -> "Plan":
        """This plan plus more tokens (validated). >>> str(Plan().with_tokens("sgd"))
        'sgd'"""
        return Plan.parse(list(self.tokens) + list(tokens))

    @property
    def optimizer(self) -> str:
        """The optimizer token in the plan, ``adamw`` when none is named."""
        for name, _ in self.values:
            if REGISTRY[name].group == "optimizer":
                return name
        return "adamw"

    @property
    def optimizer_token(self) -> str:
        """The optimizer as spelled, with its argument (``sgd:0.9``); ``adamw`` when none is named."""
        return next((t for t in self.tokens if t.partition(":")[0] == self.optimizer), self.optimizer)

    def techniques(self) -> list[Technique]:
        """Registry entries of this plan (the default optimizer included), in application order."""
        names = {n for n, _ in self.values} | {self.optimizer}
        return sorted((REGISTRY[n] for n in names), key=lambda t: (t.order, t.name))

    def check(self, ctx: Context) -> None:
        """Raise PlanError if any technique cannot run with the others on this device."""
        for t in self.techniques():
            if t.check is not None:
                t.check(self, ctx)


def available_tokens() -> list[tuple[str, str]]:
    """Every concrete token and its help line, for menus and widgets."""
    return [(tok, t.help) for t in sorted(REGISTRY.values(), key=lambda t: (t.order, t.name)) for tok in t.tokens()]


def compatible(plan: Plan | str, token: str, ctx: Context | None = None) -> str | None:
    """None if ``token`` can be added to ``plan`` (on ``ctx``'s device), else the reason it cannot."""
    try:
        p = Plan.parse(plan).with_tokens(token)
        if ctx is not None:
            p.check(ctx)
    except PlanError as e:
        return str(e)
    return None


# ----- the baseline optimizer: torch AdamW (more optimizers live in techniques/optimizers.py) -----
def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: matrices decay, norms/biases/1-D tensors do not."""
    seen: set[int] = set()
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _adamw(groups: list[dict], plan: "Plan", ctx: Context) -> torch.optim.Optimizer:
    """torch AdamW with ``fused=True`` wherever torch has the fused kernel for the parameters' device
    (CUDA, and the CPU since torch 2.4): one kernel updates each tensor in place, ~4.5x faster than
    the single-tensor loop on a CPU (30M parameters, benchmarks/peers.py), and without the copy of
    every ``exp_avg_sq`` that torch's CUDA default (``foreach``) makes at the step's peak (+4 B/param;
    see colabkit/estimate/overheads.py). Elsewhere torch's default."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    ps = [p for g in groups for p in g["params"]]
    fused = bool(ps) and all(p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices()
                             for p in ps)
    return torch.optim.AdamW(groups, lr=ctx.lr, fused=True if fused else None)


register(Technique(
    name="adamw",
    help="torch AdamW, fp32 state: 8 bytes per parameter (the baseline optimizer; torch's fused kernel)",
    group="optimizer",
    make_optimizer=_adamw,
    order=40,
))

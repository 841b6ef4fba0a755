"""Activation (gradient) checkpointing: ``checkpoint`` and ``checkpoint:N``.

A checkpointed block keeps only its input for backward and runs its forward again during backward
to rebuild what it needs, so its activations never wait for backward: about one extra forward per
step (~+30% step time) for a block's activations (often 10-20x its input) freed. ``checkpoint:N``
checkpoints every N-th block (blocks 0, N, 2N, ...), trading part of the saving back for speed.

GPT-style models (anything :func:`colabkit.models.blocks_of` finds) get non-reentrant
``torch.utils.checkpoint`` around each chosen block's forward with ``preserve_rng_state=True``, so
dropout in the recompute draws the same mask. Hugging Face models use their own
``activation_checkpointing_enable(every_n_layers=N)`` (``gradient_checkpointing_enable`` on older
transformers, where only ``checkpoint`` without ``:N`` is accepted).

>>> from colabkit.models import build_model
>>> model = build_model("gpt:4x64")
>>> checkpoint_blocks(model, every=2)
[0, 2]
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..models import blocks_of
from ..plan import PlanError, Technique, positive_int, register


# ----- the recompute context: what a block recomputed in backward must run under again -----------
# Factories of the forward contexts a recompute must re-enter (attention:* pushes its SDPA backend):
# backward runs after the Trainer's forward contexts have exited, so without them a checkpointed or
# streamed block would be recomputed with torch's default backend (other saved shapes: CheckpointError).
_RECOMPUTE: contextvars.ContextVar[tuple[Callable[[], ContextManager], ...]] = contextvars.ContextVar(
    "colabkit_recompute", default=())


@contextlib.contextmanager
def recomputed_with(factory: Callable[[], ContextManager]):
    """Inside this context, any block recomputed in backward (``checkpoint``, ``offload:params``' streamed
    blocks, Hugging Face's checkpointing) runs its recompute under a fresh ``factory()`` too.

    >>> with recomputed_with(contextlib.nullcontext):
    ...     len(recompute_context().factories)
    1
    """
    token = _RECOMPUTE.set(_RECOMPUTE.get() + (factory,))
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


class recompute_context:  # noqa: N801 (used like a context-manager function)
    """Captured when the block runs forward; entered around its recompute in backward: every context
    registered by :func:`recomputed_with` at capture time, entered again (fresh) in the same order.

    >>> with recompute_context():  # nothing registered: changes nothing
    ...     pass
    """

    def __init__(self) -> None:
        self.factories = _RECOMPUTE.get()

    def __enter__(self) -> "recompute_context":
        self._stack = contextlib.ExitStack()
        for make in self.factories:
            self._stack.enter_context(make())
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._stack.__exit__(*exc)


def _context_fn() -> tuple[ContextManager, ContextManager]:
    # torch.utils.checkpoint's context_fn, called at forward time: (forward context, recompute context)
    return contextlib.nullcontext(), recompute_context()


def _is_hf(model: torch.nn.Module) -> bool:
    return hasattr(model, "gradient_checkpointing_enable") and hasattr(model, "config")


def _checkpointed_forward(forward, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with kwargs, with inputs that do not require grad, and nests with
    # saved_tensors_hooks (compress:int8); the RNG state is replayed so dropout masks match.
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    return _checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_context_fn, **kwargs)


def checkpoint_blocks(model: torch.nn.Module, every: int = 1, count: int | None = None) -> list[int]:
    """Checkpoint every ``every``-th transformer block of ``model`` in place (at most ``count`` of
    them, from the first) and return the indices. Idempotent: a block is wrapped once.

    >>> from colabkit.models import build_model
    >>> checkpoint_blocks(build_model("gpt:3x64"))
    [0, 1, 2]
    """
    blocks = blocks_of(model)
    chosen = [i for i in range(len(blocks)) if i % every == 0]
    if count is not None:
        chosen = chosen[:count]
    for i in chosen:
        block = blocks[i]
        if getattr(block, "_colabkit_checkpointed", False):
            continue
        # an instance attribute shadows the class forward; module hooks stay outside the checkpoint
        block.forward = functools.partial(_checkpointed_forward, block.forward)
        block._colabkit_checkpointed = True
    return chosen


def saved_bytes(module: torch.nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes autograd keeps for backward after one forward of ``module`` (unique storages, parameters
    excluded): what checkpointing that module frees, less its input.

    >>> lin = torch.nn.Linear(64, 64)
    >>> saved_bytes(lin, torch.randn(8, 64, requires_grad=True))  # the (8, 64) fp32 input
    2048
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    del out
    return sum(seen.values())


def _hf_checkpoint(model: torch.nn.Module, every: int) -> torch.nn.Module:
    kwargs = {"use_reentrant": False, "preserve_rng_state": True, "context_fn": _context_fn}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "every_n_layers" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    elif every == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise PlanError(f"checkpoint:{every} needs transformers with activation_checkpointing_enable(every_n_layers=...) "
                        "(this version checkpoints all layers or none): use 'checkpoint', or upgrade transformers")
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache is pointless in training and clashes with recompute
    return model


def for_trainer(model: torch.nn.Module) -> None:
    """Ready ``model`` for the checkpointing that transformers' Trainer turns on itself (``checkpoint`` is its
    ``activation_checkpointing=True``). A transformers model's enabling call gets colabkit's recompute context
    (``context_fn``): a block recomputed in backward re-enters the forward's contexts -- attention:*'s SDPA
    backend; without it the recompute runs torch's default kernel, saves other shapes, and torch raises
    CheckpointError. Any other module has its blocks checkpointed here, and gets the enabling call the
    Trainer makes (a no-op: they are already checkpointed) instead of an AttributeError.

    >>> from colabkit.models import build_model
    >>> m = build_model("gpt:2x32"); for_trainer(m)
    >>> m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    >>> [getattr(b, "_colabkit_checkpointed", False) for b in m.blocks]
    [True, True]
    """
    top = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if _is_hf(top) and getattr(top, "supports_gradient_checkpointing", False):
        name = "activation_checkpointing_enable" if hasattr(top, "activation_checkpointing_enable") \
            else "gradient_checkpointing_enable"  # (transformers < 5)
        key, real = name.replace("_enable", "_kwargs"), getattr(top, name)

        @functools.wraps(real)
        def enable(*args: Any, **kwargs: Any) -> Any:
            kw = dict((args[0] if args else kwargs.pop(key, None)) or {"use_reentrant": False})
            kw.setdefault("context_fn", _context_fn)
            return real(*args[1:], **{key: kw}, **kwargs)
        setattr(top, name, enable)
        return
    try:
        checkpoint_blocks(top, every=1)
    except ValueError as e:
        raise PlanError(f"checkpoint: {e}; give the model a ModuleList of blocks (model.blocks) "
                        "or call colabkit.checkpoint_blocks on your own module list") from None
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        setattr(top, name, lambda *args, **kwargs: None)


def _prepare(model: torch.nn.Module, plan, ctx) -> torch.nn.Module:
    every = plan.get("checkpoint")
    if _is_hf(model) and getattr(model, "supports_gradient_checkpointing", False):
        return _hf_checkpoint(model, every)
    try:
        checkpoint_blocks(model, every=every)
    except ValueError as e:
        raise PlanError(f"checkpoint: {e}; give the model a ModuleList of blocks (model.blocks) "
                        "or call colabkit.checkpoint_blocks on your own module list") from None
    return model


def _check(plan, ctx) -> None:
    every = plan.get("checkpoint")
    if every < 1:
        raise PlanError(f"checkpoint:{every}: N must be at least 1 (every N-th block)")


register(Technique(
    name="checkpoint",
    help="recompute each block's activations in backward: ~+1 forward of time for most activation memory; "
         "checkpoint:N does every N-th block",
    parse=lambda arg: positive_int(arg, default=1),
    check=_check,
    prepare_model=_prepare,
    examples=("checkpoint", "checkpoint:2"),
    order=55,
))

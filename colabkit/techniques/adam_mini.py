"""``adam-mini``: Adam with one second-moment value per block instead of per parameter (Zhang et al.
2024, "Adam-mini: Use Fewer Learning Rates To Gain More"), from the authors' ``adam-mini`` package.

The package partitions parameters by name: one ``v`` per attention head for queries and keys, per
output neuron for values, projections and MLPs, per token for embeddings and the output layer, one
for each norm; biases keep Adam. Our GPT fuses q, k and v into ``attn.qkv`` and names its MLP
``fc``/``fc_proj``, so those names are added to the package's lists (qkv is partitioned per head,
the MLP per neuron). State: the first moment (4 B per parameter) plus a few values per block — about
half of AdamW's 8 B.

>>> state_bytes_per_param("adam-mini")
4.0
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ..plan import Context, Plan, PlanError, Technique, register, flag
from .optimizers import STATE_FORMULAS, state_bytes_per_param

INSTALL = 'pip install adam-mini   (or: pip install "colabkit[optim]")'


def _shape(model: torch.nn.Module) -> tuple[int, int, int | None]:
    """(width, heads, kv heads) from a colabkit GPT config or a transformers config."""
    cfg = getattr(model, "config", None)
    dim = getattr(cfg, "n_embd", None) or getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None)
    if not dim or not heads:
        raise PlanError("'adam-mini' partitions by attention head and needs the model's width and head count "
                        "(config.n_embd/n_head or hidden_size/num_attention_heads): use another optimizer for this model")
    return dim, heads, getattr(cfg, "num_key_value_heads", None)


def make_adam_mini(model: torch.nn.Module, lr: float = 3e-4, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Any:
    """The package's ``Adam_mini`` on ``model``'s trainable parameters, partitioned for colabkit's GPT
    names as well as Llama-style ones (``q_proj``...)."""
    if importlib.util.find_spec("adam_mini") is None:
        raise ImportError(f"'adam-mini' needs the adam-mini package: {INSTALL}")
    from adam_mini import Adam_mini

    dim, heads, kv = _shape(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = Adam_mini(named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, dim=dim, n_heads=heads,
                    n_kv_heads=kv, verbose=False)
    opt.wqk_names.add("attn.qkv")   # fused q|k|v rows: (3*heads) blocks of head_dim*dim, one v each
    opt.mlp_names.update({"fc", "attn.proj"})
    return opt


def _make(groups: list[dict], plan: Plan, ctx: Context) -> Any:
    if ctx.model is None:
        raise PlanError("'adam-mini' needs the model's parameter names: build it through colabkit.Trainer")
    return make_adam_mini(ctx.model, lr=ctx.lr, weight_decay=ctx.weight_decay)


def _check(plan: Plan, ctx: Context) -> None:
    if importlib.util.find_spec("adam_mini") is None:
        raise PlanError(f"'adam-mini' needs the adam-mini package: {INSTALL}")
    if "lora" in plan or "qlora" in plan:
        raise PlanError("'adam-mini' partitions whole weight matrices by head/neuron; LoRA adapters are tiny and "
                        "have no heads: use adamw with lora/qlora")


STATE_FORMULAS["adam-mini"] = lambda arg, shape: 4.0  # m per parameter; one v per block (negligible)

register(Technique(
    name="adam-mini",
    help="Adam-mini (adam-mini package): one second moment per head/neuron block, ~4 B/param of state",
    parse=flag,
    group="optimizer",
    check=_check,
    make_optimizer=_make,
    order=40,
))

"""LoRA and QLoRA: train rank-R adapters (peft) on a frozen base; ``qlora`` stores the base's linear
layers in 4-bit NF4 with double quantization (bitsandbytes).

Plan tokens: ``lora:R`` (16-bit frozen base) and ``qlora:R`` (NF4 base), computing in bf16 on a GPU with
bf16 units and fp16 on one without (T4: with a GradScaler, ``ctx.loss_scaling``); on the CPU in bf16 (lora)
and fp32 (qlora). GPT presets, ``gpt:LxD`` and ``llama:LxD`` are built on the meta device and materialised
layer by layer straight into NF4 / 16 bits (:func:`build_frozen`, in :mod:`colabkit.techniques.nf4` with
the rest of the NF4 base), so the fp32 model never exists. Targets default to the architecture's attention and MLP
projections; ``lora:R:attn``, ``lora:R:mlp``, ``lora:R:all`` or ``lora:R:q_proj,v_proj`` override them.
Only adapters train, so gradients and optimizer state shrink to the adapters' size (about
``R·(d_in+d_out)`` per target instead of ``d_in·d_out``) -- plus a task head (``classifier``, ``score``,
``qa_outputs``: new, randomly initialised layers), which trains in full and in fp32, as peft's
``modules_to_save`` does. GPT-2's ``Conv1D`` layers (weight stored (d_in, d_out), transposed against
``nn.Linear``) are quantized transposed, as transformers' BitsAndBytesConfig does, and adapted with
peft's ``fan_in_fan_out``. A qlora base that keeps more than 10% of its linear weights unquantized
(layer types qlora does not convert) says so with a warning. Adapters are saved as safetensors: loading
parses bytes and never unpickles.

>>> from colabkit.plan import Plan
>>> Plan.parse("qlora:8").get("qlora")
(8, None)
>>> Plan.parse("lora:4:attn").get("lora")
(4, ('attn',))
"""
from __future__ import annotations

import functools

import json
import math
import pickle
from typing import Iterable

import torch
import torch.nn as nn

from .. import hf_models as _hf  # noqa: F401  (registers the llama:LxD family)
from ..env import native_bf16
from ..models import gpt_config
from ..plan import Context, Plan, PlanError, Technique, register
from .nf4 import (HEADS, SKIP, UNQUANTIZED_WARN, _conv1d_type, _on, _require, build_frozen, is_conv1d,  # noqa: F401
                  is_quantized, linear_weights, quantizable, quantize_4bit, to_4bit, warn_unquantized)  # (lora's names)

# Target modules per architecture: attention projections, MLP projections.
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "GPT": (("qkv", "proj"), ("fc", "fc_proj")),  # colabkit.models.GPT
    "llama": (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")),
    "gpt2": (("c_attn",), ("c_fc", "c_proj")),  # c_proj is in both; listed once
    "phi": (("q_proj", "k_proj", "v_proj", "dense"), ("fc1", "fc2")),
    "gpt_neox": (("query_key_value", "dense"), ("dense_h_to_4h", "dense_4h_to_h")),
    "falcon": (("query_key_value", "dense"), ("dense_h_to_4h", "dense_4h_to_h")),
}
# These HF families use Llama's module names.
for _arch in ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "smollm3", "olmo", "olmo2", "granite"):
    TARGETS[_arch] = TARGETS["llama"]
TARGETS["bert"] = (("query", "key", "value"), ("dense",))  # "dense": attention output, MLP, pooler


def _arch(model: nn.Module) -> str:
    if type(model).__name__ == "GPT":
        return "GPT"
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def target_modules(model: nn.Module, which: Iterable[str] | None = None) -> list[str]:
    """Module names to adapt: ``which`` = None/"all" (attention + MLP), "attn", "mlp", or explicit names.
    Unknown architectures fall back to every linear (or ``Conv1D``) layer but the output and task heads.

    >>> from colabkit.models import build_model
    >>> target_modules(build_model("gpt-tiny"), ["attn"])
    ['qkv', 'proj']
    """
    which = list(which or ["all"])
    arch = _arch(model)
    if arch in TARGETS:
        attn, mlp = TARGETS[arch]
    else:  # every linear layer that is not the head; peft matches a name as the end of a module's dotted
        # name, so a last name that other modules share (nn.Sequential's "0" is also ModuleList's block "0") is
        # given whole
        mods = list(model.named_modules())
        linear = [n for n, m in mods if (isinstance(m, nn.Linear) or is_conv1d(m)) and n.rsplit(".", 1)[-1] not in SKIP + HEADS]
        shared = {n.rsplit(".", 1)[-1] for n, m in mods if not (isinstance(m, nn.Linear) or is_conv1d(m))}
        attn, mlp = tuple(sorted({n if n.rsplit(".", 1)[-1] in shared else n.rsplit(".", 1)[-1] for n in linear})), ()
    out: list[str] = []
    for w in which:
        names = {"all": attn + mlp, "attn": attn, "mlp": mlp}.get(w, (w,))
        out += [n for n in names if n not in out]
    present = {x for n, _ in model.named_modules() for x in (n, n.rsplit(".", 1)[-1])}
    missing = [n for n in out if n not in present]
    if missing or not out:
        raise PlanError(f"LoRA targets {missing or which} are not modules of this {arch} model; "
                        f"use attn, mlp, all, or names from: {', '.join(sorted(set(attn + mlp)))}")
    return out


def _parse(arg: str | None) -> tuple[int, tuple[str, ...] | None]:
    if arg is None:
        raise PlanError("needs a rank, e.g. ':8' (optionally ':8:attn' or ':8:q_proj,v_proj' for the targets)")
    rank, _, targets = arg.partition(":")
    if not rank.isdigit() or int(rank) < 1:
        raise PlanError(f"rank ':{rank}' is not a positive whole number, e.g. lora:8")
    names = tuple(t for t in targets.split(",") if t) if targets else None
    return int(rank), names


# ----- adapters ----------------------------------------------------------------------------------
def enable_input_grads(model: nn.Module) -> None:
    """Make the embedding output require grad, as ``prepare_model_for_kbit_training`` does, so that
    reentrant activation checkpointing of frozen blocks still back-propagates into the adapters."""
    if getattr(model, "_colabkit_input_grads", False):
        return
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else getattr(model, "wte", None)
    emb = emb if emb is not None else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:  # (no token embedding: e.g. a conv stem) only reentrant checkpointing needs this, and
        return       # colabkit's checkpointing and transformers' under colabkit's arguments are non-reentrant
    emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True) if not out.requires_grad else None)
    model._colabkit_input_grads = True


def task_heads(model: nn.Module, exclude: Iterable[str] = ()) -> list[str]:
    """Module names of the model's task heads (``classifier``, ``score``, ``qa_outputs``; outermost only),
    except those in ``exclude`` (LoRA targets).

    >>> task_heads(nn.ModuleDict({"body": nn.Linear(4, 4), "classifier": nn.Linear(4, 2)}))
    ['classifier']
    """
    exclude, out = set(exclude), []
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if (last in HEADS and last not in exclude and not any(name.startswith(h + ".") for h in out)
                and any(True for _ in m.parameters())):
            out.append(name)
    return out


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Forward pre-hook of a model whose frozen base is stored in ``dtype``: its floating inputs in that dtype
    (labels keep theirs: a regression target stays exact).

    >>> _cast_inputs(None, (torch.ones(1),), {"labels": torch.ones(1)}, torch.bfloat16)[0][0].dtype
    torch.bfloat16
    """
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(map(cast, args)), {k: v if "label" in k else cast(v) for k, v in kwargs.items()}


def _cast_to_head(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of an fp32 task head on a 16-bit base: its input in the head's dtype."""
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def apply_lora(model: nn.Module, rank: int, targets: Iterable[str] | None = None, alpha: float | None = None,
               dropout: float = 0.0, base_dtype: torch.dtype | None = None, quantize: bool = False,
               compute_dtype: torch.dtype = torch.float32, device: str | torch.device | None = None) -> nn.Module:
    """Freeze ``model``, optionally store its base in ``base_dtype`` or 4-bit NF4 (``quantize``, on
    ``device``, default: where each weight is), and inject fp32 peft LoRA adapters (A: R×d_in random, B:
    d_out×R zeros, scale alpha/R; alpha = 2R by default) on ``targets``, in place. ``Conv1D`` targets
    get peft's ``fan_in_fan_out``. A task head (:func:`task_heads`) trains in full, in fp32. At
    initialisation the output equals the base's.

    >>> from colabkit.models import build_model, count_params
    >>> m = apply_lora(build_model("gpt-tiny"), rank=4)
    >>> count_params(m, trainable_only=True)  # 2 layers × 4 × (64+192 + 64+64 + 64+256 + 256+64)
    8192
    """
    _require("peft", "lora:R")
    from peft import LoraConfig, inject_adapter_in_model

    names = target_modules(model, targets)
    heads = task_heads(model, exclude=names)
    for p in model.parameters():
        p.requires_grad_(False)
    if quantize:
        _require("bitsandbytes", "qlora:R")
        import bitsandbytes as bnb

        if not is_quantized(model):
            quantize_4bit(model, compute_dtype=compute_dtype, device=device)
            if compute_dtype != torch.float32:  # the unquantized rest (embeddings, norms) in the compute dtype
                for p in model.parameters():
                    if p.dtype == torch.float32:
                        p.data = p.data.to(compute_dtype)
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                # bitsandbytes repacks a layer for its AVX512-BF16 CPU kernel on the first no-grad eval forward,
                # permanently (absmax rounded to bf16, double quantization undone): eval would no longer compute
                # what training did, and the stored bytes would change. Keep one format.
                m.support_avx512bf16_for_cpu = False
        warn_unquantized(model)
    elif base_dtype is not None:  # parameters only: buffers such as RoPE's inv_freq keep their precision
        for p in model.parameters():
            p.data = p.data.to(base_dtype)
        if base_dtype != torch.float32 and not getattr(model, "_colabkit_input_cast", False):
            # a model fed floats (images, audio; not token ids) meets its first frozen layer in the base's dtype
            model.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=base_dtype), with_kwargs=True)
            model._colabkit_input_cast = True
    fan_in_fan_out = any(is_conv1d(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                     target_modules=names, bias="none", fan_in_fan_out=fan_in_fan_out)
    inject_adapter_in_model(cfg, model)
    for n, p in model.named_parameters():  # adapters train in fp32 whatever the base's dtype
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
    for h in heads:  # new task heads train in full, in fp32 (peft's modules_to_save, without the copy)
        head = model.get_submodule(h)
        for p in head.parameters():
            p.data = p.data.float()
            p.requires_grad_(True)
        if not getattr(head, "_colabkit_cast", False):
            head.register_forward_pre_hook(_cast_to_head)
            head._colabkit_cast = True
    enable_input_grads(model)
    model._colabkit_lora = {"rank": rank, "targets": names, "quantized": quantize, "heads": heads,
                            "adapters": adapter_shapes(model)}
    return model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only what trains: the adapter weights (peft's names) and the task heads' (the model's names)."""
    from peft import get_peft_model_state_dict

    state = dict(get_peft_model_state_dict(model))
    for h in (getattr(model, "_colabkit_lora", None) or {}).get("heads", []):
        state.update({f"{h}.{k}": v for k, v in model.get_submodule(h).state_dict().items()})
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def save_adapters(model: nn.Module, path: str) -> str:
    """Save the adapters (and trained task heads) only, as a safetensors file (tensors + rank, targets
    and heads as JSON metadata): loading it parses bytes, it cannot run code.

    >>> save_adapters(model, "adapters.safetensors")  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    if not getattr(model, "_colabkit_lora", None):
        raise ValueError("this model has no colabkit adapters to save: apply_lora first (a merged model has none)")
    info = {k: v for k, v in model._colabkit_lora.items() if k != "adapters"}  # the per-layer record stays
    save_file(adapter_state_dict(model), path, metadata={"format": "colabkit-lora", "lora": json.dumps(info)})
    return path


def read_adapters(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(rank/targets/heads, tensors) of an adapter file, never unpickling: a safetensors file, or an
    older ``torch.save`` file read with ``weights_only=True`` (tensors, numbers, strings, lists, dicts
    only). Anything else is refused with a ``ValueError`` before any of it runs."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "colabkit-lora":
                raise ValueError(f"{path} is a safetensors file but not colabkit adapters (no 'colabkit-lora' "
                                 "metadata): save adapters with colabkit.save_adapters")
            return json.loads(meta["lora"]), {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError:
        pass  # not safetensors: perhaps an adapter file from an older colabkit (torch.save)
    try:
        with open(path, "rb") as fh:  # a file object: torch.load would hand a '.safetensors' path back to safetensors
            saved = torch.load(fh, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"refusing to load {path}: it is neither safetensors nor a weights-only torch file "
                         f"(it holds objects that unpickling would construct, i.e. code could run). Load adapters "
                         f"only from files you trust and save them with colabkit.save_adapters "
                         f"(safetensors). Detail: {str(e).splitlines()[0][:200]}") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("lora"), dict) and isinstance(saved.get("state"), dict)):
        raise ValueError(f"{path} is not a colabkit adapter file (expected the keys 'lora' and 'state')")
    return saved["lora"], saved["state"]


def load_adapters(model: nn.Module, path: str) -> nn.Module:
    """Load adapters saved by :func:`save_adapters` into a model that already has the same adapters
    (``apply_lora`` with the same rank/targets), or apply them first to a plain base model."""
    from peft import set_peft_model_state_dict

    lora, state = read_adapters(path)
    info = getattr(model, "_colabkit_lora", None)
    if info is None:
        model = apply_lora(model, lora["rank"], lora["targets"])
    elif (info["rank"], list(info["targets"])) != (lora["rank"], list(lora["targets"])):
        raise ValueError(f"adapters in {path} have rank {lora['rank']} on {lora['targets']}, "
                         f"this model has rank {info['rank']} on {info['targets']}: apply_lora with those first")
    heads = model._colabkit_lora.get("heads", [])
    if sorted(lora.get("heads", [])) != sorted(heads):
        raise ValueError(f"adapters in {path} were saved with the trained task heads {lora.get('heads', [])}, "
                         f"this model has {heads}: load them into the same kind of model")
    head_state = {k: v for k, v in state.items() if any(k.startswith(h + ".") for h in heads)}
    result = set_peft_model_state_dict(model, {k: v for k, v in state.items() if k not in head_state})
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter keys not in the model: {result.unexpected_keys[:3]}")
    own = {f"{h}.{k}": v for h in heads for k, v in model.get_submodule(h).state_dict(keep_vars=True).items()}
    if own.keys() != head_state.keys():
        raise ValueError(f"{path} does not hold the task heads' tensors {sorted(own.keys() - head_state.keys())[:3]}")
    with torch.no_grad():
        for k, v in head_state.items():
            own[k].copy_(v)
    return model


def dequantize(layer: nn.Module) -> torch.Tensor:
    """The (d_out, d_in) weight a bitsandbytes ``Linear4bit`` computes with. bitsandbytes repacks the
    weight for its AVX512-BF16 CPU kernel on the first no-grad eval forward; that layout is undone first."""
    import bitsandbytes as bnb

    data, qs = layer.weight.data, layer.weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        data, qs = _convert_weight_packed_for_cpu_inverse(data, qs)
        layer.weight.data, layer.weight.quant_state = data, qs
    return bnb.functional.dequantize_4bit(data, qs)


def merge_lora(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Fold the adapters into plain ``nn.Linear`` layers (W + scale·B·A; a ``Conv1D`` base becomes the
    equivalent ``nn.Linear``) for inference, in place; a 4-bit base is dequantized first, so the merged
    layer is exact up to float rounding (re-quantizing the sum would add a second rounding error).
    ``dtype`` defaults to the adapter dtype (fp32)."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if not isinstance(child, LoraLayer):
                continue
            base = child.get_base_layer()
            if isinstance(base, bnb.nn.Linear4bit):
                w = dequantize(base).float()
            else:
                w = base.weight.detach().float()
            for name in child.active_adapters:  # in the base's layout: (d_in, d_out) for Conv1D (fan_in_fan_out)
                w = w + child.get_delta_weight(name).float()
            if is_conv1d(base):
                w = w.t()  # (d_out, d_in), as nn.Linear stores it
            out = nn.Linear(w.shape[1], w.shape[0], bias=base.bias is not None, device=w.device,
                            dtype=dtype or torch.float32)
            out.weight.data.copy_(w)
            if base.bias is not None:
                out.bias.data.copy_(base.bias.detach())
            out.requires_grad_(False)
            setattr(parent, cname, out)
    model._colabkit_lora = None
    return model


# ----- analytic memory (shared with the estimator) -------------------------------------------------
def nf4_bytes(n_weights: int, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes of one NF4 weight matrix: packed 4-bit values + absmax. Double quantization stores the
    per-block absmax as 8 bits, plus an fp32 absmax per 256 blocks and a 256-entry fp32 code.

    >>> round(nf4_bytes(4096 * 4096) / (4096 * 4096), 3)  # bytes per weight: not 0.5
    0.516
    """
    blocks = math.ceil(n_weights / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 if double_quant else 4 * blocks
    return math.ceil(n_weights / 2) + absmax + 16 * 4  # + the 16-value NF4 code


def lora_adapter_params(shapes: Iterable[tuple[int, int]], rank: int) -> int:
    """Adapter parameters for target weight shapes (d_out, d_in): R·(d_in + d_out) each.
    >>> lora_adapter_params([(768, 768)], 8)
    12288"""
    return sum(rank * (o + i) for o, i in shapes)


def lora_memory(n_params: int, rank: int, d_model: int, n_layer: int, quantized: bool = True,
                adapter_dims_per_layer: float | None = None, frozen_other: int | None = None,
                base_bytes: int = 2, optimizer_bytes: int = 8) -> dict[str, int]:
    """Analytic bytes of a (Q)LoRA run from a parameter count: ``params`` (base + fp32 adapters),
    ``grads`` and ``optimizer`` (adapters only) and ``trainable`` (adapter parameter count).

    The block linears are taken as ``n_params - frozen_other`` (default: all but a 256-byte-vocab
    embedding) in NF4 (``quantized``) or ``base_bytes`` each; adapters add ``rank × dims`` per layer
    where ``dims`` = Σ(d_in+d_out) over targets (16·D for a GPT block, ~19·D for a Llama block).
    >>> m = lora_memory(124_000_000, 8, 768, 12, frozen_other=39_000_000)
    >>> m["trainable"], m["optimizer"] == 8 * m["trainable"]
    (1179648, True)
    """
    dims = adapter_dims_per_layer if adapter_dims_per_layer is not None else 16 * d_model
    trainable = int(rank * dims * n_layer)
    other = frozen_other if frozen_other is not None else 256 * d_model
    linear = max(0, n_params - other)
    base = nf4_bytes(linear) if quantized else base_bytes * linear
    other_bytes = other * (4 if quantized else base_bytes)  # non-quantized frozen parts stay in the compute dtype
    return {"params": base + other_bytes + 4 * trainable, "grads": 4 * trainable,
            "optimizer": optimizer_bytes * trainable, "trainable": trainable}


def lora_breakdown(model: nn.Module) -> dict[str, int]:
    """Parameter counts of an adapted model: ``trainable`` (adapters), ``frozen`` and ``quantized_bytes``
    (the packed 4-bit weights and their quantization state)."""
    from ..memory import param_tensors

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    qbytes = sum(t.untyped_storage().nbytes() for t in param_tensors(model) if t.dtype == torch.uint8)
    return {"trainable": trainable, "frozen": frozen, "quantized_bytes": qbytes}


def adapter_shapes(model: nn.Module) -> list[tuple[tuple[str, int, float], ...]]:
    """Each LoRA layer's adapters as ``(name, rank, scale)``, in module order: what :func:`apply_lora` leaves,
    recorded so that adapters added on top later (TRL's ``peft_config``, peft's ``get_peft_model``) are seen.

    >>> from colabkit.models import build_model
    >>> adapter_shapes(apply_lora(build_model("gpt-tiny"), rank=4))[0]  # alpha = 2R by default: scale 2
    (('default', 4, 2.0),)
    """
    return [tuple(sorted((a, int(r), float(m.scaling[a])) for a, r in m.r.items()))
            for m in model.modules() if isinstance(getattr(m, "r", None), dict) and hasattr(m, "lora_A")]


# ----- plan tokens ------------------------------------------------------------------------------
def _check(plan: Plan, ctx: Context) -> None:
    _require("peft", "lora:R / qlora:R", load=False)
    if "qlora" in plan:
        _require("bitsandbytes", "qlora:R", load=False)
        offload = plan.get("offload") or ()
        if "params" in offload:
            raise PlanError("qlora and offload:params: the 4-bit base is already ~8x smaller and its packed weights "
                            "are not streamed by offload:params; drop offload:params")
        if plan.get("zero") == 3:
            raise PlanError("qlora and zero:3: FSDP2 cannot shard bitsandbytes 4-bit weights (and colabkit shards no "
                            "4-bit base with zero:1 or zero:2 either); train qlora on one GPU, or lora:R with zero:N")
    if "fused-step" in plan and compute_dtype(ctx, "qlora" in plan) == torch.float16:
        raise PlanError("lora/qlora compute in fp16 on this GPU and need a GradScaler, which must see every gradient "
                        "before any step: 'fused-step' cannot; drop fused-step (adapter gradients are small anyway)")


def compute_dtype(ctx: Context, quantize: bool) -> torch.dtype:
    """The dtype the frozen base computes in: bf16 on a GPU with bf16 units, fp16 on one without (T4;
    needs loss scaling); on the CPU bf16 for a lora base (no fast fp16 matmul) and fp32 for qlora.

    >>> compute_dtype(Context(device=torch.device("cpu")), quantize=True)
    torch.float32
    """
    if ctx.cuda:
        return torch.bfloat16 if native_bf16(ctx.device) else torch.float16
    return torch.float32 if quantize else torch.bfloat16


def _prepare(quantize: bool):
    def prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
        rank, targets = plan.get("qlora" if quantize else "lora")
        dtype = compute_dtype(ctx, quantize)
        if not ctx.cuda and not quantize and "fp16" in plan:  # CPU autocast keeps layer_norm in its input's dtype:
            dtype = torch.float16  # a bf16 base under fp16 autocast mixes dtypes there ("mixed dtype (CPU)")
        ctx.loss_scaling = ctx.loss_scaling or dtype == torch.float16  # fp16 gradients underflow unscaled
        if quantize:
            return apply_lora(model, rank, targets, quantize=True, device=ctx.device, compute_dtype=dtype)
        return apply_lora(model, rank, targets, base_dtype=dtype)
    return prepare


def _buildable(name: str) -> bool:
    if name.startswith("llama:"):
        return True
    try:
        gpt_config(name)
    except ValueError:
        return False
    return True


def _load(quantize: bool):
    def load(name: str, plan: Plan, ctx: Context, seq: int | None) -> nn.Module | None:
        # A hub model on a GPU loads straight into NF4 (BitsAndBytesConfig): a 7B model never needs its
        # 14 GB of 16-bit weights in host RAM or VRAM. GPT and llama:LxD shapes are built on the meta
        # device and materialised layer by layer into NF4 / 16 bits. Other models build normally.
        if quantize and name.startswith("hf:") and ctx.cuda:
            from ..hf_models import load_hf_4bit

            return load_hf_4bit(name[3:], compute_dtype=compute_dtype(ctx, True))
        if not _buildable(name):
            return None
        if quantize:
            _require("bitsandbytes", "qlora:R")
        return build_frozen(name, seq=seq, device=ctx.device, dtype=compute_dtype(ctx, quantize), quantize=quantize)
    return load


register(Technique(
    name="lora",
    help="LoRA adapters of rank R on a frozen 16-bit base (fp16 on GPU, bf16 on CPU); lora:R:attn|mlp|names",
    parse=_parse, group="adapters", check=_check, prepare_model=_prepare(False), load_model=_load(False), order=45,
    examples=("lora:8", "lora:16", "lora:8:attn"),
))
register(Technique(
    name="qlora",
    help="LoRA adapters of rank R on a frozen 4-bit NF4 base (double quant; bitsandbytes)",
    parse=_parse, group="adapters", check=_check, prepare_model=_prepare(True), load_model=_load(True), order=30,
    examples=("qlora:8", "qlora:16", "qlora:8:attn"),
))

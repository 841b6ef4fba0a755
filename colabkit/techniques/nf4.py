"""The 4-bit NF4 base of ``qlora``: which layers are stored in NF4 (``nn.Linear`` and GPT-2's ``Conv1D``,
never the output or task heads), the conversion to bitsandbytes ``Linear4bit`` with double quantization,
and a frozen base built layer by layer straight into NF4 so the fp32 model never exists. The adapters
trained on top, and the plan tokens, are in :mod:`colabkit.techniques.lora`.

>>> quantizable("fc", nn.Linear(4, 4)), quantizable("lm_head", nn.Linear(4, 4))
(True, False)
"""
from __future__ import annotations

import importlib.util
from typing import Iterable

import torch
import torch.nn as nn

from .. import hf_models as _hf  # noqa: F401  (registers the llama:LxD family build_frozen builds)
from ..env import trim_host_heap
from ..models import build_meta, materialize
from ..plan import PlanError
from ..notices import warn

SKIP = ("lm_head", "embed_out", "output")  # never quantized nor adapted: the (often tied) output head
# Task heads (transformers' *ForSequenceClassification / *ForTokenClassification / *ForQuestionAnswering):
# new and randomly initialised, so they train in full (fp32), never quantized -- peft's modules_to_save.
HEADS = ("classifier", "score", "qa_outputs")
UNQUANTIZED_WARN = 0.10  # warn when more than this fraction of the base's linear weights stays unquantized


def _conv1d_type() -> type | None:
    """transformers' ``Conv1D`` (GPT-2's linear layer: y = x·W + b with W of shape (d_in, d_out))."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # no transformers: no model can hold a Conv1D
        return None
    return Conv1D


def is_conv1d(module: nn.Module) -> bool:
    conv1d = _conv1d_type()
    return conv1d is not None and isinstance(module, conv1d)


def quantizable(name: str, module: nn.Module, skip: Iterable[str] = SKIP + HEADS) -> bool:
    """True for what qlora stores in NF4: a plain ``nn.Linear`` or a transformers ``Conv1D`` whose name
    is not an output or task head. Subclasses of ``nn.Linear`` may compute something else: left as they are.

    >>> quantizable("fc", nn.Linear(4, 4)), quantizable("lm_head", nn.Linear(4, 4)), quantizable("classifier", nn.Linear(4, 2))
    (True, False, False)
    """
    return (type(module) is nn.Linear or is_conv1d(module)) and name.rsplit(".", 1)[-1] not in set(skip)


# ----- 4-bit NF4 base ---------------------------------------------------------------------------
def _require(module: str, what: str, load: bool = True):
    """``module`` imported (``load``), or only found (a plan's check: importing peft takes seconds, and a
    check runs for every candidate plan and every memory alert's advice); PlanError saying how to get it.

    >>> _require("no_such_module_here", "lora:R", load=False)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: lora:R needs no_such_module_here: pip install 'colabkit[hf]' (or pip install no_such_module_here)
    """
    why = f"{what} needs {module}: pip install 'colabkit[hf]' (or pip install {module})"
    if not load:
        if importlib.util.find_spec(module) is None:
            raise PlanError(why)
        return None
    try:
        return __import__(module)
    except ImportError as e:
        raise PlanError(why) from e


def is_quantized(model: nn.Module) -> bool:
    """True when the model already holds bitsandbytes 4-bit layers (e.g. loaded with BitsAndBytesConfig)."""
    import bitsandbytes as bnb

    return any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def quantize_4bit(model: nn.Module, compute_dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                  skip: Iterable[str] = SKIP + HEADS, blocksize: int = 64) -> nn.Module:
    """Replace every :func:`quantizable` layer (``nn.Linear`` or GPT-2's ``Conv1D``; not the heads nor tied
    weights) by a frozen bitsandbytes ``Linear4bit`` in NF4 with double quantization, in place, quantizing
    each on the device its weight is on (then kept on ``device``, default: where it was).

    Storage per weight: 4 bits + an 8-bit absmax per block of 64 + an fp32 absmax per 256 blocks.
    >>> m = quantize_4bit(nn.Sequential(nn.Linear(64, 64)))
    >>> type(m[0]).__name__, m[0].weight.dtype
    ('Linear4bit', torch.uint8)
    """
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if counts.get(id(getattr(child, "weight", None)), 0) > 1:
                continue
            q = to_4bit(cname, child, compute_dtype, device, skip, blocksize)
            if q is not None:
                setattr(parent, cname, q)
            del child, q
    return model


def to_4bit(name: str, child: nn.Module, compute_dtype: torch.dtype = torch.float32,
            device: str | torch.device | None = None, skip: Iterable[str] = SKIP + HEADS,
            blocksize: int = 64) -> nn.Module | None:
    """A frozen NF4 ``Linear4bit`` (double quantization) computing what the ``nn.Linear`` or ``Conv1D``
    ``child`` computes; None for anything else or a name in ``skip``.

    The weight is quantized where it lies when that is ``device`` (default: its own device): a weight on
    the GPU never visits the host. A weight elsewhere moves once, to ``device``, and is quantized there.
    A ``Conv1D`` weight (d_in, d_out) is quantized transposed, as transformers' BitsAndBytesConfig does.

    >>> from transformers.pytorch_utils import Conv1D
    >>> q = to_4bit("c_fc", Conv1D(8, 64))  # GPT-2's layer: nf=8 outputs, nx=64 inputs
    >>> (q.in_features, q.out_features), q(torch.ones(2, 64)).shape
    ((64, 8), torch.Size([2, 8]))
    """
    import bitsandbytes as bnb

    if not quantizable(name, child, skip):
        return None
    w = child.weight.detach()  # nn.Linear: (d_out, d_in); Conv1D: (d_in, d_out)
    if is_conv1d(child):
        w = w.t()
    dev = w.device if device is None else torch.device(device)
    if not _on(w, dev):
        w = w.to(dev)  # one move, towards where the layer will live; never back
    w = w.to(dtype=torch.float32 if compute_dtype == torch.float32 else torch.float16).contiguous()
    packed, state = bnb.functional.quantize_4bit(w, blocksize=blocksize, compress_statistics=True, quant_type="nf4")
    d_out, d_in = w.shape
    del w
    with torch.device("meta"):  # no throwaway fp32 weight
        q = bnb.nn.Linear4bit(d_in, d_out, bias=child.bias is not None, compute_dtype=compute_dtype,
                              compress_statistics=True, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=blocksize,
                                 compress_statistics=True, quant_type="nf4", bnb_quantized=True, module=q)
    q.quant_state = state
    if child.bias is not None:
        b = child.bias.detach()
        q.bias = nn.Parameter((b if _on(b, dev) else b.to(dev)).to(dtype=compute_dtype), requires_grad=False)
    q.support_avx512bf16_for_cpu = False  # see apply_lora: keep one packed format on the CPU
    return q


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` ("cuda" matches any GPU index)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def linear_weights(model: nn.Module) -> dict[str, tuple[int, bool]]:
    """The base's linear weights as qlora sees them: module name -> (weight count, stored in NF4).
    Counted: ``nn.Linear`` (and subclasses) and ``Conv1D``; not counted: the output head (kept in the
    compute dtype on purpose, as in QLoRA), task heads (trained) and LoRA adapters.

    >>> linear_weights(quantize_4bit(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))))
    {'0': (4096, True), '1': (128, True)}
    """
    import bitsandbytes as bnb

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out: dict[str, tuple[int, bool]] = {}
    for name, m in model.named_modules():
        parts = name.split(".")
        if m is head or parts[-1] in SKIP + HEADS or any(p.startswith("lora_") for p in parts):
            continue
        if isinstance(m, bnb.nn.Linear4bit):
            out[name] = (m.in_features * m.out_features, True)
        elif isinstance(m, nn.Linear) or is_conv1d(m):
            out[name] = (m.weight.numel(), False)
    return out


def warn_unquantized(model: nn.Module, limit: float = UNQUANTIZED_WARN) -> float:
    """Warn (naming the modules) when more than ``limit`` of the base's :func:`linear_weights` are not
    NF4; returns the unquantized fraction."""
    lin = linear_weights(model)
    total = sum(n for n, _ in lin.values())
    left = {name: n for name, (n, q) in lin.items() if not q}
    frac = sum(left.values()) / total if total else 0.0
    if frac > limit:
        names = sorted(left, key=lambda k: -left[k])
        listed = ", ".join(f"{k} ({type(model.get_submodule(k)).__name__})" for k in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        warn(f"colabkit: qlora left {frac:.0%} of the base's linear weights unquantized ({sum(left.values()):,} of "
                      f"{total:,}): {listed}{more}. qlora stores plain nn.Linear and transformers Conv1D layers in "
                      f"NF4; these keep their dtype, so the parameter memory falls less than NF4 promises. Replace "
                      f"them with nn.Linear, or load the model with a BitsAndBytesConfig that converts them",
                      )
    return frac


def build_frozen(name: str, seq: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, quantize: bool = False) -> nn.Module:
    """A GPT preset, ``gpt:LxD`` or ``llama:LxD`` built on the meta device and materialised layer by
    layer on ``device``: linear layers straight into NF4 (``quantize``, the rest in ``dtype``, the
    compute dtype) or every weight in ``dtype`` (a 16-bit LoRA base). Neither host nor device ever
    holds the full-precision model: the extra memory is one layer in fp32. Weights follow the model's
    own init (same distributions as :func:`colabkit.build_model`; the random draws come in another
    order, so the same seed gives other values).

    >>> m = build_frozen("gpt-tiny", dtype=torch.float32, quantize=True)
    >>> type(m.blocks[0].fc).__name__, m.wte.weight.dtype
    ('Linear4bit', torch.float32)
    """
    def convert(n: str, m: nn.Module) -> nn.Module | None:
        trim_host_heap()  # the fp32 layer quantized last is freed by now: its pages go back to the OS
        return to_4bit(n, m, dtype, device)

    model = materialize(build_meta(name, seq=seq), device=device, dtype=dtype, convert=convert if quantize else None)
    trim_host_heap()
    return model.requires_grad_(False)

"""The fake-tensor trace: the real Trainer's steps run on shapes only, under a tracker.

:func:`trace` builds the model and runs ``steps`` optimizer steps of :class:`~colabkit.trainer.Trainer`
under ``FakeTensorMode`` with a :class:`~colabkit.memory.MemoryTracker` inside, so a 20B model is
traced on a laptop CPU and every technique that is plain torch is covered without a special case.
:func:`trace_with_substitutes` replaces what cannot run on fake tensors (bitsandbytes kernels) by
the technique's own theory and says so in ``notes``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..env import GPU_PROFILES, env as _env_report, t4_rules
from ..memory import MemoryTracker, fmt_bytes
from ..models import blocks_of, build_model, count_params, hf_from_config
from ..plan import REGISTRY, Context, Plan, PlanError
from ..techniques import lora as _lora
from ..techniques.lora import nf4_bytes
from ..techniques.optimizers import state_bytes_per_param
from ..trainer import Trainer

# The CUDA caching allocator hands out blocks in multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize), so on a GPU profile every storage is rounded up to 512 B.
CUDA_ALLOC_ROUND = 512
# Tokens whose effect is a GPU/host split: traced without them on the CPU, applied analytically.
_OFFLOAD = "offload"


class _HostScalars(TorchDispatchMode):
    """Answer host reads of tensor values (``.item()``, ``float(loss)``) on fake tensors: only shapes
    matter for memory. The GradScaler's inf flags read 0 (no inf: the step runs, as it does on real
    data); every other scalar reads 1 (step counters start at 1; nothing divides by zero)."""

    def __init__(self):
        super().__init__()
        self.flags: set[int] = set()  # storages written as found_inf by the GradScaler's unscale

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 0 if id(args[0].untyped_storage()) in self.flags else 1
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self.flags.add(id(args[1].untyped_storage()))
        return func(*args, **(kwargs or {}))


def _profile(gpu: str | None, device: str | None) -> dict[str, Any] | None:
    if device == "cpu" or gpu is None:
        return None
    if gpu.lower() not in GPU_PROFILES:
        raise ValueError(f"unknown GPU profile {gpu!r}: use one of {', '.join(GPU_PROFILES)}, or device='cpu'")
    return GPU_PROFILES[gpu.lower()]


def _as_t4(profile: dict | None):
    """While checking a plan for a GPU profile, answer capability questions as that GPU would."""
    return t4_rules(profile is not None and not profile["native_bf16"])


def _split_gpu_tokens(plan: Plan, profile: dict | None) -> tuple[Plan, frozenset]:
    """On a GPU profile, the plan traced on the CPU: offload tokens removed (applied analytically),
    ``paged-`` optimizers traced unpaged (same state; paging acts only under pressure), ``offload:params``
    traced with ``checkpoint`` (it recomputes every block in backward from the block's input), and an
    attention backend token removed (the CPU's fused SDPA kernel, like T4's efficient one, keeps no S x S)."""
    offload = frozenset(plan.get(_OFFLOAD) or ())
    if profile is None:
        return plan, frozenset()
    keep = []
    for tok in plan.tokens:
        if tok.startswith("offload:") or tok in ("attention:efficient", "attention:flash"):
            continue
        keep.append(tok[len("paged-"):] if tok.startswith("paged-") else tok)
    if "params" in offload:  # a streamed block is recomputed in backward: its activations are checkpoint's
        keep.append("checkpoint")
    return Plan.parse(keep or "baseline"), offload


@contextlib.contextmanager
def _swap_by_data():
    """``Module.to()`` swaps fake parameters with ``torch.utils.swap_tensors``, which refuses tensors that
    fake mode holds weak references to; during a trace fall back to replacing ``.data`` (the new tensor
    is allocated either way, so the memory is the same)."""
    import torch.utils as tu

    real = tu.swap_tensors

    def swap(t1, t2):
        try:
            real(t1, t2)
        except RuntimeError:
            t1.data = t2

    tu.swap_tensors = swap
    try:
        yield
    finally:
        tu.swap_tensors = real


def check_as_gpu(plan: Plan) -> None:
    """Run every technique's check with a CUDA context (under T4 emulation flags), so conflicts that
    only exist on a GPU (offload rules, bf16 on a T4) are refused as the real run would refuse them.
    A check that needs a real GPU to answer (it queries the device) is skipped: the trace checks again."""
    ctx = Context(device=torch.device("cuda"), env={**_env_report(), "device": "cuda", "gpu": "Tesla T4",
                                                   "capability": [7, 5], "bf16_native": False})
    for t in plan.techniques():
        if t.check is None:
            continue
        try:
            t.check(plan, ctx)
        except PlanError:
            raise
        except (RuntimeError, AssertionError, AttributeError):  # no GPU here to query
            pass


@contextlib.contextmanager
def _attention_as(profile: dict | None, plan: Plan, notes: list[str]):
    """On a GPU profile, SDPA keeps what that GPU's kernel keeps. A T4 runs the memory-efficient kernel,
    dropout included (it stores the RNG seed, not a mask): output + log-sum-exp, no S x S matrix. The CPU
    falls back to the math kernel whenever dropout > 0 and keeps the S x S probabilities and mask, so the
    trace calls the CPU's fused kernel (same memory as the GPU's efficient one) with dropout 0.
    ``attention:math`` is traced as math, as the GPU would run it."""
    if profile is None or plan.get("attention") == "math":
        if profile is not None:
            notes.append("attention: math kernel (forced by attention:math): S x S scores and probabilities kept")
        yield
        return
    real = F.scaled_dot_product_attention
    seen: list[float] = []

    def sdpa(*args, **kwargs):
        seen.append(float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) or 0.0))
        kwargs["dropout_p"] = 0.0
        return real(*args[:4], **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
        if seen:
            kernel = "flash" if "flash" in profile.get("sdpa", ()) and plan.get("attention") == "flash" else "memory-efficient"
            notes.append(f"attention: the {profile['name']}'s {kernel} kernel, traced as such"
                         + (f" (dropout {max(seen):g} included; a CPU would fall back to the math kernel and keep "
                            "S x S matrices)" if max(seen) > 0 else ""))


def _build(model_fn: Callable[[], torch.nn.Module] | str, seq: int) -> torch.nn.Module:
    if isinstance(model_fn, str) and model_fn.startswith("hf:"):
        model = hf_from_config(model_fn[3:], seq)  # shapes only: a shipped or cached config, never weights
    else:
        model = build_model(model_fn, seq=seq) if isinstance(model_fn, str) else model_fn()
    model._colabkit_placed = True  # built where it runs: .to() would try to swap fake parameters
    return model


def trace(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str, batch: int, seq: int, steps: int = 2,
          alloc_round: int = 1, profile: dict | None = None, notes: list[str] | None = None) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of the real Trainer on fake tensors under a tracker; its report.

    >>> trace("gpt-tiny", "baseline", 2, 16)["breakdown"]["grads"] > 0
    True
    """
    plan = Plan.parse(plan)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    notes = [] if notes is None else notes
    with FakeTensorMode(allow_non_fake_inputs=True), _HostScalars(), _swap_by_data(), _attention_as(profile, plan, notes):
        tracker = MemoryTracker(device="cpu", alert_at=None, budget_bytes=1 << 62, alloc_round=alloc_round)
        with tracker:
            trainer = Trainer(_build(model_fn, seq), plan, device="cpu", model_name=name, tracker=tracker)
            params = count_params(trainer.model)
            trainable = count_params(trainer.model, trainable_only=True)
            shapes = [tuple(p.shape) for p in trainer.model.parameters() if p.requires_grad]
            try:  # what offload:params streams: the transformer blocks' trainable weights
                block_shapes = [tuple(p.shape) for p in blocks_of(trainer.model).parameters() if p.requires_grad]
            except (ValueError, AttributeError, TypeError):
                block_shapes = None
            uses: dict[int, int] = {}
            for _, p in trainer.model.named_parameters(remove_duplicate=False):
                uses[id(p)] = uses.get(id(p), 0) + 1
            out_emb = getattr(trainer.model, "get_output_embeddings", lambda: None)()
            linear = {id(m.weight) for n, m in trainer.model.named_modules() if _lora.quantizable(n, m)
                      and uses.get(id(m.weight)) == 1 and m is not out_emb}  # what qlora quantizes: untied, not a head
            frozen = [(p.numel(), id(p) in linear, p.element_size()) for p in trainer.model.parameters()
                      if not p.requires_grad]
            frozen16 = [(n, q) for n, q, es in frozen if es == 2]
            try:  # each block's parameter bytes: FSDP2's all-gather units (estimate.zero)
                block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks_of(trainer.model)]
            except ValueError:
                block_bytes = []
            tracker.reset_peaks()
            for step in range(steps):
                x = torch.randint(0, 256, (batch, seq))  # (B, S) ids; values never matter here
                tracker.set_step(step)
                trainer.step(x, x)
        r = tracker.report()
    cfg = getattr(trainer.model, "config", None)
    return {"peak_bytes": r["peak_bytes"], "breakdown": r["breakdown"], "at_peak": r["at_peak"],
            "peak_phase": r["peak_phase"], "phase_peaks": r["phase_peaks"], "params": params, "trainable_params": trainable,
            "trainable_shapes": shapes, "block_shapes": block_shapes, "frozen16": frozen16, "frozen": frozen, "config": cfg,
            "block_bytes": block_bytes}


@contextlib.contextmanager
def _compute_dtype_of_qlora():
    """While tracing qlora's lora stand-in, give the frozen base qlora's compute dtype (lora's own choice
    differs on a CPU: bf16 against qlora's fp32), so activations are traced in the dtype the run uses."""
    real = _lora.compute_dtype
    _lora.compute_dtype = lambda ctx, quantize: real(ctx, True)
    try:
        yield
    finally:
        _lora.compute_dtype = real


def _shift(t: dict[str, Any], category: str, delta: int) -> None:
    """Add ``delta`` bytes that live through the whole step (a substituted weight or optimizer state) to
    ``category`` everywhere a trace reports it: own peaks, the peak's composition, every phase's peak."""
    t["breakdown"][category] += delta
    t["at_peak"][category] += delta
    t["peak_bytes"] += delta
    for pp in t["phase_peaks"].values():
        pp["peak"] += delta
        pp["at_peak"][category] += delta
        pp["own"][category] += delta


def trace_with_substitutes(model_fn, plan: Plan, batch: int, seq: int, steps: int, alloc_round: int,
                           notes: list[str], profile: dict | None = None) -> dict[str, Any]:
    """Trace the plan; if its optimizer cannot run on fake tensors, trace with a stateless SGD in its
    place and add the optimizer's state from its formula (``state_bytes_per_param``); qlora is traced as
    lora with the base's bytes swapped for the dtypes the real run uses (on ``profile``'s GPU or the CPU)."""
    try:
        return trace(model_fn, plan, batch, seq, steps, alloc_round, profile, notes)
    except PlanError:
        raise
    except Exception as err:  # noqa: BLE001  (a kernel that reads data pointers, e.g. through ctypes)
        if "qlora" in plan:  # bitsandbytes' Params4bit cannot wrap a fake tensor: trace lora, swap the base
            stand_in = Plan.parse(["lora" + t[len("qlora"):] if t.startswith("qlora") else t for t in plan.tokens])
            # the stand-in computes in qlora's dtype: fp16 on a GPU (as lora there), fp32 on a CPU (lora: bf16)
            with _compute_dtype_of_qlora():
                t = trace_with_substitutes(model_fn, stand_in, batch, seq, steps, alloc_round, notes, profile)
            # qlora's linear weights are NF4; the rest of the frozen base (embeddings, lm_head, norms) stays in
            # the compute dtype: fp16 on a GPU, fp32 on a CPU -- what the stand-in already holds.
            rest = 2 if profile is not None else 4
            delta = sum(nf4_bytes(n) - es * n if q else (rest - es) * n for n, q, es in t["frozen"])
            _shift(t, "params", delta)
            dtype = "fp16" if rest == 2 else "fp32"
            held = sum(es * n for n, _, es in t["frozen"])
            notes.append(f"qlora dtypes (as the run stores them): {sum(q for _, q, _ in t['frozen'])} linear weights NF4; "
                         f"embeddings {dtype}, lm_head {dtype} (never quantized), norms {dtype}. bitsandbytes cannot "
                         f"quantize the estimator's fake tensors, so the trace ran lora with 16-bit frozen weights "
                         f"({fmt_bytes(held)}); params counts them as the run stores them ({fmt_bytes(held + delta)}), "
                         f"{fmt_bytes(abs(delta))} {'less' if delta <= 0 else 'more'}")
            return t
        opt = plan.optimizer_token
        if plan.optimizer == "sgd":
            raise
        stand_in = Plan.parse([("sgd" if REGISTRY[t.partition(":")[0]].group == "optimizer" else t)
                               for t in plan.tokens] if opt != "adamw" or "adamw" in plan.tokens
                              else list(plan.tokens) + ["sgd"])
        t = trace(model_fn, stand_in, batch, seq, steps, alloc_round, profile, notes)
        state = int(sum(math.prod(s) * state_bytes_per_param(opt, s) for s in t["trainable_shapes"]))
        _shift(t, "optimizer", state)
        notes.append(f"{opt} cannot run on fake tensors ({type(err).__name__}); its state "
                     f"{fmt_bytes(state)} comes from state_bytes_per_param")
        return t

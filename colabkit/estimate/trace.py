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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..env import GPU_PROFILES, env as _env_report, t4_rules
from ..memory import MemoryTracker, fmt_bytes
from ..models import build_model, count_params
from ..plan import REGISTRY, Context, Plan, PlanError
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
    ``paged-`` optimizers traced unpaged (same state; paging acts only under pressure), and an
    attention backend token removed (the CPU's fused SDPA kernel, like T4's efficient one, keeps no S x S)."""
    offload = frozenset(plan.get(_OFFLOAD) or ())
    if profile is None:
        return plan, frozenset()
    keep = []
    for tok in plan.tokens:
        if tok.startswith("offload:") or tok in ("attention:efficient", "attention:flash"):
            continue
        keep.append(tok[len("paged-"):] if tok.startswith("paged-") else tok)
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


def _build(model_fn: Callable[[], torch.nn.Module] | str, seq: int) -> torch.nn.Module:
    model = build_model(model_fn, seq=seq) if isinstance(model_fn, str) else model_fn()
    model._colabkit_placed = True  # built where it runs: .to() would try to swap fake parameters
    return model


def trace(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str, batch: int, seq: int, steps: int = 2,
          alloc_round: int = 1) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of the real Trainer on fake tensors under a tracker; its report.

    >>> trace("gpt-tiny", "baseline", 2, 16)["breakdown"]["grads"] > 0
    True
    """
    plan = Plan.parse(plan)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    with FakeTensorMode(allow_non_fake_inputs=True), _HostScalars(), _swap_by_data():
        tracker = MemoryTracker(device="cpu", alert_at=None, budget_bytes=1 << 62, alloc_round=alloc_round)
        with tracker:
            trainer = Trainer(_build(model_fn, seq), plan, device="cpu", model_name=name, tracker=tracker)
            params = count_params(trainer.model)
            trainable = count_params(trainer.model, trainable_only=True)
            shapes = [tuple(p.shape) for p in trainer.model.parameters() if p.requires_grad]
            uses: dict[int, int] = {}
            for _, p in trainer.model.named_parameters(remove_duplicate=False):
                uses[id(p)] = uses.get(id(p), 0) + 1
            linear = {id(m.weight) for m in trainer.model.modules() if type(m) is torch.nn.Linear
                      and uses.get(id(m.weight)) == 1}  # what qlora quantizes: untied nn.Linear weights
            frozen16 = [(p.numel(), id(p) in linear) for p in trainer.model.parameters()
                        if not p.requires_grad and p.element_size() == 2]
            tracker.reset_peaks()
            for step in range(steps):
                x = torch.randint(0, 256, (batch, seq))  # (B, S) ids; values never matter here
                tracker.set_step(step)
                trainer.step(x, x)
        r = tracker.report()
    cfg = getattr(trainer.model, "config", None)
    return {"peak_bytes": r["peak_bytes"], "breakdown": r["breakdown"], "at_peak": r["at_peak"],
            "peak_phase": r["peak_phase"], "params": params, "trainable_params": trainable,
            "trainable_shapes": shapes, "frozen16": frozen16, "config": cfg}


def trace_with_substitutes(model_fn, plan: Plan, batch: int, seq: int, steps: int, alloc_round: int,
                            notes: list[str]) -> dict[str, Any]:
    """Trace the plan; if its optimizer cannot run on fake tensors, trace with a stateless SGD in its
    place and add the optimizer's state from its formula (``state_bytes_per_param``)."""
    try:
        return trace(model_fn, plan, batch, seq, steps, alloc_round)
    except PlanError:
        raise
    except Exception as err:  # noqa: BLE001  (a kernel that reads data pointers, e.g. through ctypes)
        if "qlora" in plan:  # bitsandbytes' Params4bit cannot wrap a fake tensor: trace lora, swap the base
            stand_in = Plan.parse(["lora" + t[len("qlora"):] if t.startswith("qlora") else t for t in plan.tokens])
            t = trace_with_substitutes(model_fn, stand_in, batch, seq, steps, alloc_round, notes)
            # qlora: linear weights in NF4, every other frozen tensor stays fp32 (lora's stand-in: all 16-bit)
            saved = sum(2 * n - nf4_bytes(n) if q else -2 * n for n, q in t["frozen16"])
            for d in (t["breakdown"], t["at_peak"]):
                d["params"] -= saved
            t["peak_bytes"] -= saved
            notes.append(f"qlora: traced as lora (16-bit base); the base's {sum(q for _, q in t['frozen16'])} linear weights "
                         f"counted as NF4 (nf4_bytes), the rest of the frozen base as fp32 ({-saved:+,} B); "
                         "bitsandbytes cannot quantize fake tensors")
            return t
        opt = plan.optimizer_token
        if plan.optimizer == "sgd":
            raise
        stand_in = Plan.parse([("sgd" if REGISTRY[t.partition(":")[0]].group == "optimizer" else t)
                               for t in plan.tokens] if opt != "adamw" or "adamw" in plan.tokens
                              else list(plan.tokens) + ["sgd"])
        t = trace(model_fn, stand_in, batch, seq, steps, alloc_round)
        state = int(sum(math.prod(s) * state_bytes_per_param(opt, s) for s in t["trainable_shapes"]))
        t["breakdown"]["optimizer"] += state
        t["at_peak"]["optimizer"] += state
        t["peak_bytes"] += state
        notes.append(f"{opt} cannot run on fake tensors ({type(err).__name__}); its state "
                     f"{fmt_bytes(state)} comes from state_bytes_per_param")
        return t

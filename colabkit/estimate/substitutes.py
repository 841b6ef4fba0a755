"""What cannot run on fake tensors, traced by a stand-in and completed from theory.

bitsandbytes' kernels read tensor data (its 8-bit optimizers where it steps them, lion/lion8bit, qlora's NF4
base): :func:`trace_with_substitutes` traces the plan with a stateless SGD (or lora for qlora) in their place
and adds what the stand-in lacks -- the optimizer's state from its formula, the NF4 bytes of the base -- and
says so in ``notes``. colabkit's own 8-bit kernel, where the run steps with it
(:func:`steps_own_8bit_kernel`: the rule ``make_optimizer`` applies), is plain torch and is traced itself.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ..env import env as _env_report
from ..memory import fmt_bytes
from ..plan import REGISTRY, Context, Plan, PlanError
from ..techniques import lora as _lora
from ..techniques.lora import nf4_bytes
from ..techniques.optimizers import BNB_BLOCK, MIN_QUANT_SIZE, AdamW8bit, adamw8bit_kernel, state_bytes_per_param
from .trace import _REAL_COMPUTE_DTYPE, NO_FAKE_OPTIMIZERS, _shift, _traced


# transformers' Trainer with TrainingArguments(optim="adamw_bnb_8bit") makes bitsandbytes' AdamW8bit on every
# device (its CPU kernel too, which allocates no step scratch): within :func:`bitsandbytes_steps`, adamw8bit
# is bitsandbytes' wherever the run is (``estimate(args=...)``)
_BY_BITSANDBYTES = [False]


@contextlib.contextmanager
def bitsandbytes_steps(on: bool = True):
    """Within the block, ``adamw8bit`` is stepped by bitsandbytes whatever the device (transformers' Trainer)."""
    prev, _BY_BITSANDBYTES[0] = _BY_BITSANDBYTES[0], on
    try:
        yield
    finally:
        _BY_BITSANDBYTES[0] = prev


def steps_own_8bit_kernel(plan: Plan | str, profile: dict | None) -> bool:
    """True where a run of ``plan`` (as the run has it: offload tokens included) on ``profile``'s GPU (None: the
    CPU) steps ``adamw8bit`` with colabkit's :class:`~colabkit.techniques.optimizers.AdamW8bit` rather than
    bitsandbytes': the rule of :func:`~colabkit.techniques.optimizers.adamw8bit_kernel`, asked with where the
    plan puts the parameters the optimizer gets -- on a GPU every one on the device unless ``offload:params``
    streams the blocks' from the host or ``offload:optimizer`` steps host copies; on the CPU none is.
    That kernel is plain torch: the trace runs it, so its state and per-step scratch are counted.

    >>> steps_own_8bit_kernel("adamw8bit", {"key": "t4"}), steps_own_8bit_kernel("adamw8bit+fused-step", {"key": "t4"})
    (False, True)
    >>> steps_own_8bit_kernel("adamw8bit+offload:params", {"key": "t4"}), steps_own_8bit_kernel("adamw8bit", None)
    (True, True)
    """
    plan = Plan.parse(plan)
    if plan.optimizer != "adamw8bit" or _BY_BITSANDBYTES[0]:  # paged-adamw8bit, lion, lion8bit: bitsandbytes
        return False                                           # wherever they run (and in transformers' Trainer)
    on_gpu = profile is not None and not {"params", "optimizer"} & set(plan.get("offload") or ())
    return adamw8bit_kernel(plan, on_gpu) == "colabkit"


def own_8bit_scratch(trainable_shapes: list[tuple[int, ...]]) -> int:
    """Bytes of the scratch :class:`~colabkit.techniques.optimizers.AdamW8bit` allocates in a step on one device:
    two fp32 buffers and one uint8 buffer of one chunk, ``min(CHUNK, the largest quantized tensor in whole
    blocks)`` values, 9 B per value (9 MiB at a full chunk); none when no tensor is quantized.

    >>> own_8bit_scratch([(50257, 768), (768,)]) == 9 * 2**20, own_8bit_scratch([(64,)])
    (True, 0)
    """
    sizes = [math.prod(s) for s in trainable_shapes if math.prod(s) >= MIN_QUANT_SIZE]
    if not sizes:
        return 0
    return 9 * min(AdamW8bit.CHUNK, -(-max(sizes) // BNB_BLOCK) * BNB_BLOCK)


@contextlib.contextmanager
def _compute_dtype_of_qlora(profile: dict | None):
    """While tracing qlora's lora stand-in, give the frozen base the dtype qlora computes in where the run is:
    on ``profile``'s GPU bf16 or fp16 (as :func:`~colabkit.techniques.lora.compute_dtype` there), on the CPU fp32
    -- the trace itself runs on a fake CPU device, where the real choice would always say fp32 (until
    2026-11-27 a T4 estimate traced qlora's activations in fp32, twice a T4 run's fp16)."""
    real = _lora.compute_dtype
    gpu = None if profile is None else torch.bfloat16 if profile.get("native_bf16") else torch.float16
    _lora.compute_dtype = lambda ctx, quantize: gpu or _REAL_COMPUTE_DTYPE(ctx, True)
    try:
        yield
    finally:
        _lora.compute_dtype = real


def trace_with_substitutes(model_fn, plan: Plan, batch: int, seq: int, steps: int, alloc_round: int,
                           notes: list[str], profile: dict | None = None, inputs: dict | None = None,
                           run_plan: Plan | str | None = None) -> dict[str, Any]:
    """Trace the plan; if its optimizer cannot run on fake tensors, trace with a stateless SGD in its
    place and add the optimizer's state from its formula (``state_bytes_per_param``); qlora is traced as
    lora with the base's bytes swapped for the dtypes the real run uses (on ``profile``'s GPU or the CPU).
    The substitutes are taken at once for what is known not to run on fake tensors (qlora's base,
    :data:`NO_FAKE_OPTIMIZERS`), after the same checks: no trace runs only to fail (whose half-done step
    also left a few KiB of noise in the next trace), and bitsandbytes is not imported for an optimizer.
    ``run_plan``: the plan as the run has it (``plan`` may have its offload tokens split off for a GPU
    profile); where the run steps adamw8bit with colabkit's own kernel (:func:`steps_own_8bit_kernel`) that
    kernel is traced, not substituted (but for offload:optimizer on a GPU: it steps on the host, so the device
    sees nothing of it); should it fail on fake tensors, its scratch is added from
    :func:`own_8bit_scratch` at the peak of the phase it steps in (an upper bound), said in ``notes``."""
    run = plan if run_plan is None else Plan.parse(run_plan)
    own8 = steps_own_8bit_kernel(run, profile)
    # offload:optimizer on a GPU: the kernel steps host copies, nothing of its step is on the device (the same with
    # the substitute, at a fraction of the cost), and host_bytes counts state, not step scratch: substituted
    host8 = own8 and profile is not None and "optimizer" in set(run.get("offload") or ())
    own8 = own8 and not host8
    known = None
    if "qlora" in plan or (plan.optimizer in NO_FAKE_OPTIMIZERS and not own8):
        ctx = Context(device=torch.device("cpu"), env=_env_report())
        if "qlora" in plan:
            plan.check(ctx)
        else:
            tech = REGISTRY[plan.optimizer]
            if tech.check is not None:
                tech.check(plan, ctx)
        known = RuntimeError("bitsandbytes kernels read tensor data")
    try:
        if known is not None:
            raise known
        t = _traced(model_fn, plan, batch, seq, steps, alloc_round, profile, notes, inputs)
        if own8:
            notes.append(f"adamw8bit: colabkit's own 8-bit kernel steps this run ({_why_own_8bit(run, profile)}), "
                         f"traced on fake tensors: its state and its per-step scratch "
                         f"({fmt_bytes(own_8bit_scratch(t['trainable_shapes']))} per device, in other) are counted")
        return t
    except PlanError:
        raise
    except Exception as err:  # noqa: BLE001  (a kernel that reads data pointers, e.g. through ctypes)
        if "qlora" in plan:  # bitsandbytes' Params4bit cannot wrap a fake tensor: trace lora, swap the base
            stand_in = Plan.parse(["lora" + t[len("qlora"):] if t.startswith("qlora") else t for t in plan.tokens])
            # the stand-in computes in qlora's dtype: fp16 on a GPU (as lora there), fp32 on a CPU (lora: bf16)
            with _compute_dtype_of_qlora(profile):
                t = trace_with_substitutes(model_fn, stand_in, batch, seq, steps, alloc_round, notes, profile, inputs,
                                           run_plan=run)
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
        t = _traced(model_fn, stand_in, batch, seq, steps, alloc_round, profile, notes, inputs)
        state = int(sum(math.prod(s) * state_bytes_per_param(opt, s) for s in t["trainable_shapes"]))
        _shift(t, "optimizer", state)
        notes.append(f"{opt} cannot run on fake tensors ({type(err).__name__}); its state "
                     f"{fmt_bytes(state)} comes from state_bytes_per_param"
                     + (" (transformers' Trainer steps bitsandbytes' AdamW8bit on every device, optim='adamw_bnb_8bit')"
                        if _BY_BITSANDBYTES[0] and plan.optimizer == "adamw8bit" else "") if not host8 else
                     f"adamw8bit: colabkit's own 8-bit kernel steps the host copies (offload:optimizer): nothing of its "
                     f"step is on the GPU; traced as SGD, its state {fmt_bytes(state)} from state_bytes_per_param "
                     f"(its step scratch, {fmt_bytes(own_8bit_scratch(t['trainable_shapes']))}, is in host_bytes)")
        if own8:  # colabkit's kernel, which should have run: its scratch from the formula, at its phase's peak
            scratch = own_8bit_scratch(t["trainable_shapes"])
            phase = "backward" if "fused-step" in plan else "optimizer"
            _add_step_scratch(t, phase, scratch)
            notes.append(f"adamw8bit: colabkit's own 8-bit kernel steps this run ({_why_own_8bit(run, profile)}) but "
                         f"did not run on fake tensors: its scratch {fmt_bytes(scratch)} (own_8bit_scratch) is added "
                         f"at the {phase} phase's peak, an upper bound")
        return t


def _why_own_8bit(run: Plan, profile: dict | None) -> str:
    """Why colabkit's kernel, not bitsandbytes', steps adamw8bit in ``run`` (:func:`steps_own_8bit_kernel`)."""
    if profile is None:
        return "off CUDA"
    offload = set(run.get("offload") or ())
    return ("offload:params: host and device parameters, each stepped on its side" if "params" in offload else
            "fused-step: bitsandbytes would sync the device after every parameter")


def _add_step_scratch(t: dict[str, Any], phase: str, nbytes: int) -> None:
    """Add ``nbytes`` of the optimizer step's scratch (``other``) to ``phase``'s peak, as if it were live there."""
    pp = t["phase_peaks"].get(phase)
    if pp is None or not nbytes:
        return
    pp["peak"] += nbytes
    pp["at_peak"]["other"] += nbytes
    pp["own"]["other"] += nbytes
    t["breakdown"]["other"] = max(t["breakdown"]["other"], pp["own"]["other"])
    if pp["peak"] > t["peak_bytes"]:
        t["peak_bytes"], t["at_peak"], t["peak_phase"] = pp["peak"], dict(pp["at_peak"]), phase

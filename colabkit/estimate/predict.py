"""Will it fit? :func:`estimate` predicts the peak memory of a whole training step without allocating it.

It traces the real Trainer on fake tensors (:mod:`.trace`), moves offloaded state to the host
(:mod:`.formulas`), compares the result with the budget of a GPU profile or of this machine, and puts
the textbook formula beside it so you see where that is off.

>>> r = estimate("gpt-tiny", "baseline", batch=2, seq=16, device="cpu")
>>> r["breakdown"]["params"] == 4 * r["params"], r["fits"]
(True, True)
"""
from __future__ import annotations

import json
import math
import os
import shutil
import types
from typing import Any, Callable

import torch

from ..env import budget_bytes as _budget_bytes
from ..memory import CATEGORIES, fmt_bytes
from ..models import HUB_ALIASES, HUB_CONFIG_DIR, auto_class, gpt_config, hub_config, model_from_config
from ..plan import REGISTRY, Context, Plan, PlanError, check_batch
from ..techniques.disk_offload import RESIDENT_SHARE, disk_state_bytes, offload_dir, ram_window_bytes
from ..techniques.optimizers import HF_OPTIM
from . import overheads as _overheads
from .formulas import _host_split, analytic
from .zero import cpu_offload, for_rank, fsdp_offload_plan, gathered_in_half, shard_trace
from .speed import count_flops, speed_of
from .as_gpu import _as_t4, _profile, _split_gpu_tokens, check_as_gpu
from .inputs import batch_shape, described, module_factory
from .substitutes import bitsandbytes_steps, own_8bit_scratch, steps_own_8bit_kernel, trace_with_substitutes
from .trace import CUDA_ALLOC_ROUND, _gpt_of, block_grads_to_host, values_needed


def from_config(config: Any) -> Callable[[], torch.nn.Module]:
    """A factory for a transformers model config: the class it is built as (:func:`~colabkit.models.auto_class`:
    the one its ``architectures`` names, e.g. ``BertForSequenceClassification``, else ``AutoModelForSeq2SeqLM``
    for an encoder-decoder, else ``AutoModelForCausalLM``)."""
    cls = auto_class(config)

    def build() -> torch.nn.Module:
        return model_from_config(config)

    build.__name__ = cls.__name__ if not cls.__name__.startswith("AutoModel") else f"{config.model_type} ({cls.__name__})"
    return build


def plan_of_arguments(args: Any, plan: Plan | str = "baseline") -> tuple[Plan, int]:
    """The plan and effective batch a transformers ``TrainingArguments`` trains with: fp16/bf16,
    gradient checkpointing, ``gradient_accumulation_steps`` (K) and ``optim``, added to ``plan`` (its
    model-side tokens: lora, qlora, compress, ...); batch = ``per_device_train_batch_size`` x K.

    >>> from types import SimpleNamespace as A
    >>> p, b = plan_of_arguments(A(fp16=True, gradient_checkpointing=True, gradient_accumulation_steps=4,
    ...                            optim="adamw_bnb_8bit", per_device_train_batch_size=2), "lora:8")
    >>> str(p), b
    ('lora:8+fp16+checkpoint+accum:4+adamw8bit', 8)
    """
    tokens = [t for t in ("fp16", "bf16") if getattr(args, t, False)]
    if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
        tokens.append("checkpoint")
    k = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    if k > 1:
        tokens.append(f"accum:{k}")
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None)) or "adamw_torch")
    names = {v: k for k, v in HF_OPTIM.items()} | {"adamw_torch_fused": "adamw", "adamw_hf": "adamw"}
    if optim not in names:
        raise PlanError(f"TrainingArguments(optim={optim!r}) has no colabkit token to estimate it with: the estimator "
                        f"knows {', '.join(sorted(names))}; pass one of those, or plan= with a colabkit optimizer token")
    if names[optim] == "sgd":
        momentum = dict(kv.split("=") for kv in (getattr(args, "optim_args", None) or "").split(",") if "=" in kv)
        tokens.append(f"sgd:{momentum['momentum']}" if "momentum" in momentum else "sgd")
    elif names[optim] != "adamw":
        tokens.append(names[optim])
    plan = Plan.parse(plan)
    try:
        return plan.with_tokens(*tokens), int(args.per_device_train_batch_size) * k
    except PlanError as e:
        raise PlanError(f"plan {str(plan)!r} and the TrainingArguments ({'+'.join(tokens) or 'baseline'}) overlap: {e}; "
                        "with args=, give plan= the model-side tokens only (lora, qlora, compress, ...)") from None


def estimate(model_fn: Callable[[], torch.nn.Module] | str | Any, plan: Plan | str = "baseline", batch: int = 8,
             seq: int = 128, gpu: str | None = "t4", device: str | None = None, steps: int = 2,
             budget_bytes: int | None = None, calibration: dict[str, Any] | bool = True,
             world_size: int = 1, inputs: dict[str, Any] | None = None, args: Any = None) -> dict[str, Any]:
    """Predicted peak and per-category breakdown of a training run, on a GPU profile or on the CPU.

    ``model_fn``: a preset or ``hf:<id>`` name, any function returning an ``nn.Module`` (its forward may
    return a tensor, a tuple or a ``ModelOutput``; the loss is computed as :class:`colabkit.Trainer` does),
    a built ``nn.Module`` (measured on a copy made of shapes only: :func:`.inputs.module_factory`), or a
    transformers model config. ``inputs`` describes your batch -- each key a sample tensor or a
    ``(shape, dtype)`` pair, e.g. ``{"pixel_values": ((8, 3, 224, 224), torch.float32), "labels": ((8,),
    torch.long)}`` -- instead of (batch, seq) token ids; batch and seq are then read from it. ``args``, a
    transformers ``TrainingArguments``, gives the loop-side plan and the batch (:func:`plan_of_arguments`;
    with ``inputs``, their first dimension becomes that batch).

    ``device="cpu"`` predicts a CPU ``bench`` run (what CI checks); ``gpu="t4"`` (or another key of
    ``GPU_PROFILES``) predicts that GPU: the plan is validated as on a T4 (no bf16), traced on the CPU
    (same graph), storages rounded to the CUDA allocator's 512 B, offload tokens move state to
    ``host_bytes``. ``peak_bytes`` stays the tensors' peak (what ``max_memory_allocated`` shows);
    ``overheads`` names what the GPU adds (:mod:`.overheads`: CUDA context, cuBLAS workspaces, allocator
    rounding, fragmentation, optimizer-step temporaries), and the device resource needs their sum on top,
    within their ``uncertainty``, of the capacity CUDA reports (``budget_bytes``). ``calibration``: True
    uses the profile ``colabkit calibrate`` stored for this GPU (if any), False ignores it, a dict is used.

    >>> r = estimate("gpt-tiny", "checkpoint" if "checkpoint" in REGISTRY else "baseline", 2, 16)
    >>> r["peak_bytes"] < r["budget_bytes"]
    True
    """
    if args is not None:
        plan, batch = plan_of_arguments(args, plan)
        if inputs is not None:  # what the dataloader yields, as the window colabkit steps on
            inputs = {k: ((batch, *shape[1:]), dtype) for k, (shape, dtype) in
                      ((k, described(k, v)) for k, v in inputs.items())}
        with bitsandbytes_steps():  # transformers makes bitsandbytes' AdamW8bit for adamw_bnb_8bit, on any device
            return estimate(model_fn, plan, batch, seq, gpu, device, steps, budget_bytes, calibration, world_size,
                            inputs)
    if inputs is not None:
        batch, seq = batch_shape(inputs)
    if type(model_fn).__name__.endswith("Config") and hasattr(model_fn, "model_type"):  # a transformers config
        model_fn = from_config(model_fn)
    if isinstance(model_fn, torch.nn.Module):  # your built model: measured on a copy made of shapes only
        model_fn = module_factory(model_fn)
    profile = _profile(gpu, device)
    plan = Plan.parse(plan)
    check_batch(plan, batch, world_size)  # as train and bench refuse it
    if plan.get("zero") is not None and world_size >= 2:  # refused as the sharded run refuses it (its optimizer, ...)
        try:
            REGISTRY["zero"].check(plan, Context(device=torch.device("cpu")))
        except PlanError as e:
            if "needs one process per rank" not in str(e):  # the estimate is per rank: no process group needed
                raise
    asked = batch
    sharded_plan, plan, batch, zero = plan, *for_rank(plan, batch, world_size)  # zero:N: one rank's share
    notes: list[str] = []
    if zero is not None and asked < world_size:  # (train refuses it: a batch must split over the ranks)
        notes.append(f"batch {asked} is less than the {world_size} ranks: estimated with one sequence per rank (a global "
                     f"batch of {world_size}), which train --world-size {world_size} needs at least")
    if "(AutoModelForCausalLM)" in getattr(model_fn, "__name__", ""):
        notes.append("the config names no architecture: built as AutoModelForCausalLM (for another head pass a "
                     "factory, e.g. lambda: BertForSequenceClassification(config))")
    with _as_t4(profile):
        traced_plan, offload = _split_gpu_tokens(plan, profile)
        fsdp_offload = zero == 3 and bool(offload)  # FSDP2's CPUOffloadPolicy moves the shards (zero.cpu_offload)
        if fsdp_offload:
            traced_plan, offload = fsdp_offload_plan(traced_plan, plan), frozenset()
        if profile is not None:
            check_as_gpu(plan)
        elif "offload:disk" in plan:
            plan.check(Context(device=torch.device("cpu")))
        # a file on disk: traced as AdamW, the state moved below. Asked of the plan, not the traced one, which on a
        # GPU profile has lost every offload: token (an H200 measured offload:disk 17% under its estimate: the
        # state was still counted on the device, 2026-11-27)
        disk = "offload:disk" in plan
        if disk and "offload:disk" in traced_plan:  # a CPU estimate (a GPU profile's traced plan has lost it)
            traced_plan = Plan.parse([k for k in traced_plan.tokens if k != "offload:disk"] or "baseline")
        streamed = "params" in offload  # offload:params: block gradients leave for the host in the trace
        half = zero in (2, 3) and ("fp16" in plan or "bf16" in plan)  # FSDP2 gathers 16-bit parameters
        name = getattr(model_fn, "__name__", "the model")
        own = inputs is None and not isinstance(model_fn, str) and _gpt_of(model_fn, seq) is None  # your model
        with block_grads_to_host(streamed), gathered_in_half(half), values_needed(name, default_batch=own):
            t = trace_with_substitutes(model_fn, traced_plan, batch, seq, steps,
                                       CUDA_ALLOC_ROUND if profile else 1, notes, profile, inputs, run_plan=plan)
        counts = count_flops(model_fn, plan, batch, seq, t["trainable_params"], notes, t)  # plan: offload is bytes moved
        counts["nf4_params"] = sum(n for n, q, _ in t["frozen"] if q) if "qlora" in plan else 0  # dequantized each pass
    _shard(t, zero, world_size, half)  # zero:N: one rank's share of the categories the stage shards
    fsdp_host = cpu_offload(t, world_size, pinned=profile is not None) if fsdp_offload else None
    cfg = t["config"]
    disk_bytes = _disk_split(t, notes, gpu=profile is not None) if disk else 0
    # Each phase's peak moved to the host the same way; the device's peak is the largest phase's
    # offload:params: a backward peak at which every gradient the step finds on the GPU (the non-block ones) is
    # complete comes after the input embedding's backward, upstream of every block: no block weights in flight
    step_grads = t["phase_peaks"].get("optimizer", {}).get("at_peak", {}).get("grads", 0)
    done = {p: streamed and p == "backward" and 0 < v["at_peak"]["grads"] >= max(v["own"]["grads"], step_grads)
            for p, v in t["phase_peaks"].items()}
    phases = {p: _host_split(v["own"], v["at_peak"], offload, t["trainable_shapes"], getattr(cfg, "n_layer", 1), [],
                             t.get("block_shapes"), phase=p, grads_streamed=streamed, blocks_done=done[p])
              for p, v in t["phase_peaks"].items()}
    br, at, host = _host_split(t["breakdown"], t["at_peak"], offload, t["trainable_shapes"],
                               getattr(cfg, "n_layer", 1), notes, t.get("block_shapes"), grads_streamed=streamed)
    host += t.get("host_bytes", 0)  # what the trace itself put on the host side (offload:activations' blocks)
    if profile is not None and "activations" in (plan.get("offload") or ()):
        notes.append(f"offload:activations: traced through the CPU twin of CUDA's streams: saved tensors to pinned host "
                     f"blocks ({fmt_bytes(t.get('host_bytes', 0))} at the peak), each copied back to the GPU when "
                     "backward needs it (counted as 'other' there)")
    if "optimizer" in offload and profile is not None and steps_own_8bit_kernel(plan, profile):
        host += own_8bit_scratch(t["trainable_shapes"])  # colabkit's 8-bit kernel steps the host copies: its scratch
    if fsdp_host is not None:  # FSDP2's CPUOffloadPolicy: each rank's shards and optimizer state in its host RAM
        host = sum(fsdp_host.values())
        notes.append("zero:3 with offload (FSDP2's CPUOffloadPolicy): each rank's parameter and gradient shards (pinned) "
                     "and optimizer state in its host RAM (host_bytes); the GPU keeps the gathered copies, gradients "
                     "in flight and activations; no block is recomputed unless the plan has checkpoint")
    phase_peaks = {p: {"peak": int(sum(a.values())), "at_peak": a, "own": o} for p, (o, a, _) in phases.items()}
    if offload and phase_peaks:
        top = max(phase_peaks, key=lambda p: phase_peaks[p]["peak"])
        peak, at, t["peak_phase"] = phase_peaks[top]["peak"], phase_peaks[top]["at_peak"], top
    else:
        peak = t["peak_bytes"]
    terms: dict[str, _overheads.Term] = {}
    if profile is not None:
        # The budget is the capacity CUDA reports; what the GPU adds to the traced tensors is named in `overheads`.
        calibrated = (_overheads.load_profile(profile["key"]) if calibration is True
                      else calibration or None)  # False: the uncalibrated terms; a dict: that profile
        budget = budget_bytes or (calibrated or {}).get("capacity_bytes") or profile["capacity_bytes"]
        terms = _overheads.terms(profile, plan, t["trainable_shapes"], int(peak), t.get("frozen16", ()),
                                 transformers_model=type(cfg).__module__.startswith("transformers"),
                                 calibrated=calibrated)
        notes.append(f"budget {fmt_bytes(budget)}: the capacity CUDA reports on a {profile['name']} "
                     f"(nvidia-smi shows {profile['total_bytes'] // 2**20} MiB); {profile['source']}"
                     + (f"; calibrated profile from {calibrated.get('date')}" if calibrated else ""))
    else:
        budget = budget_bytes or _budget_bytes()
    extra, uncertainty = _overheads.total(terms)
    out = {"model": model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom"),
           "plan": str(sharded_plan), "batch": batch, "world_size": world_size, "seq": seq, "device": "cpu" if profile is None else gpu,
           # zero:N: batch is one rank's micro-batch and every byte figure one rank's
           "global_batch": batch * world_size if zero is not None else batch, "per_rank": zero is not None,
           "params": t["params"], "trainable_params": t["trainable_params"], "peak_bytes": int(peak),
           "breakdown": {c: int(br[c]) for c in CATEGORIES}, "at_peak": {c: int(at[c]) for c in CATEGORIES},
           "peak_phase": t["peak_phase"], "host_bytes": int(host), "budget_bytes": int(budget),
           "disk_bytes": int(disk_bytes), "phase_peaks": phase_peaks, "notes": notes}
    if profile is not None:
        out["overheads"] = {k: v.nbytes for k, v in terms.items()}
        out["overhead_terms"] = {k: v.as_dict() for k, v in terms.items()}
    if slack := t.get("collective_slack", 0):  # zero:2/3: run-to-run, not in the peak (see shard_trace)
        uncertainty += slack
        out["collective_slack_bytes"] = int(slack)
        notes.append(f"zero:{zero}: a rank's peak can be up to {fmt_bytes(slack)} higher run to run (an all-gather and a "
                     "reduce-scatter buffer of the largest unit that the communication thread frees late); "
                     "counted in the verdict's uncertainty")
    # Every resource the plan uses, judged on its own; the worst one decides the verdict. On a GPU the
    # device needs the traced peak plus the overheads, within the overheads' uncertainty (and the late collectives').
    resources = {"device": {"need": int(peak) + extra, "budget": int(budget), "uncertainty": uncertainty}}
    if profile is not None and host:
        resources["host"] = {"need": int(host), "budget": int(profile["host_ram_bytes"]), "uncertainty": 0}
    if profile is not None:  # the model is built in fp32 on the GPU before any technique shrinks it
        # zero:2/3 build on the meta device (or in host RAM) and shard before the GPU holds weights
        build = 0 if (zero or 0) > 1 else _build_bytes(model_fn, plan, t["params"])
        if build:
            fixed = sum(v.nbytes for v in terms.values() if not v.scales)
            out["build_bytes"] = build
            resources["build"] = {"need": build + fixed, "budget": int(budget), "uncertainty": uncertainty}
            notes.append(f"build: colabkit builds the model in fp32 on the GPU ({fmt_bytes(build)}) before "
                         f"{'quantizing it' if 'qlora' in plan else 'the plan shrinks it'}; judged as its own resource")
    if disk_bytes:
        free = profile.get("disk_bytes") if profile is not None else shutil.disk_usage(offload_dir()).free
        resources["disk"] = {"need": int(disk_bytes), "budget": int(free or 0),
                             "uncertainty": 0}
    out.update(verdict(resources))
    out.update(speed_of(out, counts, profile, calibration))
    if isinstance(model_fn, str) and (note := preset_vs_hub(model_fn)):
        notes.append(note)
    if cfg is not None and hasattr(cfg, "n_layer"):
        a = analytic(cfg, plan, batch, seq, t["trainable_params"], t.get("trainable_shapes"))
        a["error_vs_trace"] = (a["total"] - peak) / peak
        out["analytic"] = a
    return out


# GPT presets named after hub models: what differs from the model the name suggests (issue 19).
PRESET_HUB = {"gpt2-124m": "gpt2", "gpt2-350m": "gpt2-medium", "gpt2-774m": "gpt2-large", "gpt2-1.5b": "gpt2-xl"}


def preset_vs_hub(name: str) -> str | None:
    """How a ``gpt2-*`` preset differs from the hub model its name suggests (dropout, vocabulary, context).

    >>> "dropout" in preset_vs_hub("gpt2-124m")
    True
    """
    if name not in PRESET_HUB:
        return None
    shipped = os.path.join(HUB_CONFIG_DIR, HUB_ALIASES.get(PRESET_HUB[name], PRESET_HUB[name]).replace("/", "__") + ".json")
    try:  # the shipped config's three fields, read without importing transformers (seconds per process)
        with open(shipped) as f:
            hub = types.SimpleNamespace(**json.load(f))
    except OSError:
        try:
            hub = hub_config(PRESET_HUB[name])
        except (ImportError, OSError):
            return None
    cfg = gpt_config(name)
    diffs = []
    hub_drop = max(hub.resid_pdrop, hub.embd_pdrop, hub.attn_pdrop)
    if cfg.dropout != hub_drop:
        diffs.append(f"dropout {cfg.dropout:g} (the hub model trains with {hub_drop:g}: a T4 keeps dropout masks for "
                     f"the residual and MLP dropouts; its attention kernel keeps none)")
    if cfg.vocab_size != hub.vocab_size:
        diffs.append(f"vocabulary {cfg.vocab_size} vs {hub.vocab_size}")
    if cfg.block_size != hub.n_positions:
        diffs.append(f"context {cfg.block_size} vs {hub.n_positions}")
    if not diffs:
        return None
    return f"preset {name} vs hf:{PRESET_HUB[name]}: " + "; ".join(diffs) + f" -- estimate hf:{PRESET_HUB[name]} for the hub model"


def _shard(t: dict[str, Any], stage: int | None, world_size: int, half: bool = False) -> None:
    """One rank of a sharded run (:func:`.zero.shard_trace`), so the rest of :func:`estimate` sees one rank."""
    shard_trace(t, stage, world_size, half)


def _disk_split(t: dict[str, Any], notes: list[str], gpu: bool) -> int:
    """``offload:disk``: the traced AdamW state goes to the state file; on a GPU, RAM (pinned) and per chunk
    the GPU keep :class:`~colabkit.techniques.disk_offload.DiskAdamW`'s two chunk buffers; on a CPU the
    update runs in place on the file's mapped pages (no tensor: page cache, kept mapped while the file takes
    at most 1/``RESIDENT_SHARE`` of the available RAM, else two chunks at a time). Returns the file's bytes."""
    shapes = t["trainable_shapes"]
    n = sum(math.prod(s) for s in shapes)
    window = ram_window_bytes(shapes)  # two chunks of (exp_avg, exp_avg_sq), fp32
    buffers = window if gpu else 0
    for d in [t["breakdown"], t["at_peak"]] + [v[k] for v in t["phase_peaks"].values() for k in ("own", "at_peak")]:
        d["optimizer"] = min(d["optimizer"], buffers)
    for v in t["phase_peaks"].values():
        v["peak"] = sum(v["at_peak"].values())
    t["peak_bytes"] = sum(t["at_peak"].values())
    file_bytes = disk_state_bytes(n)
    notes.append(f"offload:disk: AdamW state in a memory-mapped file ({fmt_bytes(file_bytes)}, 8 B/param); "
                 + (f"RAM keeps two chunk buffers ({fmt_bytes(window)})" if gpu else
                    f"updated in place on its mapped pages (page cache, no anonymous copy): kept mapped while it takes "
                    f"at most 1/{RESIDENT_SHARE} of the available RAM, else at most two chunks ({fmt_bytes(window)}) "
                    "at a time"))
    return file_bytes


def _build_bytes(model_fn: Any, plan: Plan, params: int) -> int:
    """Device bytes of the model as colabkit builds it for ``plan`` before applying it: fp32 on the GPU,
    except where it never exists in fp32 -- ``qlora`` with an ``hf:<id>`` model loads straight into 4-bit,
    and ``lora``/``qlora`` on GPT presets, ``gpt:``/``llama:`` shapes are built on the meta device and
    materialised layer by layer into NF4 / 16 bits (colabkit.techniques.lora), so the step's own
    parameter bytes are the build's too (0: nothing beyond the step)."""
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "")  # planner/scale: the shape's name
    if "qlora" in plan and name.startswith("hf:"):
        return 0
    if ("lora" in plan or "qlora" in plan) and not name.startswith("hf:") and name:
        return 0
    return 4 * params


VERDICTS = ("fits", "tight", "does not fit")


def verdict(resources: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Judge each resource ``{"need", "budget", "uncertainty"}`` (bytes): ``fits`` when need plus its
    uncertainty is within budget, ``tight`` when only need is, else ``does not fit``. The worst
    resource decides (``decided_by``); ``margin_bytes`` is its budget minus need.

    >>> v = verdict({"device": {"need": 9, "budget": 10, "uncertainty": 2}, "host": {"need": 1, "budget": 10, "uncertainty": 0}})
    >>> v["verdict"], v["decided_by"], v["margin_bytes"], v["fits"]
    ('tight', 'device', 1, True)
    """
    judged = {}
    for name, r in resources.items():
        margin = r["budget"] - r["need"]
        judged[name] = dict(r, margin=margin, verdict=VERDICTS[0] if margin >= r.get("uncertainty", 0)
                            else VERDICTS[1] if margin >= 0 else VERDICTS[2])
    worst = max(judged, key=lambda n: (VERDICTS.index(judged[n]["verdict"]), -judged[n]["margin"]))
    w = judged[worst]
    return {"resources": judged, "verdict": w["verdict"], "decided_by": worst, "margin_bytes": int(w["margin"]),
            "fits": w["verdict"] != VERDICTS[2]}


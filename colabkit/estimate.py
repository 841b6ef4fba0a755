"""Will it fit? Predict the peak memory of a whole training step without allocating it.

:func:`estimate` runs the real :class:`~colabkit.train.Trainer` for two optimizer steps (the second
one has the optimizer state live, like ``bench``) under ``FakeTensorMode`` with a
:class:`~colabkit.memory.MemoryTracker` inside: every op runs on shapes only, so a 20B model is
estimated on a laptop CPU, and every technique that is plain torch is covered without a special case.
What cannot run on fake tensors is substituted from the technique's own theory and listed in
``notes``. Next to the traced figure it shows the textbook formula, so you see where that is off.

:func:`plans` ranks the plans that fit by a stated step-time cost model; :func:`largest` searches
the largest GPT-2-shaped model that fits a plan.

>>> r = estimate("gpt-tiny", "baseline", batch=2, seq=16, device="cpu")
>>> r["breakdown"]["params"] == 4 * r["params"], r["fits"]
(True, True)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .env import GPU_PROFILES, budget_bytes as _budget_bytes, env as _env_report, t4_rules
from .memory import CATEGORIES, MemoryTracker, fmt_bytes
from .models import GPT, GPT2_VOCAB, GPTConfig, build_model, count_params, gpt_config
from .plan import REGISTRY, Plan, PlanError
from .train import Trainer

GiB = 1024**3
# The CUDA caching allocator hands out blocks in multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize), so on a GPU profile every storage is rounded up to 512 B.
CUDA_ALLOC_ROUND = 512
# Tokens whose effect is a GPU/host split: traced without them on the CPU, applied analytically here.
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
    from .plan import Context

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


# ----- the textbook formula, shown next to the trace -------------------------------------------
def analytic(cfg: Any, plan: Plan | str, batch: int, seq: int, trainable_params: int | None = None) -> dict[str, Any]:
    """Bytes per parameter for the plan and activations ~ s*b*h*(34 + 5*a*s/h) per layer
    (Korthikanti et al. 2022, 2-byte activations; x2 in fp32; the 5*a*s/h attention-matrix term is
    gone with a fused SDPA kernel; ``checkpoint`` keeps 2*s*b*h per layer plus one layer recomputed).

    >>> a = analytic(gpt_config("gpt2-124m"), "baseline", 1, 1024)
    >>> a["bytes_per_param"]
    16.0
    """
    plan = Plan.parse(plan)
    from .techniques.optimizers import state_bytes_per_param

    n = cfg.n_params if hasattr(cfg, "n_params") else trainable_params or 0
    trainable = trainable_params if trainable_params is not None else n
    opt = state_bytes_per_param(plan.optimizer_token) if plan.optimizer in REGISTRY else 8.0
    half = "fp16" in plan or "bf16" in plan
    b = batch // plan.get("accum", 1) or 1
    s, h, L, a, V = seq, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size
    scale = 1.0 if half else 2.0  # the formula counts 2-byte activations
    per_layer = s * b * h * 34 * scale  # fused attention: no S x S term
    formula = "s*b*h*34" + ("" if half else " x2 (fp32)")
    if "attention" in plan and plan.get("attention") == "math":
        per_layer += s * b * h * 5 * a * s / h * scale
        formula = "s*b*h*(34 + 5*a*s/h)" + ("" if half else " x2 (fp32)")
    every = plan.get("checkpoint")
    if every:
        every = 1 if every is True else int(every)
        acts = (L / every) * 2 * s * b * h * scale + per_layer + (L - L / every) * per_layer
        formula += "; checkpoint: 2*s*b*h per checkpointed layer + 1 layer recomputed"
    else:
        acts = L * per_layer
    logits = b * s * V * (2 + 4 + 4 if half else 4 + 4)  # logits, fp32 copy for the loss, its grad
    weights = 4 * n + (2 * n if half else 0)  # fp32 master (+ autocast's fp16 copies)
    grads = 4 * trainable
    state = opt * trainable
    offload = plan.get("offload") or ()
    if "optimizer" in offload:  # state on the host; gradients leave one at a time
        state, grads = 0, 4 * V * h
    if "params" in offload:  # two blocks' weights on the GPU
        weights = weights * min(1.0, 2 / L)
    if "activations" in offload:
        acts = acts / L
    if "fused-step" in plan:  # gradients never coexist: about the largest matrix (the embedding)
        grads = 4 * V * h
    total = weights + grads + state + acts + logits
    return {"bytes_per_param": (weights + grads + state) / max(n, 1), "weights": weights, "grads": grads,
            "optimizer": state, "activations": acts + logits, "activations_per_layer": per_layer,
            "activation_formula": formula, "total": total}


def _host_split(br: dict[str, int], at: dict[str, int], offload: frozenset, trainable_shapes: list, L: int,
                notes: list[str]) -> tuple[dict, dict, int]:
    """Move offloaded categories to host RAM: what the GPU keeps is one staging tensor (optimizer),
    two blocks of weights (params: current + prefetch), one block of saved activations."""
    br, at, host = dict(br), dict(at), 0
    biggest = 4 * max((math.prod(s) for s in trainable_shapes), default=0)
    n_train = sum(math.prod(s) for s in trainable_shapes)
    for what in sorted(offload):
        cat = {"optimizer": "optimizer", "params": "params", "activations": "activations"}[what]
        keep = {"optimizer": 0, "params": br["params"] * min(1.0, 2 / max(L, 1)),
                "activations": br["activations"] / max(L, 1)}[what]
        moved = br[cat] - int(keep)
        host += moved
        at[cat] = max(0, at[cat] - moved)
        br[cat] = int(keep)
        extra = ""
        if what == "optimizer":  # HostOptimizer: fp32 master + gradient buffer on the host; each gradient
            host += 8 * n_train  # leaves the GPU as soon as it is complete (about one tensor at a time)
            at["grads"], br["grads"] = min(at["grads"], biggest), min(br["grads"], biggest)
            extra = f"; host also holds fp32 master weights and gradient buffers ({fmt_bytes(8 * n_train)})"
        notes.append(f"offload:{what}: {fmt_bytes(moved)} moved to host RAM (GPU keeps {fmt_bytes(keep)}){extra}")
    return br, at, host


def estimate(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str = "baseline", batch: int = 8,
             seq: int = 128, gpu: str | None = "t4", device: str | None = None, steps: int = 2,
             budget_bytes: int | None = None) -> dict[str, Any]:
    """Predicted peak and per-category breakdown of a training run, on a GPU profile or on the CPU.

    ``device="cpu"`` predicts a CPU ``bench`` run (what CI checks); ``gpu="t4"`` predicts a T4:
    the plan is validated as on a T4 (no bf16), traced on the CPU (same graph), storages rounded to
    the CUDA allocator's 512 B, offload tokens move state to ``host_bytes``, and ``fits`` compares the
    peak with the T4's usable bytes (15360 MiB minus the CUDA context ~0.4 GiB and allocator slack).

    >>> r = estimate("gpt-tiny", "checkpoint" if "checkpoint" in REGISTRY else "baseline", 2, 16)
    >>> r["peak_bytes"] < r["budget_bytes"]
    True
    """
    profile = _profile(gpu, device)
    plan = Plan.parse(plan)
    notes: list[str] = []
    with _as_t4(profile):
        traced_plan, offload = _split_gpu_tokens(plan, profile)
        if profile is not None:
            check_as_gpu(plan)
        t = _trace_with_substitutes(model_fn, traced_plan, batch, seq, steps,
                                    CUDA_ALLOC_ROUND if profile else 1, notes)
    br, at = t["breakdown"], t["at_peak"]
    host = 0
    cfg = t["config"]
    if offload:
        br, at, host = _host_split(br, at, offload, t["trainable_shapes"], getattr(cfg, "n_layer", 1), notes)
        peak = sum(at.values())
    else:
        peak = t["peak_bytes"]
    if profile is not None:
        budget = budget_bytes or profile["usable_bytes"]
        notes.append(f"budget {fmt_bytes(budget)}: {profile['name']} shows {profile['total_bytes'] // 2**20} MiB; "
                     f"usable = total minus CUDA context and allocator slack ({profile['source']})")
    else:
        budget = budget_bytes or _budget_bytes()
    out = {"model": model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom"),
           "plan": str(plan), "batch": batch, "seq": seq, "device": "cpu" if profile is None else gpu,
           "params": t["params"], "trainable_params": t["trainable_params"], "peak_bytes": int(peak),
           "breakdown": {c: int(br[c]) for c in CATEGORIES}, "at_peak": {c: int(at[c]) for c in CATEGORIES},
           "peak_phase": t["peak_phase"], "host_bytes": int(host), "budget_bytes": int(budget),
           "fits": bool(peak <= budget), "notes": notes}
    if cfg is not None and hasattr(cfg, "n_layer"):
        a = analytic(cfg, plan, batch, seq, t["trainable_params"])
        a["error_vs_trace"] = (a["total"] - peak) / peak
        out["analytic"] = a
    return out


def _trace_with_substitutes(model_fn, plan: Plan, batch: int, seq: int, steps: int, alloc_round: int,
                            notes: list[str]) -> dict[str, Any]:
    """Trace the plan; if its optimizer cannot run on fake tensors, trace with a stateless SGD in its
    place and add the optimizer's state from its formula (``state_bytes_per_param``)."""
    try:
        return trace(model_fn, plan, batch, seq, steps, alloc_round)
    except PlanError:
        raise
    except Exception as err:  # noqa: BLE001  (a kernel that reads data pointers, e.g. through ctypes)
        if "qlora" in plan:  # bitsandbytes' Params4bit cannot wrap a fake tensor: trace lora, swap the base
            from .techniques.lora import nf4_bytes

            stand_in = Plan.parse(["lora" + t[len("qlora"):] if t.startswith("qlora") else t for t in plan.tokens])
            t = _trace_with_substitutes(model_fn, stand_in, batch, seq, steps, alloc_round, notes)
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
        from .techniques.optimizers import state_bytes_per_param

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


# ----- the planner ---------------------------------------------------------------------------
# Step-time cost model, as a fraction of the plain step's compute (sources in brackets):
COST = {
    "checkpoint": 0.33,   # one more forward = 1/3 of forward+backward FLOPs [Chen et al. 2016]
    "adamw8bit": 0.05,    # blockwise 8-bit update; bitsandbytes reports parity to a few % [Dettmers 2022]
    "paged-adamw8bit": 0.05,
    "adamw4bit": 0.10,    # assumed: pure-torch quantize/dequantize of both moments each step
    "lion8bit": 0.05, "lion": 0.0, "adafactor": 0.05, "sgd": 0.0, "adamw": 0.0,
    "fused-step": 0.02,   # assumed: per-parameter step launches inside backward
    "compress": 0.10,     # assumed: quantize on save, dequantize on use
    "accum": 0.02,        # per extra micro-batch: launch overhead, smaller matmuls
    "fp16": -0.40,        # T4 tensor cores: 65 vs 8.1 TFLOPS peak; ~1.5-2x in practice [Micikevicius 2018]
}
PCIE_BYTES_PER_S = 12e9   # T4: PCIe 3.0 x16, 15.75 GB/s theoretical, ~12 GB/s pinned copies
HOST_BYTES_PER_S = 5e9    # assumed: a 2-vCPU Colab host streaming AdamW's 32 B/param (read + write)
T4_FLOPS = {"fp32": 8.1e12 * 0.5, "fp16": 65e12 * 0.25}  # peak x assumed utilisation


def step_time(result: dict[str, Any]) -> float:
    """Predicted seconds per optimizer step on a T4: 6*N*tokens FLOPs at an assumed utilisation, the
    cost-model fractions above, PCIe transfers for offload (optimizer: gradients down + weights up,
    8 B/param; params: fetched in forward and backward; activations: down and up) and the host's step."""
    plan = Plan.parse(result["plan"])
    tokens = result["batch"] * result["seq"]
    base = 6 * result["params"] * tokens / T4_FLOPS["fp32"]
    t = base
    for name, value in plan.values:
        if name == "accum":
            t += base * COST["accum"] * (value - 1)
        elif name == "checkpoint":
            t += base * COST["checkpoint"] / (1 if value is True else int(value))
        elif name in COST:
            t += base * COST[name]
    t += base * COST.get(plan.optimizer, 0.0) * (plan.optimizer not in dict(plan.values))
    offload = plan.get("offload") or ()
    n = result.get("trainable_params") or result["params"]
    moved = (8 * n if "optimizer" in offload else 0) + 2 * result.get("host_bytes", 0) * (
        ("params" in offload) + ("activations" in offload)) / max(1, len(offload))
    host_step = 32 * n / HOST_BYTES_PER_S if "optimizer" in offload else 0.0
    return t + moved / PCIE_BYTES_PER_S + host_step


def candidate_plans(profile: str | None = "t4") -> list[str]:
    """Combinations of precision x checkpoint x optimizer x fused-step x offload that the registry has."""
    pick = lambda *toks: [t for t in toks if t == "" or t.split(":")[0] in REGISTRY]  # noqa: E731
    out = []
    for prec in pick("", "fp16"):
        for ck in pick("", "checkpoint"):
            for opt in pick("", "adamw8bit", "adamw4bit"):
                for fused in pick("", "fused-step"):
                    for off in (pick("", "offload:optimizer") if profile else [""]):
                        toks = [t for t in (prec, ck, opt, fused, off) if t]
                        try:
                            p = Plan.parse(toks or "baseline")
                            with _as_t4(GPU_PROFILES.get(profile or "")):
                                if profile:
                                    check_as_gpu(p)
                                else:
                                    from .plan import Context

                                    p.check(Context(device=torch.device("cpu")))
                        except PlanError:
                            continue
                        out.append(str(p))
    return out


def plans(model_fn, batch: int = 1, seq: int = 1024, gpu: str | None = "t4", device: str | None = None,
          candidates: Iterable[str] | None = None, budget_bytes: int | None = None) -> list[dict[str, Any]]:
    """Estimate every candidate plan; the ones that fit come first, cheapest step first.

    >>> ranked = plans("gpt-tiny", batch=2, seq=16, candidates=["baseline"])
    >>> ranked[0]["fits"], ranked[0]["overhead"]
    (True, 0.0)
    """
    rows = []
    cfg = None
    if isinstance(model_fn, str):
        try:
            cfg = gpt_config(model_fn)
            cfg = replace(cfg, block_size=max(cfg.block_size, seq))
        except ValueError:  # another family: traced whole
            cfg = None
    for p in candidates or candidate_plans(None if device == "cpu" else gpu):
        try:
            r = (_fast_estimate(cfg, p, batch, seq, gpu, device, budget_bytes) if cfg is not None
                 else estimate(model_fn, p, batch=batch, seq=seq, gpu=gpu, device=device, budget_bytes=budget_bytes))
            r["plan"] = p
        except PlanError as e:
            rows.append({"plan": p, "fits": False, "error": str(e), "peak_bytes": None, "overhead": None})
            continue
        r["step_time_s"] = step_time(r)
        rows.append(r)
    ok = [r for r in rows if r.get("step_time_s") is not None]
    base = next((r["step_time_s"] for r in ok if r["plan"] == "baseline"),
                6 * ok[0]["params"] * batch * seq / T4_FLOPS["fp32"] if ok else 1.0)
    for r in ok:
        r["overhead"] = r["step_time_s"] / base - 1
    return sorted(rows, key=lambda r: (not r["fits"], r["overhead"] if r["overhead"] is not None else 9e9))


def pareto(rows: list[dict[str, Any]], ax=None, budget_bytes: int | None = None):
    """Memory vs step-time overhead of each plan, the Pareto front joined, the budget as a line."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    pts = [(r["peak_bytes"] / GiB, r["overhead"], r["plan"], r["fits"]) for r in rows if r.get("peak_bytes")]
    for m, o, name, fits in pts:
        ax.scatter(o * 100, m, color="tab:green" if fits else "tab:red")
        ax.annotate(name, (o * 100, m), fontsize=7)
    front, best = [], float("inf")
    for m, o, _, _ in sorted(pts, key=lambda p: (p[1], p[0])):
        if m < best:
            front.append((o * 100, m))
            best = m
    if front:
        ax.plot(*zip(*front), "k--", lw=1, label="Pareto front")
    if budget_bytes:
        ax.axhline(budget_bytes / GiB, color="gray", ls=":", label="budget")
    ax.set_xlabel("predicted step-time overhead vs baseline (%)")
    ax.set_ylabel("predicted peak (GiB)")
    ax.legend(fontsize=8)
    return ax


# ----- the largest model that fits ------------------------------------------------------------
def gpt2_shape(n_embd: int, vocab: int = GPT2_VOCAB, block: int = 1024) -> GPTConfig:
    """A GPT-2-family shape for a width: depth grows with width like 124M (12x768) .. 1.5B (48x1600)
    .. GPT-3 2.7B (32x2560) — here L = round(n_embd / 64 * 0.75) clamped to [12, 48] — 64-wide heads."""
    L = max(12, min(48, round(n_embd / 64 * 0.75)))
    return GPTConfig(n_layer=L, n_embd=n_embd, n_head=max(1, n_embd // 64), vocab_size=vocab, block_size=block)


def _fast_estimate(cfg: GPTConfig, plan: str, batch: int, seq: int, gpu: str | None, device: str | None,
                   budget_bytes: int | None = None) -> dict:
    """Estimate a deep GPT from traces at depth 1 and 2: every block is the same, so peak bytes are
    affine in depth; the extrapolation is checked against a full trace by the tests."""
    def fn(L):
        c = replace(cfg, n_layer=L)
        f = lambda: GPT(c)  # noqa: E731
        f.__name__ = f"gpt:{L}x{cfg.n_embd}:v{cfg.vocab_size}"
        return estimate(f, plan, batch=batch, seq=seq, gpu=gpu, device=device, budget_bytes=budget_bytes)
    r1, r2 = fn(1), fn(2)
    L = cfg.n_layer
    lin = lambda a, b: int(a + (b - a) * (L - 1))  # noqa: E731
    out = dict(r2)
    out["peak_bytes"] = lin(r1["peak_bytes"], r2["peak_bytes"])
    out["breakdown"] = {c: lin(r1["breakdown"][c], r2["breakdown"][c]) for c in CATEGORIES}
    out["at_peak"] = {c: lin(r1["at_peak"][c], r2["at_peak"][c]) for c in CATEGORIES}
    out["host_bytes"] = lin(r1["host_bytes"], r2["host_bytes"])
    out["params"], out["trainable_params"] = cfg.n_params, lin(r1["trainable_params"], r2["trainable_params"])
    out["fits"] = out["peak_bytes"] <= out["budget_bytes"]
    out["model"] = f"gpt:{L}x{cfg.n_embd}:v{cfg.vocab_size}"
    return out


def largest(plan: Plan | str = "baseline", seq: int = 1024, batch: int = 1, gpu: str | None = "t4",
            device: str | None = None, vocab: int = GPT2_VOCAB) -> dict[str, Any]:
    """The largest GPT-2-shaped model (:func:`gpt2_shape`, widths in steps of 64) whose estimated
    peak fits the budget under ``plan``: a bisection over widths with the estimator.

    >>> largest("baseline", seq=64, gpu="t4")["params"] > 1e8
    True
    """
    plan = str(Plan.parse(plan))
    cache: dict[int, dict] = {}

    def at(width: int) -> dict:
        if width not in cache:
            cache[width] = _fast_estimate(gpt2_shape(width, vocab, max(seq, 1024)), plan, batch, seq, gpu, device)
        return cache[width]

    lo, hi = 1, 2  # in units of 64: find hi that does not fit
    if not at(64 * lo)["fits"]:
        r = at(64 * lo)
        return {"params": 0, "model": None, "peak_bytes": r["peak_bytes"], "budget_bytes": r["budget_bytes"],
                "plan": plan, "note": f"even {r['model']} does not fit"}
    while at(64 * hi)["fits"]:
        lo, hi = hi, hi * 2
        if hi > 1024:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(64 * mid)["fits"] else (lo, mid)
    r = at(64 * lo)
    return {"params": r["params"], "model": r["model"], "peak_bytes": r["peak_bytes"],
            "budget_bytes": r["budget_bytes"], "plan": plan, "host_bytes": r["host_bytes"]}


# ----- CLI -----------------------------------------------------------------------------------
def _table(r: dict) -> str:
    lines = [f"{r['model']}  plan {r['plan']}  batch {r['batch']}  seq {r['seq']}  on {r['device']}",
             f"predicted peak {fmt_bytes(r['peak_bytes'])} of {fmt_bytes(r['budget_bytes'])}: "
             + ("fits" if r["fits"] else "DOES NOT FIT") + f"   host RAM {fmt_bytes(r['host_bytes'])}",
             f"{'category':<12} {'own peak':>10} {'at peak':>10}"]
    lines += [f"{c:<12} {fmt_bytes(r['breakdown'][c]):>10} {fmt_bytes(r['at_peak'][c]):>10}" for c in CATEGORIES]
    if "analytic" in r:
        a = r["analytic"]
        lines.append(f"formula: {a['bytes_per_param']:.1f} B/param + activations {a['activation_formula']} "
                     f"= {fmt_bytes(a['total'])} ({a['error_vs_trace']:+.0%} vs the trace)")
    return "\n".join(lines + r["notes"])


def _args(p, plan=True, model=True) -> None:
    if model:
        p.add_argument("--model", default="gpt2-124m")
    if plan:
        p.add_argument("--plan", default="baseline")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--gpu", default="t4")
    p.add_argument("--device", default=None, choices=["cpu"])


def register_cli(subcommand) -> None:
    """Add the ``estimate``, ``plan`` and ``largest`` subcommands with the CLI's ``subcommand`` decorator
    (called by ``colabkit.__main__.main``; importing the CLI from here would load it twice under -m)."""

    @subcommand("estimate", "predicted peak memory of a run, without allocating it", _args, _table)
    def _estimate(args):
        return estimate(args.model, args.plan, batch=args.batch, seq=args.seq, gpu=args.gpu, device=args.device)

    def plan_args(p):
        _args(p, plan=False)
        p.add_argument("--chart", default=None, metavar="PNG", help="save the Pareto chart (memory vs overhead)")

    @subcommand("plan", "the plans that fit, cheapest step first", plan_args,
                lambda rows: "\n".join(f"{'fits' if r['fits'] else 'no  '} {fmt_bytes(r['peak_bytes']):>10} "
                                       f"{(r['overhead'] or 0):+7.0%}  {r['plan']}" for r in rows))
    def _plan(args):
        rows = plans(args.model, args.batch, args.seq, args.gpu, args.device)
        if args.chart:
            import matplotlib

            matplotlib.use("Agg")
            ax = pareto(rows, budget_bytes=next((r["budget_bytes"] for r in rows if r.get("budget_bytes")), None))
            ax.figure.savefig(args.chart, dpi=120, bbox_inches="tight")
        return [{k: r.get(k) for k in ("plan", "fits", "peak_bytes", "host_bytes", "overhead", "step_time_s",
                                       "breakdown", "error")} for r in rows]

    @subcommand("largest", "the largest GPT-shaped model that fits a plan", lambda p: _args(p, model=False),
                lambda r: f"{r['model']}: {r['params'] / 1e9:.2f}B params, peak {fmt_bytes(r['peak_bytes'])} "
                          f"of {fmt_bytes(r['budget_bytes'])}")
    def _largest(args):
        return largest(args.plan, seq=args.seq, batch=args.batch, gpu=args.gpu, device=args.device)


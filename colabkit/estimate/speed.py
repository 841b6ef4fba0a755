"""Predicted step time: FLOPs from the fake-tensor step, bytes moved to the host and the disk, over a
device's achievable throughput and bandwidths.

:func:`count_flops` runs one real Trainer step on fake tensors under ``torch.utils.flop_counter``'s
``FlopCounterMode`` (matmuls and attention: what a transformer's time goes to; recomputation under
``checkpoint`` and the frozen base of ``lora`` are seen as they run). :func:`step_time` adds the optimizer
update (memory-bound: bytes read and written per trainable parameter over the device's bandwidth), the
PCIe traffic of ``offload:*`` and the disk traffic of ``offload:disk``, each over the figures of
:data:`THROUGHPUT` (datasheet peaks times an achievable fraction, each with its source) -- or over what
``colabkit calibrate`` measured when it stored ``speed`` in the profile. On a CPU the figures are measured
once (:func:`cpu_throughput`: a matmul, a tiny training step, copies), so the prediction can be checked
against real steps.

>>> f = count_flops("gpt-tiny", "baseline", 2, 16)["flops"]
>>> f > 0, count_flops("gpt-tiny", "checkpoint", 2, 16)["flops"] > f   # recomputation: one more forward
(True, True)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..data import TextData
from ..models import build_model
from ..plan import REGISTRY, Context, Plan
from ..techniques.lora import nf4_bytes
from ..techniques.optimizers import state_bytes_per_param
from ..timing import interleaved, ratio, time_fn
from ..trainer import Trainer
from . import overheads
from .counting import Traffic, affine, compute_plan, counting, sgd_plan, split_flops
from .quickfake import QuickFakeMode
from .trace import (DEPTHS, NO_FAKE_OPTIMIZERS, _build, _gpt_of, _HostScalars, _swap_by_data, _valueless_inits,
                    deep_model)

# Datasheet peaks (dense) x the fraction a training step reaches; sources per line. The fraction is the
# main uncertainty (UNCERTAINTY): real models run smaller matmuls and elementwise kernels the count omits.
THROUGHPUT: dict[str, dict[str, Any]] = {
    "t4": {"fp32": 8.1e12, "fp16": 65e12, "bf16": None, "mem_bw": 320e9, "pcie": 12e9, "disk": 150e6,
           "source": "NVIDIA T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS fp16 tensor cores, 320 GB/s GDDR6; PCIe 3.0 "
                     "x16 15.75 GB/s theoretical, ~12 GB/s pinned copies; Colab VM disk ~150 MB/s (assumed, "
                     "GCP persistent-disk class)"},
    "p100": {"fp32": 9.3e12, "fp16": 18.7e12, "bf16": None, "mem_bw": 732e9, "pcie": 12e9, "disk": 150e6,
             "source": "NVIDIA P100 PCIe datasheet: 9.3 TFLOPS fp32, 18.7 fp16 (no tensor cores), 732 GB/s; PCIe 3.0"},
    "l4": {"fp32": 30.3e12, "fp16": 121e12, "bf16": 121e12, "mem_bw": 300e9, "pcie": 25e9, "disk": 150e6,
           "source": "NVIDIA L4 datasheet: 30.3 TFLOPS fp32, 121 TFLOPS fp16/bf16 dense, 300 GB/s; PCIe 4.0 x16"},
    "a100": {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12, "mem_bw": 1555e9, "pcie": 25e9, "disk": 150e6,
             "source": "NVIDIA A100 datasheet (40 GB): 19.5 TFLOPS fp32, 312 fp16/bf16 dense, 1,555 GB/s; PCIe 4.0 x16"},
    "a100-80gb": {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12, "mem_bw": 2039e9, "pcie": 25e9, "disk": 1e9,
                  "source": "NVIDIA A100 datasheet (80 GB SXM): 19.5 TFLOPS fp32, 312 fp16/bf16 dense, 2,039 GB/s "
                            "HBM2e; PCIe 4.0 x16 31.5 GB/s theoretical, ~25 achievable; local NVMe ~1 GB/s (assumed)"},
    "h100": {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12, "mem_bw": 3350e9, "pcie": 50e9, "disk": 1e9,
             "source": "NVIDIA H100 SXM datasheet: 67 TFLOPS fp32, 989 fp16/bf16 dense, 3.35 TB/s HBM3; PCIe 5.0 "
                       "x16 63 GB/s theoretical, ~50 achievable; local NVMe ~1 GB/s (assumed)"},
}
THROUGHPUT["h200"] = {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12, "mem_bw": 4800e9, "pcie": 50e9, "disk": 1e9,
                      "source": "NVIDIA H200 SXM datasheet: 67 TFLOPS fp32, 989 fp16/bf16 dense (1,979 with sparsity), "
                                "4.8 TB/s HBM3e; PCIe 5.0 x16 63 GB/s theoretical, ~50 achievable; local NVMe ~1 GB/s (assumed)"}
THROUGHPUT["t4x2"] = THROUGHPUT["t4"]
THROUGHPUT["a100-40gb"] = THROUGHPUT["a100"]
THROUGHPUT["h100-80gb"] = THROUGHPUT["h100"]
# Achievable fraction of the peak in a training step (assumed: MFU of 30-50% is what well-tuned training
# reports on A100/H100 [PaLM 2022, Megatron-LM]; a T4 at 70 W throttles below its boost clock)
ACHIEVABLE = {"fp32": 0.6, "fp16": 0.35, "bf16": 0.4,
              # memory-bound kernels reach ~70% of the datasheet bandwidth: Jia et al. 2019, "Dissecting the NVidia
              # Turing T4 GPU via Microbenchmarking" (arXiv:1903.07486), measure ~220 GB/s of the T4's 320 GB/s
              # (assumed for the other GPUs too; HBM parts reach somewhat more)
              "mem_bw": 0.7}
UNCERTAINTY = 0.3  # +-30%: the achievable fraction's spread
# a 2-vCPU Colab host streaming AdamW's state through offload:optimizer's step (torch's fused AdamW, as the plan
# builds it): this project's 2-core VM measured 33-54 GB/s in wall time (4-64 M fp32 parameters at 28 B each,
# 2026-11-27), kept at the low end; 5 GB/s assumed before was an unfused AdamW's. calibrate measures a GPU host's own
HOST_BYTES_PER_S = 3e10

def _flops(model_fn: Callable | str, plan: str, batch: int, seq: int) -> tuple[int, int, int, int, tuple]:
    """(FLOPs, kernels launched, bytes of the non-matmul kernels, trainable parameters, those bytes by kernel
    size as (power of two, bytes) pairs) of one step, cached
    per model shape (a name, or a GPT config: the planner's builders are new functions for one shape). A GPT
    deeper than the trace's :data:`~.trace.DEPTHS` is counted at those depths and extrapolated: every block
    runs the same kernels, so each count is affine in depth (as the memory trace's phases are) -- exactly for
    FLOPs, kernels, bytes and parameters; the bytes by kernel size approximately (a kernel over all parameters,
    the fused optimizer's, moves to a larger size bucket with depth)."""
    cfg = _gpt_of(model_fn, seq)
    key = model_fn if isinstance(model_fn, str) else repr(cfg) if cfg is not None else model_fn
    deep = deep_model(model_fn, seq) if Plan.parse(plan).get("checkpoint") in (None, True) else None
    if deep is None:
        return _counted(key, model_fn, plan, batch, seq)
    L, at = deep
    d2, d3 = (_counted(b._colabkit_key, b, plan, batch, seq) for b in map(at, DEPTHS))
    return affine(d2, d3, L, DEPTHS)


_COUNTS: dict[tuple, tuple] = {}


def _counted(key: Any, model_fn: Callable | str, plan: str, batch: int, seq: int) -> tuple:
    """:func:`_flops` of one model as built, counted once per process (``key``: the cache's name for its
    shape; ``model_fn`` itself is not part of the key)."""
    k = (key, plan, batch, seq)
    if k not in _COUNTS:
        if len(_COUNTS) >= 256:
            _COUNTS.clear()
        _COUNTS[k] = _count(model_fn, plan, batch, seq)
    return _COUNTS[k]


def _count(model_fn: Callable | str, plan: str, batch: int, seq: int) -> tuple:
    with QuickFakeMode(allow_non_fake_inputs=True), _HostScalars(), _swap_by_data(), _valueless_inits():
        trainer = Trainer(_build(model_fn, seq), Plan.parse(plan), device="cpu")
        x = torch.randint(0, 256, (batch, seq))  # (B, S) ids: only shapes matter
        trainer.step(x, x)  # the first step also creates the optimizer's state: a later step is what repeats
        with counting() as c:
            trainer.step(x, x)
        return c.result(sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))


def count_flops(model_fn: Callable | str, plan: Plan | str, batch: int, seq: int, params: int | None = None,
                notes: list[str] | None = None, traced: dict[str, Any] | None = None) -> dict[str, Any]:
    """What one optimizer step runs, counted on fake tensors: ``flops`` (forward, backward, recomputation),
    ``kernels`` launched and ``kernel_bytes`` the non-matmul kernels move; cached per model, shape and the
    plan's compute tokens. An optimizer that cannot run on fake tensors (bitsandbytes) is counted as SGD plus
    its state read and written once (``state_bytes``); where the step cannot run at all, 6 x ``params`` x
    tokens FLOPs (Kaplan et al. 2020). Both are said in ``notes``. ``traced``: a memory trace
    (:func:`~.trace.trace`) whose step counted the same compute plan: its counts are taken, no step runs again."""
    plan = Plan.parse(plan)
    compute = compute_plan(plan)
    fake_ok = plan.optimizer not in NO_FAKE_OPTIMIZERS  # known not to run on fake tensors: not tried (nor imported)
    # ...unless the memory trace ran it (adamw8bit on colabkit's own kernel: substitutes.steps_own_8bit_kernel)
    fake_ok = fake_ok or (traced is not None and traced.get("counted_plan") == compute)
    why = "bitsandbytes kernels read tensor data"
    for want in ([compute] if fake_ok else []) + [sgd_plan(compute, plan.optimizer_token)]:
        try:
            if traced is not None and traced.get("counts") is not None and traced.get("counted_plan") == want:
                f, ops, nbytes, n, sizes = traced["counts"]
            else:
                f, ops, nbytes, n, sizes = _flops(model_fn, want, batch, seq)
        except Exception as err:  # noqa: BLE001  (a kernel the fake tensors cannot run)
            why = type(err).__name__
            continue
        state = 0 if want == compute else int(2 * n * state_bytes_per_param(plan.optimizer_token))
        if state and notes is not None:
            notes.append(f"step time: {plan.optimizer_token} counted as SGD plus its state read and written ({why})")
        sizes, half, narrow = split_flops(sizes)
        return {"flops": f, "kernels": ops, "kernel_bytes": nbytes, "state_bytes": state, "kernel_sizes": sizes,
                "flops_fp16": half["fp16"], "flops_bf16": half["bf16"], "narrow_flops": narrow}
    if params is None:
        raise RuntimeError(f"the step of {plan} cannot be counted on fake tensors ({why})")
    if notes is not None:
        notes.append(f"step time: FLOPs from 6 x parameters x tokens ({why} under the counter)")
    return {"flops": 6 * params * batch * seq, "kernels": 0, "kernel_bytes": 0, "state_bytes": 0}


@functools.lru_cache(maxsize=1)
def cpu_throughput() -> dict[str, Any]:
    """This CPU's figures, measured once with :func:`colabkit.timing.time_fn` (process time: robust to other
    processes on a shared machine): matmul FLOP/s in fp32, fp16 and bf16 (256^3), and the cost of one small kernel in an eager
    training step (what a GPU's kernel launch is). Bandwidth: :func:`cpu_bandwidth`.

    The kernel's cost is taken from a training step of a tiny model (20 ``Linear(8, 8)`` + GELU, forward and
    backward) over the kernels :class:`~.counting.Traffic` counts in it -- not from a bare ``torch.add``: in a step
    each kernel also pays the Module call, autograd recording its node in forward and the engine running
    it in backward, ~8 us against ~1 us for a bare add on a 2-core Xeon (2026-11-26)."""
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm = time_fn(lambda: [a @ b for _ in range(8)], warmup=1, repeats=5).median / 8
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(20)])
    x = torch.randn(2, 8)  # (B, D): no kernel has work to speak of
    with Traffic() as kernels:
        layers(x).sum().backward()
    launch = time_fn(lambda: layers(x).sum().backward(), warmup=2, repeats=7).median / kernels.ops
    return {"fp32": 2 * n**3 / mm, "fp16": None, "bf16": None, "launch_s": launch, "pcie": None, "disk": None,
            "source": f"measured on this CPU: {n}x{n} fp32 matmul, fp16/bf16 against fp32 in a transformer block "
                      "(cpu_matmul_rate), a tiny model's training step per kernel, copies the size of the step's kernels"}


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@functools.lru_cache(maxsize=4)
def _block_slowdown(dtype: str) -> float:
    """How many times longer one frozen transformer block takes in ``dtype`` than in fp32 on this CPU, run
    forward and backward to its input (gpt:1x256 -- the width of colabkit's CPU bench model -- 4 x 128 tokens):
    what a lora base or an autocast step runs in 16 bits, elementwise kernels and attention included (a bare
    matmul overstates bf16: 2.1x fp32 on a 2-core EPYC with AVX512-BF16, 1.2-1.3x in the block; an Intel Xeon
    with AVX512-BF16 ran lora's bf16 base slower than fp32). The speed of 16-bit kernels against fp32 depends
    on the width (a CPU without native bf16 ran the block at 0.56x fp32 at width 128, 0.43x at 256, as its
    matmuls do). Both dtypes timed interleaved, five rounds: the median of the per-round ratios, so a burst of
    load on a shared machine hits both (3 rounds each, apart, moved the prediction of lora:8 by 20%)."""
    from ..models import GPT, blocks_of, gpt_config

    def runner(d: str):
        torch.manual_seed(0)
        block = blocks_of(GPT(gpt_config("gpt:1x256")))[0].to(_DTYPES[d]).requires_grad_(False)
        x = torch.randn(4, 128, 256, dtype=_DTYPES[d], requires_grad=True)  # (B, S, D)
        return lambda: block(x).sum().backward()

    return ratio(interleaved({d: runner(d) for d in ("fp32", dtype)}, warmup=1, repeats=5), dtype, "fp32")


@functools.lru_cache(maxsize=4)
def cpu_matmul_rate(dtype: str) -> float:
    """This CPU's matmul FLOP/s in ``dtype`` ("fp32", "fp16", "bf16"): fp32's measured rate, and a 16-bit one
    scaled by how much faster (or slower) a transformer block runs in it than in fp32 (:func:`_block_slowdown`),
    measured here on first use -- no CPU model assumed. ``step_time`` puts each counted matmul at the rate of
    the dtype it ran in."""
    rate = cpu_throughput()["fp32"]
    return rate if dtype == "fp32" else rate / _block_slowdown(dtype)


@functools.lru_cache(maxsize=256)
def cpu_narrow_rate(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of a narrow ``(m, k) @ (k, n)`` matmul (a side <= ``counting.NARROW``: a LoRA adapter, a
    projection to a low rank) on this CPU, timed at that shape (``m`` capped at 4096 rows: the rate no longer
    depends on it there). Such a matmul runs several times below the square rate of :func:`cpu_throughput`
    (512x256 @ 256x8: ~14 GFLOP/s against ~95 at 256^3 on a 2-core EPYC), and its orientation matters (the
    same FLOPs as 512x8 @ 8x256 run at ~50)."""
    m = min(m, 4096)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    reps = max(1, min(64, int(2e7 // max(1, 2 * m * k * n))))  # ~20 MFLOP a round: a few ms
    t = time_fn(lambda: [a @ b for _ in range(reps)], warmup=1, repeats=3).median / reps
    return 2 * m * k * n / t


@functools.lru_cache(maxsize=32)
def cpu_bandwidth(nbytes: int) -> float:
    """Bytes/s of a copy of ``nbytes`` on this CPU (read + write): a CPU's bandwidth depends on which cache
    holds the data, so it is measured at the size of the step's average kernel (a power of two)."""
    src = torch.randn(max(1024, nbytes // 4))
    dst = torch.empty_like(src)
    reps = max(1, (64 << 20) // src.nbytes)
    t = time_fn(lambda: [dst.copy_(src) for _ in range(reps)], warmup=1, repeats=5).median / reps
    return 2 * src.nbytes / t


def throughput(gpu: str | None, calibrated: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """(figures, achievable fractions) for a GPU profile key, or the measured CPU (``gpu=None``);
    a calibrated profile's ``speed`` entries replace the datasheet's (measured: fraction 1)."""
    if gpu is None:
        return cpu_throughput(), {"fp32": 1.0}
    figs, frac = dict(THROUGHPUT[gpu]), dict(ACHIEVABLE)
    figs.setdefault("launch_s", LAUNCH_S)
    measured = (calibrated or {}).get("speed") or {}
    for k, v in measured.items():
        figs[k] = v
        frac[k] = 1.0
    if measured:
        figs["source"] = f"calibrated on this GPU ({', '.join(sorted(measured))}); datasheet for the rest"
    return figs, frac


LAUNCH_S = 5e-6  # a CUDA kernel launch from eager PyTorch, ~5 us (assumed; NVIDIA quotes 2-10 us)
# Launch-bound steps: two tiny models whose kernels, not their FLOPs, take the time on a GPU (model, batch, seq)
HOST_MODELS = (("gpt:1x32", 1, 16), ("gpt:3x32", 1, 16))  # not the selftest's 4 blocks: predicted, not fitted


def measure_host(device: str | torch.device, models=HOST_MODELS) -> list[dict[str, Any]]:
    """Per tiny model: the kernels :func:`count_flops` counts in its ``baseline`` step and the step's time
    through the :class:`~colabkit.trainer.Trainer` (untracked, warmed up, interleaved, median of 9). What a GPU
    step pays besides its kernels' work: Python, the dispatcher, autograd, the optimizer's loop, the launches,
    the loss read back. An H200 ran a 160-kernel step of gpt:4x256 in 11 ms against 1.4 ms predicted with an
    assumed 5 us a launch (2026-11-27). The same code runs on a CPU (the twin of the GPU's measurement)."""
    steps = {}
    for model, batch, seq in models:
        torch.manual_seed(0)
        t = Trainer(build_model(model, seq=seq), "baseline", device=device)
        x, y = TextData().batch(batch, seq, step=0, device=device)
        steps[model] = lambda t=t, x=x, y=y: t.step(x, y)
    took = interleaved(steps, warmup=3, repeats=9, device=device)  # round by round: a busy spell hits them all
    return [{"model": m, "batch": b, "seq": s, "step_s": took[m].median,
             "kernels": count_flops(m, "baseline", b, s)["kernels"]} for m, b, s in models]


def measure_host_update(n: int = 2**22, plan: str = "offload:optimizer", device: str | None = None) -> float:
    """Bytes a second this host streams through the optimizer ``offload:optimizer`` builds on the host (the
    plan's, made by its registry entry for a CPU context: torch's fused AdamW by default) on ``n`` fp32
    parameters, counted as :func:`step_time`'s ``host_update`` term counts them (28 B a parameter for AdamW).
    On the H200's host an unfused AdamW measured at 1.7 GB/s predicted 2.0 s for gpt2-124m's offloaded step,
    which took 0.13 s in all (2026-11-27): the measurement must run the optimizer the plan runs. With
    ``device="cuda"`` (calibration) it is timed in wall time: the host's threads run in parallel, and the CPU's
    process time would add them up.

    >>> measure_host_update(2**12) > 0
    True
    """
    pl = Plan.parse(plan)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = REGISTRY[pl.optimizer].make_optimizer([{"params": [p]}], pl, Context(device=torch.device("cpu")))
    took = time_fn(opt.step, warmup=1, repeats=5, device=device).median
    return n * (8 + 4 + 2 * state_bytes_per_param(pl.optimizer_token)) / took


def fit_host(points: list[dict[str, Any]]) -> dict[str, float]:
    """``{"launch_s", "step_overhead_s"}``: the line through two launch-bound steps, time against kernels
    (slope: each kernel's cost; intercept: the step's own, whatever its size), neither below zero.

    >>> fit_host([{"kernels": 100, "step_s": 3e-3}, {"kernels": 300, "step_s": 7e-3}])
    {'launch_s': 2e-05, 'step_overhead_s': 0.001}
    """
    a, b = sorted(points, key=lambda p: p["kernels"])[:: max(1, len(points) - 1)][:2]
    launch = max((b["step_s"] - a["step_s"]) / max(b["kernels"] - a["kernels"], 1), 0.0)
    return {"launch_s": round(launch, 12), "step_overhead_s": round(max(a["step_s"] - a["kernels"] * launch, 0.0), 12)}


HOST_TERMS = ("launches", "step_overhead")  # the Python/launch side of a step
DEVICE_TERMS = ("compute", "memory", "dequant")  # the GPU's own work


def combine(terms: dict[str, float], gpu: bool) -> float:
    """A step's seconds from its terms. On a GPU the host launches kernels asynchronously and runs ahead of the
    device until the step reads a value back, so the two sides overlap: ``max(host, device)``, plus the terms
    nothing overlaps (PCIe copies the step waits for, the host's optimizer step, disk). On a CPU the same core does
    everything: the sum. On an H200 (2026-11-27, gpt2-124m, 23 plans, calibrated host terms) the overlap's median
    error was 27% in log terms against 63% for the sum (this rule was chosen after seeing those figures).

    >>> combine({"compute": 3.0, "memory": 1.0, "launches": 2.0, "pcie": 1.0}, gpu=True)
    5.0
    >>> combine({"compute": 3.0, "memory": 1.0, "launches": 2.0, "pcie": 1.0}, gpu=False)
    7.0
    """
    if not gpu:
        return sum(terms.values())
    host = sum(terms.get(k, 0.0) for k in HOST_TERMS)
    device = sum(terms.get(k, 0.0) for k in DEVICE_TERMS)
    serial = sum(v for k, v in terms.items() if k not in HOST_TERMS + DEVICE_TERMS)
    return max(host, device) + serial


def step_time(r: dict[str, Any], counts: dict[str, Any], gpu: str | None,
              calibrated: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seconds per optimizer step of an estimate ``r`` whose step runs ``counts`` (:func:`count_flops`), from
    terms (:func:`combine`): matmul FLOPs over the achievable peak, the other kernels' bytes over the memory
    bandwidth, kernel launches, and (on a GPU) PCIe and disk traffic of the offload tokens.

    >>> r = {"plan": "baseline", "trainable_params": 10**9, "host_bytes": 0, "disk_bytes": 0, "batch": 8, "seq": 1024}
    >>> s = step_time(r, {"flops": 6 * 10**9 * 8 * 1024, "kernels": 0, "kernel_bytes": 0}, "t4")
    >>> round(s["terms"]["compute"], 1), s["tokens_per_s"] > 0
    (10.1, True)
    """
    plan = Plan.parse(r["plan"])
    figs, frac = throughput(gpu, calibrated)
    if gpu is None and counts["kernels"]:  # the CPU's bandwidth where the step's average kernel's data sits
        figs["mem_bw"] = cpu_bandwidth(1 << max(12, (counts["kernel_bytes"] // counts["kernels"] // 2).bit_length()))
    elif gpu is None:
        figs["mem_bw"] = cpu_bandwidth(64 << 20)
    n = r["trainable_params"]
    dtype = _gpu_dtype(plan, figs) if gpu is not None else "fp32"
    try:
        state = state_bytes_per_param(plan.optimizer_token)
    except ValueError:
        state = 8.0
    memory = (counts["kernel_bytes"] + counts.get("state_bytes", 0)) / figs["mem_bw"]
    if gpu is None and counts.get("kernel_sizes"):
        # Each kernel at the bandwidth of the cache its data fits in: on a 2-core Xeon a copy runs at ~90 GB/s
        # within L2 (<= 1 MiB) and ~28 GB/s beyond, so one figure for the average kernel is off for a plan whose
        # kernels are bigger or smaller than baseline's (compress:int8's quantize/dequantize of whole activations,
        # 1-16 MiB: predicted 1.19x baseline with the average-size figure, 1.37x with this, 1.39x measured)
        memory = (sum(nbytes / cpu_bandwidth(size) for size, nbytes in counts["kernel_sizes"])
                  + counts.get("state_bytes", 0) / figs["mem_bw"])
    if gpu is not None:  # a GPU: every matmul at the plan's compute dtype; memory at an achievable fraction
        compute = counts["flops"] / (figs[dtype] * frac.get(dtype, 1.0))
        memory /= frac["mem_bw"]
    else:  # this CPU: each matmul at the measured rate of the dtype it ran in (counted per dtype), a narrow
        # one at the rate measured at its own shape
        half = {d: counts.get(f"flops_{d}", 0) for d in ("fp16", "bf16")}
        narrow = counts.get("narrow_flops") or ()
        compute = ((counts["flops"] - sum(half.values()) - sum(f for _, f in narrow)) / figs["fp32"]
                   + sum(f / cpu_matmul_rate(d) for d, f in half.items() if f)
                   + sum(f / cpu_narrow_rate(*shape) for shape, f in narrow))
        dtype = "+".join(["fp32"] + [d for d, f in half.items() if f])
    terms = {"compute": compute,
             "memory": memory,
             "launches": counts["kernels"] * figs["launch_s"]}
    if figs.get("step_overhead_s"):  # measured by calibration (fit_host): the step's host work beyond its kernels
        terms["step_overhead"] = figs["step_overhead_s"]
    if gpu is not None and counts.get("nf4_params"):
        # qlora: each NF4 weight is dequantized to 16 bits wherever it is used -- forward, backward (the input's
        # gradient), and the recomputed forward under checkpoint: NF4 (+ absmax) read, 16 bits written, per pass
        q = counts["nf4_params"]
        passes = 3 if "checkpoint" in plan else 2
        terms["dequant"] = passes * (nf4_bytes(q) + 2 * q) / (figs["mem_bw"] * frac["mem_bw"])
    offload = set(plan.get("offload") or ())
    if offload and gpu is not None:  # PCIe: each offloaded byte goes down and comes back once per step
        moved = (8 * n if "optimizer" in offload else 0) + 2 * r["host_bytes"] * len(offload - {"optimizer"}) / len(offload)
        terms["pcie"] = moved / figs["pcie"]
        if "optimizer" in offload:  # the host steps AdamW: weights, gradient and state read, weights and state written
            terms["host_update"] = n * (8 + 4 + 2 * state) / figs.get("host_bytes_per_s", HOST_BYTES_PER_S)
    if r.get("disk_bytes") and gpu is not None:  # offload:disk: the state file read and written once per step
        terms["disk"] = 2 * r["disk_bytes"] / figs["disk"]
    total = combine(terms, gpu is not None)
    tokens = r["batch"] * r["seq"] * r.get("world_size", 1)
    unc = UNCERTAINTY if gpu is not None else 0.25
    return {"step_time_s": total, "tokens_per_s": tokens / total if total else 0.0, "uncertainty": unc,
            "terms": terms, "dtype": dtype, "source": figs["source"]}


def _gpu_dtype(plan: Plan, figs: dict[str, Any]) -> str:
    """The dtype a plan's matmuls run in on a GPU: fp16/bf16 as the plan says; lora/qlora's frozen base in the
    GPU's half precision (bf16 where native, else fp16: a T4 -- techniques.lora.compute_dtype); else fp32."""
    for d in ("fp16", "bf16"):
        if d in plan and figs.get(d):
            return d
    if "lora" in plan or "qlora" in plan:
        return "bf16" if figs.get("bf16") else "fp16"
    return "fp32"


COUNT_KEYS = ("flops", "kernels", "kernel_bytes", "state_bytes", "flops_fp16", "flops_bf16", "nf4_params")


def speed_of(r: dict[str, Any], counts: dict[str, Any], profile: dict[str, Any] | None,
             calibration: dict[str, Any] | bool = True) -> dict[str, Any]:
    """The keys :func:`~colabkit.estimate.predict.estimate` adds: ``step_time_s``, ``tokens_per_s``, the
    ``counts`` (``flops``, ``kernels``, ...) and ``step_time`` (terms, uncertainty, source), for an estimate
    ``r`` on a GPU ``profile`` or the CPU."""
    key = profile["key"] if profile is not None else None
    calibrated = (overheads.load_profile(key) if calibration is True else calibration or None) if key else None
    s = step_time(r, counts, key, calibrated)
    if r.get("world_size", 1) > 1:
        s["note"] = "per rank, communication not included (the ZeRO paper's 2-3x parameters per step)"
    return {"step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "step_time": s,
            **{k: counts.get(k, 0) for k in COUNT_KEYS}}


def predict_step_time(model_fn: Callable | str, plan: Plan | str, batch: int, seq: int, gpu: str | None = None,
                      calibration: dict[str, Any] | bool = True) -> dict:
    """The step time alone (no memory trace): what :func:`~colabkit.estimate.predict.estimate` reports as
    ``step_time``, for a run on ``gpu`` (a profile key) or this CPU; with ``calibration`` as
    :func:`speed_of` takes it (True: the profile ``colabkit calibrate`` stored for that GPU, if any).

    >>> predict_step_time("gpt-tiny", "baseline", 2, 16)["step_time_s"] > 0
    True
    """
    plan = Plan.parse(plan)
    counts = count_flops(model_fn, plan, batch, seq)
    n = _flops(model_fn, compute_plan(plan), batch, seq)[3] if not counts["state_bytes"] else 0
    r = {"plan": str(plan), "trainable_params": n, "host_bytes": 0, "disk_bytes": 0, "batch": batch, "seq": seq}
    calibrated = (overheads.load_profile(gpu) if calibration is True else calibration or None) if gpu else None
    return step_time(r, counts, gpu, calibrated)

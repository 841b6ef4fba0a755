"""Predicted step time: FLOPs from the fake-tensor step, bytes moved to the host and the disk, over a
device's achievable throughput and bandwidths.

:func:`count_flops` runs one real Trainer step on fake tensors under ``torch.utils.flop_counter``'s
``FlopCounterMode`` (matmuls and attention: what a transformer's time goes to; recomputation under
``checkpoint`` and the frozen base of ``lora`` are seen as they run). :func:`step_time` adds the optimizer
update (memory-bound: bytes read and written per trainable parameter over the device's bandwidth), the
PCIe traffic of ``offload:*`` and the disk traffic of ``offload:disk``, each over the figures of
:data:`THROUGHPUT` (datasheet peaks times an achievable fraction, each with its source) -- or over what
``colabkit calibrate`` measured when it stored ``speed`` in the profile. On a CPU the figures are measured
once (:func:`cpu_throughput`: a matmul and a copy), so the prediction can be checked against real steps.

>>> f = count_flops("gpt-tiny", "baseline", 2, 16)
>>> f > 0, count_flops("gpt-tiny", "checkpoint", 2, 16) > f   # recomputation: one more forward
(True, True)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..plan import Plan
from ..techniques.optimizers import state_bytes_per_param
from ..timing import time_fn
from ..trainer import Trainer
from .trace import _build, _HostScalars, _swap_by_data

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
THROUGHPUT["t4x2"] = THROUGHPUT["t4"]
THROUGHPUT["a100-40gb"] = THROUGHPUT["a100"]
THROUGHPUT["h100-80gb"] = THROUGHPUT["h100"]
# Achievable fraction of the peak in a training step (assumed: MFU of 30-50% is what well-tuned training
# reports on A100/H100 [PaLM 2022, Megatron-LM]; a T4 at 70 W throttles below its boost clock)
ACHIEVABLE = {"fp32": 0.6, "fp16": 0.35, "bf16": 0.4}
UNCERTAINTY = 0.3  # +-30%: the achievable fraction's spread
HOST_BYTES_PER_S = 5e9  # assumed: a 2-vCPU Colab host streaming AdamW's state (offload:optimizer's step)
# Tokens that change what the step computes (FLOPs); the others (optimizer, offload, fused-step) do not
_COMPUTE_TOKENS = ("checkpoint", "lora", "qlora", "fp16", "bf16", "attention", "chunked-ce")


def _compute_plan(plan: Plan) -> str:
    """The tokens that change the FLOPs (qlora computes as lora: its 4-bit kernels cannot run on fake tensors)."""
    keep = [t.replace("qlora", "lora", 1) for t in plan.tokens if t.partition(":")[0] in _COMPUTE_TOKENS]
    return "+".join(keep) or "baseline"


@functools.lru_cache(maxsize=256)
def _flops(model_fn: Callable | str, plan: str, batch: int, seq: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode(allow_non_fake_inputs=True), _HostScalars(), _swap_by_data():
        trainer = Trainer(_build(model_fn, seq), Plan.parse(plan), device="cpu")
        x = torch.randint(0, 256, (batch, seq))  # (B, S) ids: only shapes matter
        with FlopCounterMode(display=False) as counter:
            trainer.step(x, x)
    return int(counter.get_total_flops())


def count_flops(model_fn: Callable | str, plan: Plan | str, batch: int, seq: int, params: int | None = None,
                notes: list[str] | None = None) -> int:
    """FLOPs of one optimizer step (forward, backward, recomputation), counted on fake tensors; cached per
    model, shape and the plan's compute tokens (optimizers and offload do not change them). Where the step
    cannot run under the counter, 6 x ``params`` x tokens (Kaplan et al. 2020), said in ``notes``."""
    plan = Plan.parse(plan)
    try:
        return _flops(model_fn, _compute_plan(plan), batch, seq)
    except Exception as err:  # noqa: BLE001  (a kernel the counter's fake tensors cannot run)
        if params is None:
            raise
        if notes is not None:
            notes.append(f"step time: FLOPs from 6 x parameters x tokens ({type(err).__name__} under the FLOP counter)")
        return 6 * params * batch * seq


@functools.lru_cache(maxsize=1)
def cpu_throughput() -> dict[str, Any]:
    """This CPU's matmul FLOP/s (a 256^3 fp32 matmul) and copy bandwidth (16 MiB), measured once with
    :func:`colabkit.timing.time_fn` (process time: robust to other processes on a shared machine)."""
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm = time_fn(lambda: [a @ b for _ in range(8)], warmup=1, repeats=5).median / 8
    src, dst = torch.randn(4 << 20), torch.empty(4 << 20)
    cp = time_fn(lambda: dst.copy_(src), warmup=1, repeats=5).median
    return {"fp32": 2 * n**3 / mm, "fp16": None, "bf16": None, "mem_bw": 2 * src.nbytes / cp, "pcie": None,
            "disk": None, "source": f"measured on this CPU: {n}x{n} fp32 matmul, {src.nbytes >> 20} MiB copy"}


def throughput(gpu: str | None, calibrated: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """(figures, achievable fractions) for a GPU profile key, or the measured CPU (``gpu=None``);
    a calibrated profile's ``speed`` entries replace the datasheet's (measured: fraction 1)."""
    if gpu is None:
        return cpu_throughput(), {"fp32": 1.0}
    figs, frac = dict(THROUGHPUT[gpu]), dict(ACHIEVABLE)
    measured = (calibrated or {}).get("speed") or {}
    for k, v in measured.items():
        figs[k] = v
        frac[k] = 1.0
    if measured:
        figs["source"] = f"calibrated on this GPU ({', '.join(sorted(measured))}); datasheet for the rest"
    return figs, frac


def step_time(r: dict[str, Any], flops: int, gpu: str | None, calibrated: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seconds per optimizer step of an estimate ``r`` whose step computes ``flops``, term by term.

    >>> r = {"plan": "baseline", "trainable_params": 10**9, "host_bytes": 0, "disk_bytes": 0, "batch": 8, "seq": 1024}
    >>> s = step_time(r, 6 * 10**9 * 8 * 1024, "t4")
    >>> round(s["terms"]["compute"], 1), s["tokens_per_s"] > 0
    (10.1, True)
    """
    plan = Plan.parse(r["plan"])
    figs, frac = throughput(gpu, calibrated)
    dtype = next((d for d in ("fp16", "bf16") if d in plan and figs.get(d)), "fp32")
    n = r["trainable_params"]
    try:
        state = state_bytes_per_param(plan.optimizer_token)
    except ValueError:
        state = 8.0
    terms = {"compute": flops / (figs[dtype] * frac.get(dtype, 1.0)),
             # the update reads and writes weights and state, reads the gradient (AdamW fp32: 28 B/param)
             "optimizer_update": n * (8 + 4 + 2 * state) / figs["mem_bw"]}
    offload = set(plan.get("offload") or ())
    if offload and gpu is not None:  # PCIe: each offloaded byte goes down and comes back once per step
        moved = (8 * n if "optimizer" in offload else 0) + 2 * r["host_bytes"] * len(offload - {"optimizer"}) / len(offload)
        terms["pcie"] = moved / figs["pcie"]
        if "optimizer" in offload:
            terms["host_update"] = n * (8 + 4 + 2 * state) / HOST_BYTES_PER_S
    if r.get("disk_bytes") and gpu is not None:  # offload:disk: the state file read and written once per step
        terms["disk"] = 2 * r["disk_bytes"] / figs["disk"]
    total = sum(terms.values())
    tokens = r["batch"] * r["seq"] * r.get("world_size", 1)
    unc = UNCERTAINTY if gpu is not None else 0.25
    return {"step_time_s": total, "tokens_per_s": tokens / total if total else 0.0, "uncertainty": unc,
            "terms": terms, "flops": flops, "dtype": dtype, "source": figs["source"]}


def speed_of(r: dict[str, Any], flops: int, profile: dict[str, Any] | None,
             calibration: dict[str, Any] | bool = True) -> dict[str, Any]:
    """The keys :func:`~colabkit.estimate.predict.estimate` adds: ``step_time_s``, ``tokens_per_s``, and
    ``step_time`` (terms, uncertainty, source) for an estimate ``r`` on a GPU ``profile`` or the CPU."""
    from . import overheads

    key = profile["key"] if profile is not None else None
    calibrated = (overheads.load_profile(key) if calibration is True else calibration or None) if key else None
    s = step_time(r, flops, key, calibrated)
    if r.get("world_size", 1) > 1:
        s["note"] = "per rank, communication not included (the ZeRO paper's 2-3x parameters per step)"
    return {"step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "flops": flops, "step_time": s}

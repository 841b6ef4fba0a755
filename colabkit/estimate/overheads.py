"""What a real GPU adds to the traced tensors: named overhead terms, each with its size, its source and
whether it grows with the model.

The trace (:mod:`.trace`) counts the tensors the Trainer allocates. On a GPU the process also holds

- ``cuda_context``: the CUDA context and the kernels loaded into it, outside PyTorch's allocator; it
  depends on which libraries load (bare torch, cuBLAS, bitsandbytes, transformers' models);
- ``cublas_workspace``: one cuBLAS workspace per (handle, stream), allocated through the caching
  allocator; training uses two handles (the forward thread's and autograd's backward thread's);
- ``allocator_rounding``: the caching allocator's segments: a request of 10 MiB or more gets a segment
  rounded up to 2 MiB, so each large persistent tensor leaves a tail of up to 2 MiB;
- ``fragmentation``: blocks reserved but not allocated at the peak (split blocks, freed activations whose
  holes do not fit the next request): a fraction of the allocated peak;
- ``optimizer_step``: temporaries the optimizer allocates inside ``step()`` on CUDA beyond what the CPU trace
  saw (torch AdamW ``foreach`` would add 4 B/param; the baseline uses ``fused=True`` on CUDA: none);
- ``nf4_dequant`` (qlora): the compute-dtype copy of the largest NF4 weight, dequantized per matmul.

>>> t = terms(GPU_PROFILES["t4"], "baseline", trainable_shapes=[(50257, 768)], peak_bytes=2 * 2**30)
>>> sorted(t) == sorted(TERM_NAMES[:5])
True
>>> t["cublas_workspace"].nbytes == 2 * 8519680, t["cuda_context"].scales
(True, False)
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from ..env import GPU_PROFILES  # noqa: F401  (doctest)
from ..plan import Plan
from .substitutes import steps_own_8bit_kernel  # make_optimizer's rule (adamw8bit_kernel), asked
from ..techniques.lora import nf4_bytes
from ..techniques.optimizers import state_bytes_per_param

GiB, MiB = 1024**3, 1024**2

# c10/cuda/CUDACachingAllocator.cpp (torch 2.x): every block a multiple of kMinBlockSize (512 B); requests up to
# kSmallSize (1 MiB) come from kSmallBuffer (2 MiB) segments; 1-10 MiB (kMinLargeAlloc) from kLargeBuffer
# (20 MiB) segments; larger requests get their own segment rounded up to kRoundLarge (2 MiB). A block is split
# only if the remainder exceeds kSmallSize, so a tail of <= 1 MiB stays inside the allocated block.
K_MIN_BLOCK, K_SMALL_SIZE, K_SMALL_BUFFER = 512, 1 * MiB, 2 * MiB
K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_ROUND_LARGE = 20 * MiB, 10 * MiB, 2 * MiB

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): default ":4096:2:16:8" (2 x 4 MiB +
# 8 x 16 KiB = 8,519,680 B) per handle and stream; 32 MiB (":4096:8") on Hopper/Blackwell (major 9, 10, 12).
CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_BIG = 4096 * 8 * 1024
CUBLAS_HANDLES = 2  # forward (main thread) + backward (autograd's device thread): one handle per thread

# The CUDA context by libraries loaded, (bytes, uncertainty, source). Only the bare figure and the
# with-transformers total are observed on a T4 (Colab OOM messages quoted in issue 12: "non-PyTorch
# memory" 0.13 GiB bare, 1.0 GiB with transformers' libraries); the steps between are assumptions that
# `colabkit calibrate` replaces by this machine's measurement.
CONTEXT_LADDER: dict[str, tuple[int, int, str]] = {
    "torch": (int(0.13 * GiB), int(0.05 * GiB),
              "bare context, lazy module loading: 0.13 GiB non-PyTorch memory in a Colab T4 OOM message (issue 12)"),
    "cublas": (int(0.17 * GiB), int(0.10 * GiB),
               "cuBLAS/cuBLASLt handles and lazily loaded GEMM kernels: ~0.3 GiB context after the first ops "
               "(pytorch#86509: 287,047,680 B after one .cuda() with CUDA_MODULE_LOADING=LAZY; ptrblck in "
               "pytorch#107667 / #109888: ~300-400 MB) minus the bare 0.13 GiB; assumed, calibrate measures it"),
    "bitsandbytes": (int(0.10 * GiB), int(0.10 * GiB),
                     "libbitsandbytes_cuda kernels (8-bit optimizers, NF4): assumed 0.1 GiB, not measured"),
    "transformers": (int(0.70 * GiB), int(0.30 * GiB),
                     "the rest of the 1.0 GiB non-PyTorch memory of a Colab T4 OOM with transformers' libraries "
                     "loaded (issue 12) above torch+cuBLAS; which kernels make it up is not known here"),
}

# Reserved-but-unallocated at the peak, as a fraction of the allocated peak: 0.25 GiB of ~14.2 GiB (1.8%) in the
# Colab T4 OOM message of issue 12; 393 MiB of 11.3 GiB (3.4%) and 264 MiB of 3.7 GiB (6.9%) in T4 OOM
# messages of lllyasviel/FramePack#608 and Zheng-Chong/CatVTON#133. 3% +- 3% covers these.
FRAGMENTATION, FRAGMENTATION_UNCERTAINTY = 0.03, 0.03

# torch.optim.AdamW step temporaries measured on the CPU (2 cores, torch 2.13.0+cpu, 2026-11-22) under
# MemoryTracker: foreach=True 4.0 B/param (``_foreach_sqrt`` of every exp_avg_sq at once), foreach=False
# 2x the largest parameter, fused=True none. tests/test_overheads.py measures them again.
ADAMW_FOREACH_BYTES_PER_PARAM = 4.0

TERM_NAMES = ("cuda_context", "cublas_workspace", "allocator_rounding", "fragmentation", "optimizer_step",
              "nf4_dequant")
PROFILE_ENV = "COLABKIT_PROFILE_DIR"


@dataclass
class Term:
    """One overhead: ``nbytes`` with ``uncertainty`` (bytes, either way), its ``source``, ``scales``
    (True when it grows with the model)."""

    name: str
    nbytes: int
    uncertainty: int
    source: str
    scales: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def libraries(plan: Plan | str, transformers_model: bool = False, profile: dict | None = None) -> list[str]:
    """The libraries whose kernels a training run of ``plan`` loads into the CUDA context (on ``profile``'s GPU:
    adamw8bit loads bitsandbytes only where bitsandbytes steps it -- not under fused-step or offload:params,
    where colabkit's own 8-bit kernel does, plain torch).

    >>> libraries("qlora:16+checkpoint"), libraries("baseline", transformers_model=True)
    (['torch', 'cublas', 'bitsandbytes'], ['torch', 'cublas', 'transformers'])
    >>> libraries("adamw8bit", profile={"key": "t4"}), libraries("adamw8bit+fused-step", profile={"key": "t4"})
    (['torch', 'cublas', 'bitsandbytes'], ['torch', 'cublas'])
    """
    plan = Plan.parse(plan)
    libs = ["torch", "cublas"]  # every training step runs GEMMs
    bnb = {t.partition(":")[0] for t in plan.tokens} & {"adamw8bit", "paged-adamw8bit", "lion8bit", "lion", "qlora"}
    if bnb == {"adamw8bit"} and steps_own_8bit_kernel(plan, profile or {}):
        bnb = set()
    if bnb:
        libs.append("bitsandbytes")
    if transformers_model:
        libs.append("transformers")
    return libs


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """One cuBLAS workspace as torch sizes it: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs)
    when set, else 8,519,680 B, or 32 MiB on compute capability 9.x/10.x/12.x.

    >>> cublas_workspace_bytes((7, 5)), cublas_workspace_bytes((9, 0)), cublas_workspace_bytes((7, 5), ":4096:8")
    (8519680, 33554432, 33554432)
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return CUBLAS_BIG if capability[0] in (9, 10, 12) else CUBLAS_DEFAULT


def segment_tail(nbytes: int) -> int:
    """Bytes a persistent tensor of ``nbytes`` holds beyond itself in its caching-allocator segment:
    a large request (>= 10 MiB) gets a segment rounded up to 2 MiB; smaller requests share 2 MiB / 20 MiB
    segments with others (their share of the slack is in ``fragmentation``).

    >>> segment_tail(10 * 2**20 + 1), segment_tail(4 * 2**20)
    (2097151, 0)
    """
    if nbytes < K_MIN_LARGE_ALLOC:
        return 0
    return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE - nbytes


def _persistent_tensors(plan: Plan, trainable_shapes: Iterable[tuple[int, ...]],
                        frozen: Iterable[tuple[int, bool]]) -> list[int]:
    """Byte sizes of the tensors that live through the whole step: each trainable weight in fp32, its
    gradient (unless fused-step frees it at once), its optimizer state (two moments for the Adam family)."""
    opt = plan.optimizer_token
    offload = plan.get("offload") or ()
    sizes = []
    for shape in trainable_shapes:
        n = math.prod(shape)
        sizes.append(4 * n)
        if "fused-step" not in plan and "optimizer" not in offload:
            sizes.append(4 * n)
        if "optimizer" not in offload:
            per = state_bytes_per_param(opt, tuple(shape)) if shape else 0.0
            moments = 2 if per >= 2 else 1
            sizes += [int(per * n / moments)] * moments
    quant = "qlora" in plan
    for n, linear in frozen:
        sizes.append(nf4_bytes(n) if quant and linear else 4 * n if quant else 2 * n)
    return sizes


def terms(profile: dict[str, Any], plan: Plan | str, trainable_shapes: Iterable[tuple[int, ...]] = (),
          peak_bytes: int = 0, frozen: Iterable[tuple[int, bool]] = (), transformers_model: bool = False,
          calibrated: dict[str, Any] | None = None) -> dict[str, Term]:
    """The overhead terms of a training run of ``plan`` on the GPU ``profile`` (a :data:`GPU_PROFILES`
    entry), given the trace's trainable shapes, frozen ``(numel, is_linear)`` tensors and allocated peak.
    ``calibrated`` (a stored device profile, :func:`load_profile`) replaces the context and fragmentation
    by this machine's measurement."""
    plan = Plan.parse(plan)
    trainable_shapes = [tuple(s) for s in trainable_shapes]
    frozen = list(frozen)
    out: dict[str, Term] = {}

    libs = libraries(plan, transformers_model, profile)
    if calibrated and calibrated.get("context_bytes") is not None:
        ctx = int(calibrated["context_bytes"]) + sum(CONTEXT_LADDER[lib][0] for lib in libs
                                                     if lib not in calibrated.get("libraries", ()))
        out["cuda_context"] = Term("cuda_context", ctx, int(calibrated.get("context_uncertainty", 0.02 * GiB)),
                                   f"measured by colabkit calibrate on {calibrated.get('gpu')} "
                                   f"({calibrated.get('date')}, libraries {calibrated.get('libraries')})", False)
    else:
        out["cuda_context"] = Term("cuda_context", sum(CONTEXT_LADDER[lib][0] for lib in libs),
                                   sum(CONTEXT_LADDER[lib][1] for lib in libs),
                                   "; ".join(f"{lib}: {CONTEXT_LADDER[lib][2]}" for lib in libs), False)

    ws = cublas_workspace_bytes(tuple(profile["capability"]))
    out["cublas_workspace"] = Term("cublas_workspace", CUBLAS_HANDLES * ws, ws,
                                   f"{CUBLAS_HANDLES} handles (forward thread, autograd's backward thread) x {ws:,} B: "
                                   "aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize(); +-1 workspace "
                                   "(cuBLASLt or another stream)", False)

    tails = sum(segment_tail(b) for b in _persistent_tensors(plan, trainable_shapes, frozen))
    out["allocator_rounding"] = Term("allocator_rounding", tails, tails // 2,
                                     "large (>= 10 MiB) persistent tensors get segments rounded up to 2 MiB "
                                     "(c10/cuda/CUDACachingAllocator.cpp kMinLargeAlloc, kRoundLarge); tails over "
                                     "1 MiB are split off and may be reused: +-50%", True)

    frag, frag_u = FRAGMENTATION, FRAGMENTATION_UNCERTAINTY
    frag_src = ("reserved-but-unallocated at the peak, 3% +- 3% of the allocated peak: 0.25 GiB of ~14.2 GiB in "
                "issue 12's Colab T4 OOM; 3.4% and 6.9% in T4 OOMs of lllyasviel/FramePack#608, "
                "Zheng-Chong/CatVTON#133")
    if calibrated and calibrated.get("fragmentation") is not None:
        frag = float(calibrated["fragmentation"])
        frag_u = max(0.01, float(calibrated.get("fragmentation_uncertainty", frag / 2)))
        frag_src = f"measured by colabkit calibrate on {calibrated.get('gpu')} ({calibrated.get('date')})"
    out["fragmentation"] = Term("fragmentation", int(frag * peak_bytes), int(frag_u * peak_bytes), frag_src, True)

    out["optimizer_step"] = _optimizer_step(plan, trainable_shapes, profile)
    if "qlora" in plan:
        biggest = max((n for n, linear in frozen if linear), default=0)
        out["nf4_dequant"] = Term("nf4_dequant", 2 * biggest, biggest,
                                  "bitsandbytes MatMul4Bit dequantizes the NF4 weight to the fp16 compute dtype for "
                                  "each matmul (forward and backward): one copy of the largest quantized linear, "
                                  "2 B/param; the lora stand-in trace holds 16-bit weights and sees no copy", True)
    return out


def _optimizer_step(plan: Plan, trainable_shapes: list[tuple[int, ...]], profile: dict | None = None) -> Term:
    opt = plan.optimizer
    n = sum(math.prod(s) for s in trainable_shapes)
    if "optimizer" in (plan.get("offload") or ()):
        return Term("optimizer_step", 0, 0, "offload:optimizer: the step runs on the host", False)
    if steps_own_8bit_kernel(plan, profile or {}):
        return Term("optimizer_step", 0, 0,
                    "adamw8bit steps with colabkit's own 8-bit kernel here (fused-step or offload:params), plain "
                    "torch: the trace ran it, so its per-step scratch (two fp32 and one uint8 chunk buffers per "
                    "device) is in the traced peak already; nothing added", False)
    if opt == "adamw":
        return Term("optimizer_step", 0, 0,
                    "torch AdamW with fused=True on CUDA (colabkit's adamw): the fused kernel updates in place, no "
                    f"temporaries; foreach (torch's CUDA default) would add {ADAMW_FOREACH_BYTES_PER_PARAM:.0f} B/param "
                    f"= {ADAMW_FOREACH_BYTES_PER_PARAM * n / GiB:.2f} GiB here (measured on CPU, torch 2.13.0+cpu, "
                    "2026-11-22). The CPU trace ran the same fused kernel (colabkit's adamw is fused on the CPU "
                    "too): nothing to add", False)
    if opt in ("adamw8bit", "paged-adamw8bit", "lion8bit", "lion"):
        return Term("optimizer_step", 0, 0,
                    "bitsandbytes 8-/32-bit optimizers update in place in one blockwise kernel per tensor "
                    "(optimizer_update_8bit_blockwise / optimizer_update_32bit): no tensor-sized temporaries; the "
                    "trace used a stateless SGD stand-in plus the state formula", False)
    return Term("optimizer_step", 0, 0,
                f"{opt}: pure torch, its step ran in the trace (same ops on CUDA, temporaries counted there)", False)


def total(ts: dict[str, Term]) -> tuple[int, int]:
    """Sum of the terms and of their uncertainties (added, not in quadrature: they are not independent)."""
    return sum(t.nbytes for t in ts.values()), sum(t.uncertainty for t in ts.values())


# ----- stored device profiles (written by colabkit calibrate) ------------------------------------------------
def profile_dir() -> Path:
    """Where calibrated device profiles live: ``$COLABKIT_PROFILE_DIR`` or ``~/.cache/colabkit/profiles``."""
    return Path(os.environ.get(PROFILE_ENV) or Path.home() / ".cache" / "colabkit" / "profiles")


def load_profile(key: str) -> dict[str, Any] | None:
    """The calibrated profile stored for GPU profile ``key`` (e.g. ``t4``), or None."""
    path = profile_dir() / f"{key}.json"
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def save_profile(key: str, data: dict[str, Any]) -> Path:
    """Store a calibrated profile for ``key``; later estimates on that profile use it."""
    path = profile_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path

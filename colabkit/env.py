"""Where am I: Colab/Kaggle/local, which GPU, what it can run, how much memory there is.

>>> info = env()
>>> info["platform"] in ("colab", "kaggle", "local")
True
"""
from __future__ import annotations

import contextlib
import os
import re
import platform as _platform
import sys
from typing import Any, Iterator

import torch

GiB = 1024**3
MiB = 1024**2

# GPU profiles: what a run on that GPU can count on. ``capacity_bytes`` is what CUDA reports as the
# device's total memory (``torch.cuda.get_device_properties(0).total_memory``, the "total capacity" of
# torch's OOM message): the estimate's budget, from which the CUDA context, cuBLAS workspaces and the
# allocator's slack are subtracted as named terms (colabkit.estimate.overheads). ``usable_bytes`` is the
# older flat figure (capacity minus ~0.4 GiB context and slack) that T4 emulation and the plots use.
# ``count`` > 1: that many identical GPUs (one process per GPU; each judged against one GPU's capacity).
GPU_PROFILES: dict[str, dict[str, Any]] = {
    "t4": {
        "name": "Tesla T4", "match": ("T4",), "count": 1,
        "total_bytes": 15360 * MiB,
        "capacity_bytes": int(14.74 * GiB),
        "usable_bytes": int(14.5 * GiB),
        "capability": (7, 5),
        "native_bf16": False,
        "sdpa": ["math", "efficient"],
        "host_ram_bytes": int(12.7e9),
        "source": "Colab free tier. nvidia-smi shows 15360 MiB (T4 datasheet: 16 GB GDDR6, part kept for ECC); "
        "capacity 14.74 GiB = the 'total capacity' of Colab T4 OOM messages (14.74 / 14.75 GiB, quoted in "
        "issue 12); sm75: no bf16 units, no flash attention (needs sm80); host RAM ~12.7 GB (Colab VM)",
    },
    "p100": {
        "name": "Tesla P100-PCIE-16GB", "match": ("P100",), "count": 1, "platform": "kaggle",
        "total_bytes": 16280 * MiB,
        "capacity_bytes": int(15.89 * GiB),
        "usable_bytes": int(15.5 * GiB),
        "capability": (6, 0),
        "native_bf16": False,
        "sdpa": ["math", "efficient"],
        "host_ram_bytes": int(29e9),
        "source": "Kaggle 'GPU P100'. nvidia-smi 16280 MiB = 15.89 GiB, the 'total capacity' of OOM messages "
        "from 16 GB P100s; sm60: no bf16, no tensor cores, no flash attention; host RAM ~29 GB (Kaggle "
        "session panel, approximate)",
    },
    "l4": {
        "name": "NVIDIA L4", "match": ("L4",), "count": 1,
        "total_bytes": 23034 * MiB,
        "capacity_bytes": int(22.03 * GiB),
        "usable_bytes": int(21.6 * GiB),
        "capability": (8, 9),
        "native_bf16": True,
        "sdpa": ["math", "efficient", "flash"],
        "host_ram_bytes": int(53e9),
        "source": "Colab L4 runtime. nvidia-smi 23034 MiB (24 GB GDDR6); OOM messages from 24 GB L4/A10G cards "
        "read 'total capacity of 22.03'-'22.16 GiB': the lowest is used; sm89: bf16 and flash attention; "
        "host RAM ~53 GB (Colab's L4 VM, approximate)",
    },
    "a100": {
        "name": "NVIDIA A100-SXM4-40GB", "match": ("A100", "40GB"), "count": 1,
        "total_bytes": 40960 * MiB,
        "capacity_bytes": int(39.39 * GiB),
        "usable_bytes": int(39.0 * GiB),
        "capability": (8, 0),
        "native_bf16": True,
        "sdpa": ["math", "efficient", "flash"],
        "host_ram_bytes": int(83.5e9),
        "source": "Colab A100 (40 GB) runtime. nvidia-smi 40960 MiB; OOM messages from A100-SXM4-40GB read "
        "'total capacity of 39.39'-'39.56 GiB': the lowest is used; sm80: bf16 and flash attention; "
        "host RAM ~83.5 GB (Colab's A100 VM, approximate)",
    },
}
GPU_PROFILES["a100-80gb"] = {
    "name": "NVIDIA A100-SXM4-80GB", "match": ("A100", "80GB"), "count": 1,
    "total_bytes": 81920 * MiB,
    "capacity_bytes": int(79.15 * GiB),
    "usable_bytes": int(78.7 * GiB),
    "capability": (8, 0),
    "native_bf16": True,
    "sdpa": ["math", "efficient", "flash"],
    "host_ram_bytes": int(1360e9 / 8),
    "source": "cloud A100 80 GB (SXM4). nvidia-smi 81920 MiB (A100 datasheet: 80 GB HBM2e, 2,039 GB/s); OOM "
    "messages from A100-SXM4-80GB read 'total capacity of 79.15 GiB'; sm80: bf16 and flash attention; host RAM: "
    "an 8-GPU VM's share (GCP a2-ultragpu-8g: 1,360 GB for 8 GPUs), approximate",
}
GPU_PROFILES["h100"] = {
    "name": "NVIDIA H100 80GB HBM3", "match": ("H100",), "count": 1,
    "total_bytes": 81559 * MiB,
    "capacity_bytes": int(79.10 * GiB),
    "usable_bytes": int(78.6 * GiB),
    "capability": (9, 0),
    "native_bf16": True,
    "sdpa": ["math", "efficient", "flash"],
    "host_ram_bytes": int(2048e9 / 8),
    "source": "cloud H100 80 GB (SXM5). nvidia-smi 81559 MiB (H100 datasheet: 80 GB HBM3, 3.35 TB/s); OOM messages "
    "from H100 80GB HBM3 read 'total capacity of 79.10 GiB' (approximate: 79.1-79.2 are seen); sm90: bf16 and "
    "flash attention; host RAM: an 8-GPU VM's share (AWS p5.48xlarge: 2 TiB for 8 GPUs), approximate",
}
GPU_PROFILES["h100-80gb"] = GPU_PROFILES["h100"]
GPU_PROFILES["h200"] = {
    "name": "NVIDIA H200", "match": ("H200",), "count": 1,
    "total_bytes": 143771 * MiB,
    "capacity_bytes": int(139.8 * GiB),
    "usable_bytes": int(139.3 * GiB),
    "capability": (9, 0),
    "native_bf16": True,
    "sdpa": ["math", "efficient", "flash"],
    "host_ram_bytes": int(2048e9 / 8),
    "source": "cloud H200 141 GB (SXM). NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s; nvidia-smi 143771 MiB; the "
    "capacity CUDA reports taken as that less the ~0.55 GiB an H100 loses (approximate, not measured here); sm90: bf16 "
    "and flash attention; host RAM: an 8-GPU VM's share (AWS p5e.48xlarge: 2 TiB for 8 GPUs), approximate",
}
GPU_PROFILES["t4x2"] = dict(
    GPU_PROFILES["t4"], count=2, platform="kaggle", host_ram_bytes=int(29e9),
    source="Kaggle 'GPU T4 x2': two T4s, each as the t4 profile (the estimate judges one GPU: without sharding "
    "every process holds the whole run); host RAM ~29 GB as Kaggle's session panel shows it (approximate, not "
    "measured here)")
GPU_PROFILES["a100-40gb"] = GPU_PROFILES["a100"]


def profile_for(gpu_name: str | None, count: int = 1, platform: str | None = None) -> str | None:
    """The key of :data:`GPU_PROFILES` whose ``match`` words all occur as whole words in ``gpu_name`` (CUDA's
    device name, split at anything but letters and digits: "T4" is not in "NVIDIA T400", "L4" not in
    "NVIDIA L40S"); with ``count`` GPUs on Kaggle, the multi-GPU profile (``t4x2``). None when no profile matches.

    >>> profile_for("Tesla T4"), profile_for("Tesla T4", count=2, platform="kaggle"), profile_for("NVIDIA GeForce RTX 3090")
    ('t4', 't4x2', None)
    >>> profile_for("NVIDIA T400"), profile_for("NVIDIA L40S"), profile_for("NVIDIA A100-SXM4-40GB")
    (None, None, 'a100')
    """
    if not gpu_name:
        return None
    words = set(re.findall(r"[A-Z0-9]+", gpu_name.upper()))
    best = None
    for key, p in GPU_PROFILES.items():
        if key != p.get("key", key) or not all(w.upper() in words for w in p["match"]):
            continue
        if p["count"] == count and p.get("platform", platform) == platform:
            return key
        if p["count"] == 1 and best is None:
            best = key
    return best


for _k, _p in GPU_PROFILES.items():
    _p.setdefault("key", _k)
# Free disk for offload:disk's state file (a temporary folder on the VM's local disk), approximate: a fresh
# Colab VM shows ~107 GB total with ~78 GB free (df -h /tmp); Kaggle's sessions ~60 GB of scratch space.
for _p in GPU_PROFILES.values():
    _p.setdefault("disk_bytes", int(60e9) if _p.get("platform") == "kaggle" else int(78e9))
T4_USABLE_BYTES = GPU_PROFILES["t4"]["usable_bytes"]

_EMULATING_T4 = False


def is_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def is_kaggle() -> bool:
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ or os.path.isdir("/kaggle/working")


def smoke_mode() -> bool:
    """Tiny sizes and few steps: when COLABKIT_SMOKE=1, CI is set, or no GPU is attached.

    COLABKIT_SMOKE=0 forces full sizes even without a GPU.
    """
    flag = os.environ.get("COLABKIT_SMOKE")
    if flag is not None and flag.strip() != "":
        return flag.strip().lower() not in ("0", "false", "no")
    return bool(os.environ.get("CI")) or not torch.cuda.is_available()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16(device: str | torch.device | None = None) -> bool:
    """True only where the hardware has bf16 units (compute capability >= 8.0).

    ``torch.cuda.is_bf16_supported()`` answers True on a T4 through emulation, so it is not asked.
    On the CPU, autocast bf16 runs (emulated or with AVX512-BF16) but is not what a T4 would do.
    """
    if _EMULATING_T4:
        return False
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def sdpa_backends(device: str | torch.device | None = None) -> list[str]:
    """The scaled-dot-product-attention backends this device can run.

    flash needs sm80+ (Ampere); memory-efficient (xformers-style) runs from sm50; math runs anywhere.
    On the CPU, torch has a math and a flash-style fused kernel; only ``math`` can be forced portably.
    """
    if device is not None and torch.device(device).type == "cuda" and _EMULATING_T4 and not torch.cuda.is_available():
        return ["math", "efficient"]  # a T4 asked about from a machine without one (t4_rules): sm75, no flash
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type == "cpu"):
        return ["math"]
    major, minor = torch.cuda.get_device_capability(device)
    backends = ["math"]
    if (major, minor) >= (5, 0):
        backends.append("efficient")
    if major >= 8 and not _EMULATING_T4:
        backends.append("flash")
    return backends


def host_ram() -> dict[str, int | None]:
    """Host RAM total/available and this process's RSS, in bytes (psutil when present)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return {"total": vm.total, "available": vm.available, "rss": psutil.Process().memory_info().rss}
    except ImportError:  # Linux fallback without psutil
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    k, v = line.split(":")
                    info[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
        rss = None
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        return {"total": info.get("MemTotal"), "available": info.get("MemAvailable"), "rss": rss}


def env() -> dict[str, Any]:
    """A JSON-able report of the environment: platform, GPU, memory, capabilities, smoke mode.

    >>> env()["device"] in ("cpu", "cuda")
    True
    """
    ram = host_ram()
    info: dict[str, Any] = {
        "platform": "colab" if is_colab() else "kaggle" if is_kaggle() else "local",
        "python": _platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": default_device(),
        "gpu": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "capability": None,
        "vram_total_bytes": None,
        "vram_free_bytes": None,
        "bf16_native": native_bf16(),
        "sdpa_backends": sdpa_backends(),
        "host_ram_total_bytes": ram["total"],
        "host_ram_available_bytes": ram["available"],
        "smoke": smoke_mode(),
        "emulating_t4": _EMULATING_T4,
        "budget_bytes": budget_bytes(),
        "profile": None,
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info.update(
            gpu=torch.cuda.get_device_name(),
            capability=list(torch.cuda.get_device_capability()),
            vram_total_bytes=total,
            vram_free_bytes=free,
        )
        info["profile"] = profile_for(info["gpu"], info["gpu_count"], info["platform"])
    info["bitsandbytes"] = _bnb_version()
    return info


_BNB_VERSION: list[str] = []  # bitsandbytes' version once found: env() runs per estimate (~2 ms a lookup)


def _bnb_version() -> str | None:
    """bitsandbytes' installed version without importing it (its import is slow and chatty); None if absent.
    A found version is kept for the process (a plan's 30 estimates looked it up ~100 times); an absence is
    looked up again, so a ``pip install bitsandbytes`` made after it is seen.

    >>> _bnb_version() is None or isinstance(_bnb_version(), str)
    True
    """
    if _BNB_VERSION:
        return _BNB_VERSION[0]
    from importlib.metadata import PackageNotFoundError, version

    try:
        _BNB_VERSION.append(version("bitsandbytes"))
    except PackageNotFoundError:
        return None
    return _BNB_VERSION[0]


_LIBC: Any = None


def trim_host_heap() -> bool:
    """Give freed heap memory back to the OS now (glibc ``malloc_trim``). glibc keeps freed blocks below
    its (growing) mmap threshold in the process, and a fragmented heap cannot reuse them for the next
    large tensor, so building a model layer by layer can end up holding several freed layers; on Colab's
    12.7 GB of host RAM that matters. False where the C library is not glibc.

    >>> trim_host_heap() in (True, False)
    True
    """
    global _LIBC
    try:
        if _LIBC is None:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
        return bool(_LIBC.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def budget_bytes() -> int:
    """The device memory a run may use: the T4's usable bytes when emulating or on a T4, else the GPU's
    total, else the T4's (so CPU runs are judged against the GPU people will use)."""
    if torch.cuda.is_available() and not _EMULATING_T4:
        return torch.cuda.get_device_properties(0).total_memory
    return T4_USABLE_BYTES


def emulate_t4(enable: bool = True) -> dict[str, Any]:
    """Make a bigger GPU behave like a Colab T4: cap this process to a T4's usable memory and refuse
    bf16 and flash attention, so that peaks and OOMs match what a T4 would see (speed does not).

    >>> emulate_t4()["emulating_t4"], emulate_t4(False)["emulating_t4"]
    (True, False)
    """
    global _EMULATING_T4
    _EMULATING_T4 = bool(enable)
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, T4_USABLE_BYTES / total) if enable else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction)
    return env()


def emulating_t4() -> bool:
    return _EMULATING_T4


@contextlib.contextmanager
def t4_rules(on: bool = True) -> Iterator[None]:
    """Answer capability questions (native bf16, SDPA backends) as a T4 would inside the block,
    without capping memory: how the estimator checks a plan for a T4 from any machine.

    >>> with t4_rules():
    ...     native_bf16()
    False
    """
    global _EMULATING_T4
    prev = _EMULATING_T4
    _EMULATING_T4 = prev or on
    try:
        yield
    finally:
        _EMULATING_T4 = prev


def format_env(info: dict[str, Any] | None = None) -> str:
    """A readable multi-line report of :func:`env`, with a hint when no GPU is attached."""
    info = info or env()
    gib = lambda b: "-" if b is None else f"{b / GiB:.1f} GiB"  # noqa: E731
    lines = [
        f"platform      {info['platform']}  (python {info['python']}, torch {info['torch']})",
        f"device        {info['device']}" + (f"  {info['gpu']} sm{''.join(map(str, info['capability']))}" if info["gpu"] else ""),
        f"VRAM          {gib(info['vram_free_bytes'])} free of {gib(info['vram_total_bytes'])}",
        f"host RAM      {gib(info['host_ram_available_bytes'])} available of {gib(info['host_ram_total_bytes'])}",
        f"native bf16   {info['bf16_native']}",
        f"SDPA          {', '.join(info['sdpa_backends'])}",
        f"budget        {gib(info['budget_bytes'])}" + (("  (a T4's, emulated on this larger GPU)" if info["gpu"] else
                                                      "  (a T4's: T4 rules on, no GPU here to cap)") if info["emulating_t4"] else ""),
        f"GPU profile   {info.get('profile') or '-'}",
        f"smoke mode    {info['smoke']}",
    ]
    if not info["gpu"]:  # COLABKIT_SMOKE=0 asks for full sizes on the CPU: say which one this run has
        sizes = "in smoke mode (tiny sizes)" if info["smoke"] else "at full sizes (COLABKIT_SMOKE=0: slow on a CPU)"
        lines.append("No GPU attached: in Colab use Runtime -> Change runtime type -> T4 GPU. "
                     f"Running on the CPU {sizes}; the breakdown is still measured.")
    return "\n".join(lines)

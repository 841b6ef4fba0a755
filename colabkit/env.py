"""Where am I: Colab/Kaggle/local, which GPU, what it can run, how much memory there is.

>>> info = env()
>>> info["platform"] in ("colab", "kaggle", "local")
True
"""
from __future__ import annotations

import contextlib
import os
import platform as _platform
import sys
from typing import Any, Iterator

import torch

GiB = 1024**3
MiB = 1024**2

# A T4 reports 15360 MiB total (nvidia-smi 15360MiB; torch total_memory 15.64e9 bytes on Colab).
# About 14.5 GiB of it is usable by tensors: the CUDA context and cuBLAS/cuDNN workspaces take
# ~0.3-0.5 GiB and the caching allocator's fragmentation some more. Colab's VM has ~12.7 GB RAM.
GPU_PROFILES: dict[str, dict[str, Any]] = {
    "t4": {
        "name": "Tesla T4",
        "total_bytes": 15360 * MiB,
        "usable_bytes": int(14.5 * GiB),
        "capability": (7, 5),
        "native_bf16": False,
        "sdpa": ["math", "efficient"],
        "host_ram_bytes": int(12.7e9),
        "source": "T4 datasheet (16 GB GDDR6, 15360 MiB visible); usable = total minus CUDA context "
        "(~0.4 GiB) and allocator slack, as seen on Colab",
    },
}
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
    }
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info.update(
            gpu=torch.cuda.get_device_name(),
            capability=list(torch.cuda.get_device_capability()),
            vram_total_bytes=total,
            vram_free_bytes=free,
        )
    from importlib.metadata import PackageNotFoundError, version

    try:  # the version without importing it (its import is slow and chatty)
        info["bitsandbytes"] = version("bitsandbytes")
    except PackageNotFoundError:
        info["bitsandbytes"] = None
    return info


def budget_bytes() -> int:
    """The device memory a run may use: the T4's usable bytes when emulating or on a T4, else the GPU's
    total, else the T4's (so CPU runs are judged against the GPU people will use)."""
    if torch.cuda.is_available() and not _EMULATING_T4:
        return torch.cuda.get_device_properties(0).total_memory
    return T4_USABLE_BYTES


def emulate_t4(enable: bool = True) -> dict[str, Any]:
    """Make a bigger GPU behave like a Colab T4: cap this process to a T4's usable memory and refuse
    bf16 and flash attention, so that peaks and OOMs match what a T4 would see (speed does not).

    >>> emulate_t4()["emulating_t4"] in (True, False)
    True
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
        f"budget        {gib(info['budget_bytes'])}" + ("  (T4 emulation)" if info["emulating_t4"] else ""),
        f"smoke mode    {info['smoke']}",
    ]
    if not info["gpu"]:
        lines.append("No GPU attached: in Colab use Runtime -> Change runtime type -> T4 GPU. "
                     "Running on the CPU in smoke mode (tiny sizes); the breakdown is still measured.")
    return "\n".join(lines)

"""Same seed, same bytes: seeding every RNG a run reads, deterministic algorithms, and the CPU thread count.

What "same weights" means (``train``'s exact resume, two runs with one seed):

* **CPU**: bit-identical weights, losses and checkpoints for the same seed, plan, batch, torch build *and
  number of CPU threads*. The thread count changes how a matmul splits its sums (floating-point addition
  is not associative), so 1 and 2 threads give weights that differ in the last bits from the first step
  on (measured: ``gpt:2x64``, 3 steps, a different weights hash for 1, 2 and 4 threads, the same loss to 7
  digits; CPU, 2 cores, torch 2.13.0+cpu, 2026-11-26). A checkpoint therefore records the thread count and
  a resume runs with it (:func:`restore_threads`).
* **GPU**: bit-identical only with ``deterministic=True`` (``--deterministic``): without it cuBLAS and
  some kernels (atomics in scatter/index_add backward, cuDNN autotuning) may sum in a different order
  from run to run, so weights agree to rounding but not bit for bit. With it, the same GPU model, driver,
  CUDA, torch build and batch give the same bytes; a different GPU model may not.

:func:`seed_all` seeds Python's ``random``, NumPy and torch (every CUDA device too): a checkpoint stores
all four generators' states, so unseeded Python/NumPy generators made two checkpoints of the same run
differ byte-wise. :func:`deterministic` is the switch for the rest.

>>> seed_all(3); a = (random.random(), float(np.random.rand()), torch.rand(1).item())
>>> seed_all(3); a == (random.random(), float(np.random.rand()), torch.rand(1).item())
True
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator

import numpy as np
import torch

from .notices import warn

__all__ = ["seed_all", "deterministic", "CUBLAS_WORKSPACE", "restore_threads"]

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (CUDA >= 10.2; ":16:8" also works, slower)


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Deterministic algorithms for the block: ``torch.use_deterministic_algorithms(True)`` (an op with no
    deterministic implementation raises, naming itself), cuDNN without autotuning, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when CUDA starts: it is set here if it is not
    set yet, with a warning when CUDA has already started (set it first thing, e.g. at the notebook's
    top, or use ``--deterministic``, which sets it before anything touches the GPU). The previous
    settings come back at the end (the environment variable too, unless CUDA started meanwhile: then
    cuBLAS's workspace was sized from it).

    >>> with deterministic():
    ...     torch.are_deterministic_algorithms_enabled()
    True
    >>> torch.are_deterministic_algorithms_enabled()
    False
    """
    if not enabled:
        yield
        return
    env_before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if env_before not in (":4096:8", ":16:8"):
        if torch.cuda.is_initialized():
            warn("colabkit: deterministic mode: CUDA started before CUBLAS_WORKSPACE_CONFIG was set, so "
                          "cuBLAS may keep a non-deterministic workspace; set it before the first CUDA call "
                          f"(os.environ['CUBLAS_WORKSPACE_CONFIG'] = '{CUBLAS_WORKSPACE}') or use --deterministic")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        if env_before not in (":4096:8", ":16:8") and not torch.cuda.is_initialized():
            # nothing read it (CUDA never started): the environment as it was (on a GPU it stays, as cuBLAS
            # keeps the workspace it sized from it, and the estimate's workspace term reads it)
            if env_before is None:
                os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
            else:
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = env_before


def restore_threads(saved: int | None) -> None:
    """Run with the CPU thread count a checkpoint was written with (its results depend on it: see above),
    saying so when it changes."""
    if saved and saved != torch.get_num_threads():
        print(f"colabkit: resuming with {saved} CPU threads as the checkpoint was written (this process had "
              f"{torch.get_num_threads()}): the CPU sums in the same order, so the weights continue bit for bit")
        torch.set_num_threads(int(saved))

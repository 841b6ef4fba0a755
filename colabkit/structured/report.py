"""Measurements behind ``python -m colabkit structured`` and notebook 12: storage (measured by the
tracker and from the tensors, next to the formulas), exact recovery, matvec error and time against
dense, growth in N, and the issue's claims next to what is measured.

>>> r = structured_report(128, 4, reps=1)
>>> r["structured_bytes"] == r["structured_bytes_formula"], r["recovery_error"] < 1e-5
(True, True)
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from ..env import host_ram
from ..memory import MemoryTracker, fmt_bytes
from .hodlr import HODLRMatrix, hodlr_bytes
from .matrix import SemiseparableMatrix, relative_error, storage_bytes

DENSE_COPIES = 8  # fp32 dense-size tensors alive at once in structured_report (A, R's dense form, 2 float64 copies)


def best_time(fn: Callable[[], Any], reps: int = 5, inner: int = 10) -> float:
    """Fastest mean seconds per call over ``reps`` rounds of ``inner`` calls (after one warm-up)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = math.inf
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def tracked_bytes(build: Callable[[], Any]) -> tuple[Any, int]:
    """Build something under :class:`colabkit.MemoryTracker` and return it with the bytes it keeps alive."""
    with MemoryTracker(device="cpu", alert_at=None) as mt:
        obj = build()
        live = sum(mt.current().values())
    return obj, live


def structured_report(n: int = 2048, rank: int = 16, seed: int = 0, reps: int = 5) -> dict[str, Any]:
    """The CLI's record: build an exactly semiseparable fp32 matrix, recover it from its dense form,
    compare products and timings with dense. ``matvec_time_ratio`` = structured / dense seconds."""
    if rank < 1:
        raise ValueError(f"--rank {rank}: the low-rank part needs rank ≥ 1 (e.g. --rank 16)")
    if n < 4 * rank + 6:
        raise ValueError(f"--n {n} is too small for --rank {rank}: exact recovery needs N ≥ 4r + 6 = {4 * rank + 6}")
    need, free = DENSE_COPIES * n * n * 4, host_ram().get("available")
    if free and need > free:  # the dense reference, its recovery and float64 error temporaries: N² each
        raise ValueError(f"--n {n} builds dense N×N references (~{fmt_bytes(need)}) but only {fmt_bytes(free)} of RAM "
                         f"is free: use --n ≤ {int(math.sqrt(free / (DENSE_COPIES * 4)))}")
    S, tracked = tracked_bytes(lambda: SemiseparableMatrix.random(n, rank, seed=seed))
    A = S.to_dense()
    R = SemiseparableMatrix.from_dense(A, rank)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    ref = A @ x
    half = S.with_factors(torch.float16)
    t_dense = best_time(lambda: A @ x, reps)
    t_struct = best_time(lambda: S @ x, reps)
    return {
        "n": n, "rank": rank,
        "dense_bytes": A.untyped_storage().nbytes(),
        "structured_bytes": S.nbytes(),
        "storage_ratio": S.nbytes() / A.untyped_storage().nbytes(),
        "recovery_error": R.error(A),
        "matvec_error": relative_error(S @ x, ref),
        "matvec_time_ratio": t_struct / t_dense,
        # supporting figures
        "structured_bytes_formula": storage_bytes(n, rank), "tracked_bytes": tracked,
        "fp16_factor_bytes": half.nbytes(),
        "fp16_storage_ratio": half.nbytes() / A.untyped_storage().nbytes(),
        "fp16_matvec_error": relative_error(half @ x, ref),
        "dense_time_s": t_dense, "structured_time_s": t_struct,
        "device": "cpu", "threads": torch.get_num_threads(),
    }


def format_report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"N={r['n']} rank={r['rank']}  dense {fmt_bytes(r['dense_bytes'])}, "
        f"tridiagonal+rank-r {fmt_bytes(r['structured_bytes'])} ({r['storage_ratio']:.2%} of dense; "
        f"formula {r['structured_bytes_formula']} B, tracker {r['tracked_bytes']} B)",
        f"fp16 factors: {fmt_bytes(r['fp16_factor_bytes'])} ({r['fp16_storage_ratio']:.2%}), "
        f"matvec error {r['fp16_matvec_error']:.1e}",
        f"recovery error {r['recovery_error']:.1e}   matvec error {r['matvec_error']:.1e}",
        f"matvec {r['structured_time_s'] * 1e6:.0f} us vs dense {r['dense_time_s'] * 1e6:.0f} us: {r['matvec_time_ratio']:.3f}x",
    ])


def scaling(ns: list[int], rank: int = 16, leaf: int = 64, k: int = 1, dense_max: int = 4096,
            reps: int = 3) -> list[dict[str, Any]]:
    """Per N: measured bytes and matvec seconds (x of shape (N, k)) for dense (only up to ``dense_max``),
    tridiagonal+rank-r in fp32 and with fp16 factors, and HODLR with leaves of ``leaf`` rows."""
    rows = []
    for n in ns:
        S = SemiseparableMatrix.random(n, rank, seed=0)
        half = S.with_factors(torch.float16)
        levels = max(0, int(math.log2(n // leaf)))
        H = HODLRMatrix.random(n, rank, levels, seed=0)
        x = torch.randn(n, k)
        row = {"n": n, "levels": levels, "dense_bytes": n * n * 4, "semi_bytes": S.nbytes(), "fp16_bytes": half.nbytes(),
               "hodlr_bytes": H.nbytes(), "hodlr_formula": hodlr_bytes(n, rank, levels),
               "semi_s": best_time(lambda: S @ x, reps), "fp16_s": best_time(lambda: half @ x, reps),
               "hodlr_s": best_time(lambda: H @ x, reps), "dense_s": None}
        if n <= dense_max:
            A = S.to_dense()
            row["dense_s"] = best_time(lambda: A @ x, reps)
            del A
        rows.append(row)
    return rows


def max_rank_for_saving(n: int, saving: float, factor_bytes: int = 4) -> int:
    """Largest r with storage_bytes(n, r, factor_bytes) ≤ (1 - saving) · N²·4 (fp32 tridiagonal).

    >>> max_rank_for_saving(2048, 0.988), max_rank_for_saving(2048, 0.993, factor_bytes=2)
    (10, 11)
    """
    return max(0, int(((1 - saving) * n * n * 4 - (3 * n - 2) * 4) // (2 * n * factor_bytes)))


def register_cli(subcommand) -> None:
    """Add ``structured`` with the CLI's ``subcommand`` decorator (called by ``colabkit.__main__.main``)."""

    def add_args(p):
        p.add_argument("--n", type=int, default=2048, help="matrix size N")
        p.add_argument("--rank", type=int, default=16, help="rank r of the low-rank part")
        p.add_argument("--seed", type=int, default=0, help="seed of the random test matrix")
        p.add_argument("--reps", type=int, default=5, help="timing rounds (the fastest is kept)")

    @subcommand("structured", "tridiagonal + low-rank matrices against dense: storage, recovery, matvec error and time",
                add_args, format_report)
    def _structured(args):
        return structured_report(args.n, args.rank, seed=args.seed, reps=args.reps)

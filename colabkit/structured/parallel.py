"""Where the factors live: split across processes (torch.distributed), or kept in host memory.

Sharded: rank p of P holds rows [a_p, b_p) of U and V and the whole tridiagonal. For x replicated,
Vᵀx = Σ_p V_pᵀ x_p is one all-reduce of an (r, k) tensor; each rank then forms its rows U_p (Vᵀx) and
an all-gather assembles y. Per rank: (3N-2)·4 + 2·(N/P)·r·4 bytes. (Plain torch.distributed, gloo on
the CPU, NCCL on GPUs; the project's ZeRO/FSDP engine can take this over when it exists.)

Offloaded: U and V stay in host memory (pinned on CUDA so the copy is asynchronous) and are copied to
the compute device for each product; the device keeps only the tridiagonal between products. The
copy is the same code on a CPU, where "host" and "device" are both RAM (a simulation: it shows the
code path and the copy's cost, not a saving).

>>> S = SemiseparableMatrix.random(32, 2, seed=0)
>>> off = OffloadedSemiseparable(S, "cpu")
>>> x = torch.randn(32)
>>> torch.allclose(off @ x, S @ x), off.device_bytes() == (3 * 32 - 2) * 4
(True, True)
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import collective, install_strict, to_compute
from ..device import to_device_async
from .matrix import SemiseparableMatrix, relative_error, tridiag_matmul


class ShardedSemiseparable:
    """One process's part of a :class:`SemiseparableMatrix`: all of T, rows [start, stop) of U and V."""

    def __init__(self, S: SemiseparableMatrix, rank: int, world: int, group: Any = None):
        bounds = [S.n * p // world for p in range(world + 1)]  # as even as N allows
        self.start, self.stop, self.n, self.group, self.world = bounds[rank], bounds[rank + 1], S.n, group, world
        self.chunk = max(b - a for a, b in zip(bounds, bounds[1:]))
        self.tri = tuple(t.detach().clone() for t in (S.sub, S.diag, S.sup))
        self.U = S.U.detach()[self.start:self.stop].clone()  # clone: keep only this slice's storage
        self.V = S.V.detach()[self.start:self.stop].clone()

    def matmul(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """(T + UVᵀ) x on every rank for a replicated x (N,) or (N, k). ``reduce=False`` skips the
        all-reduce (each rank then uses only its own slice of Vᵀx): a negative control, never correct."""
        X = x.reshape(self.n, -1)
        z = self.V.to(X.dtype).T @ X[self.start:self.stop]  # (r, k) partial sum of Vᵀx
        if reduce:  # colabkit's one collective helper: on the rank's compute device (NCCL's rule)
            z = collective("all_reduce", to_compute(z), group=self.group)
        local = self.U.to(X.dtype) @ z  # (rows, k)
        padded = to_compute(torch.zeros(self.chunk, X.shape[1], dtype=X.dtype, device=X.device))
        padded[:len(local)] = local
        parts = collective("all_gather", padded, group=self.group)
        bounds = [self.n * p // self.world for p in range(self.world + 1)]
        low = torch.cat([part[:b - a] for part, a, b in zip(parts, bounds, bounds[1:])])
        return (tridiag_matmul(*(t.to(X.dtype) for t in self.tri), X) + low).reshape(x.shape)

    __matmul__ = matmul

    def nbytes(self) -> int:
        """Bytes this rank holds (measured from its tensors)."""
        return sum(t.untyped_storage().nbytes() for t in (*self.tri, self.U, self.V))


def _shard_worker(rank: int, world: int, store: str, n: int, r: int, k: int, queue: Any) -> None:
    torch.set_num_threads(1)
    # the ranks meet through a file of this run's own, not a TCP port picked beforehand (two runs at once
    # could pick the same one)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    install_strict()  # tests: NCCL's device rule (colabkit.collectives)
    try:
        S = SemiseparableMatrix.random(n, r, seed=0)  # the same matrix on every rank (same seed) ...
        shard = ShardedSemiseparable(S, rank, world)
        dense = S.to_dense()
        del S  # ... of which this rank keeps only its shard
        x = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
        ref = dense @ x
        queue.put({"rank": rank, "bytes": shard.nbytes(), "rows": shard.stop - shard.start,
                   "error": relative_error(shard @ x, ref),
                   "error_without_allreduce": relative_error(shard.matmul(x, reduce=False), ref)})
    finally:
        dist.destroy_process_group()


def sharded_run(world: int = 2, n: int = 256, rank: int = 8, k: int = 4) -> list[dict]:
    """Spawn ``world`` gloo processes on this machine, each holding a row slice of the factors; returns
    per rank its measured bytes and the relative error of the sharded product against dense (and the
    error when the all-reduce is skipped, which must be large)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="colabkit-ranks-") as d:
        mp.spawn(_shard_worker, args=(world, os.path.join(d, "store"), n, rank, k, queue), nprocs=world, join=True)
    return sorted((queue.get() for _ in range(world)), key=lambda d: d["rank"])


def sharded_bytes(n: int, rank: int, world: int, factor_bytes: int = 4) -> int:
    """Formula for the largest rank's bytes: replicated tridiagonal + its ⌈N/P⌉ rows of U and V."""
    return (3 * n - 2) * 4 + 2 * -(-n // world) * rank * factor_bytes


class OffloadedSemiseparable:
    """T on ``device``; U, V in host memory, copied to ``device`` for each product and dropped after."""

    def __init__(self, S: SemiseparableMatrix, device: str | torch.device):
        self.device = torch.device(device)
        self.tri = tuple(t.detach().to(self.device, copy=True) for t in (S.sub, S.diag, S.sup))
        host = [t.detach().to("cpu", copy=True) for t in (S.U, S.V)]  # a distinct host copy, even on a CPU
        if self.device.type == "cuda":
            host = [t.pin_memory() for t in host]  # page-locked: the copy below can overlap compute
        self.host = tuple(host)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        U, V = (to_device_async(t, self.device) for t in self.host)  # host -> device, non-blocking on CUDA
        return SemiseparableMatrix(*self.tri, U, V).matmul(x)

    __matmul__ = matmul

    def device_bytes(self) -> int:
        """Bytes resident on the compute device between products: the tridiagonal only."""
        return sum(t.untyped_storage().nbytes() for t in self.tri)

    def host_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.host)

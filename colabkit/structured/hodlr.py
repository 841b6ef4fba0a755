"""Hierarchical (HODLR) matrices: the two off-diagonal blocks of every node of a binary tree are
rank r, the 2^L leaves on the diagonal are dense.

Level ℓ (1..L) splits 2^(ℓ-1) nodes into two children of size m = N/2^ℓ; every row belongs to exactly
one child per level, so the factors of one level are an (N, r) pair (U_ℓ, V_ℓ) and the upper block of a
node is U_ℓ[c0] V_ℓ[c1]ᵀ, the lower one U_ℓ[c1] V_ℓ[c0]ᵀ. Storage in numbers: N·N/2^L (leaves) +
2·N·r·L (factors). With leaves of a fixed size b, L = log2(N/b): **O(N·r·log N)**, not O(N log log N).
Nested bases (HSS/H²) would bring it to O(N·r); nothing here (or in the literature we know) gives
O(N log log N) for this format.

>>> H = HODLRMatrix.random(64, 2, levels=3, seed=0)
>>> x = torch.randn(64)
>>> torch.allclose(H @ x, H.to_dense() @ x, rtol=1e-5, atol=1e-5)
True
>>> H.nbytes() == hodlr_bytes(64, 2, 3)
True
"""
from __future__ import annotations

import torch

from .matrix import relative_error


def hodlr_bytes(n: int, rank: int, levels: int, dtype_bytes: int = 4) -> int:
    """Formula: leaves N·(N/2^L) + factors 2·N·r·L numbers.

    >>> hodlr_bytes(2048, 16, 5) == (2048 * 64 + 2 * 2048 * 16 * 5) * 4
    True
    """
    return (n * (n >> levels) + 2 * n * rank * levels) * dtype_bytes


def _check(n: int, rank: int, levels: int) -> None:
    if levels < 0 or n % (1 << levels) or (n >> levels) < 1:
        raise ValueError(f"N={n} must be divisible by 2^levels={1 << levels}: pick fewer levels or a power-of-two N")
    if levels and rank > n >> levels:
        raise ValueError(f"rank {rank} exceeds the smallest off-diagonal block ({n >> levels}): use fewer levels")


def _diag_blocks(A: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` diagonal blocks of A as a (count, b, b) tensor."""
    b = A.shape[0] // count
    return A.reshape(count, b, count, b).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


class HODLRMatrix:
    """``leaves`` (2^L, b, b) and per level ``U[ℓ-1]``, ``V[ℓ-1]`` of shape (N, r)."""

    def __init__(self, leaves: torch.Tensor, U: list[torch.Tensor], V: list[torch.Tensor]):
        q, b, _ = leaves.shape
        self.leaves, self.U, self.V = leaves, list(U), list(V)
        _check(q * b, self.rank, self.levels)
        if q != 1 << self.levels:
            raise ValueError(f"{len(U)} levels need 2^{len(U)} leaves, got {q}")

    @property
    def n(self) -> int:
        return self.leaves.shape[0] * self.leaves.shape[1]

    @property
    def levels(self) -> int:
        return len(self.U)

    @property
    def rank(self) -> int:
        return self.U[0].shape[1] if self.U else 0

    @classmethod
    def random(cls, n: int, rank: int, levels: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> "HODLRMatrix":
        _check(n, rank, levels)
        g = torch.Generator().manual_seed(seed)
        leaves = torch.randn(1 << levels, n >> levels, n >> levels, generator=g, dtype=dtype)
        U = [torch.randn(n, rank, generator=g, dtype=dtype) / rank ** 0.25 for _ in range(levels)]
        V = [torch.randn(n, rank, generator=g, dtype=dtype) / rank ** 0.25 for _ in range(levels)]
        return cls(leaves, U, V)

    @classmethod
    def from_dense(cls, A: torch.Tensor, rank: int, levels: int) -> "HODLRMatrix":
        """Truncated SVD (best rank r) of every off-diagonal block, batched per level."""
        n = A.shape[0]
        _check(n, rank, levels)
        A = A.detach().float()
        U, V = [], []
        for lvl in range(1, levels + 1):
            D = _diag_blocks(A, 1 << (lvl - 1))  # (P, 2m, 2m) nodes of this level
            m = n >> lvl
            Ul, Vl = torch.empty(n, rank), torch.empty(n, rank)
            Uv, Vv = Ul.view(-1, 2, m, rank), Vl.view(-1, 2, m, rank)
            for c, block in ((0, D[:, :m, m:]), (1, D[:, m:, :m])):  # upper: rows c0 x cols c1; lower: c1 x c0
                P, s, Qh = torch.linalg.svd(block, full_matrices=False)
                Uv[:, c] = P[..., :rank] * s[:, None, :rank]
                Vv[:, 1 - c] = Qh[:, :rank].transpose(1, 2)
            U.append(Ul)
            V.append(Vl)
        return cls(_diag_blocks(A, 1 << levels).contiguous(), U, V)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """H x for x (N,) or (N, k): leaves then, per level, z = V[c]ᵀ x[c] and y[c] += U[c] z[other child];
        O(N·b + N·r·L) per column."""
        X = x.reshape(self.n, -1)
        q, b, _ = self.leaves.shape
        k = X.shape[1]
        y = (self.leaves.to(X.dtype) @ X.view(q, b, k)).reshape(self.n, k)
        for lvl, (Ul, Vl) in enumerate(zip(self.U, self.V), start=1):
            m, r = self.n >> lvl, self.rank
            Xv = X.view(-1, 2, m, k)
            z = torch.einsum("pcmr,pcmk->pcrk", Vl.to(X.dtype).view(-1, 2, m, r), Xv)  # (P, 2, r, k)
            y = y + torch.einsum("pcmr,pcrk->pcmk", Ul.to(X.dtype).view(-1, 2, m, r), z.flip(1)).reshape(self.n, k)
        return y.reshape(x.shape)

    __matmul__ = matmul

    def to_dense(self) -> torch.Tensor:
        """Materialised block by block (independent of :meth:`matmul`)."""
        n, (q, b, _) = self.n, self.leaves.shape
        D = torch.zeros(n, n, dtype=self.leaves.dtype)
        for i in range(q):
            D[i * b:(i + 1) * b, i * b:(i + 1) * b] = self.leaves[i]
        for lvl, (Ul, Vl) in enumerate(zip(self.U, self.V), start=1):
            m = n >> lvl
            for p in range(1 << (lvl - 1)):
                c0, c1 = slice(2 * p * m, (2 * p + 1) * m), slice((2 * p + 1) * m, (2 * p + 2) * m)
                D[c0, c1] = Ul[c0] @ Vl[c1].T
                D[c1, c0] = Ul[c1] @ Vl[c0].T
        return D

    def error(self, A: torch.Tensor) -> float:
        return relative_error(self.to_dense(), A)

    def nbytes(self) -> int:
        """Bytes of the storages held (measured)."""
        return sum(t.untyped_storage().nbytes() for t in (self.leaves, *self.U, *self.V))

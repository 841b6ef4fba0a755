"""Tridiagonal + rank-r matrices ``A = T + U Vᵀ``: O(N·r) storage and matvec, autograd-friendly,
built from factors or fitted to a dense matrix, with fp16 factors next to an fp32 tridiagonal.

Storage (numbers): dense N², tridiagonal 3N-2, factors 2·N·r. At N=2048, r=16 in fp32 that is
(3·2048-2)·4 + 2·2048·16·4 = 286,712 bytes against 16,777,216: 1.71% of dense.

>>> S = SemiseparableMatrix.random(64, 4, seed=0)
>>> x = torch.randn(64)
>>> torch.allclose(S @ x, S.to_dense() @ x, rtol=1e-5, atol=1e-5)
True
>>> S.nbytes() == storage_bytes(64, 4)
True
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def storage_bytes(n: int, rank: int, factor_bytes: int = 4, tri_bytes: int = 4) -> int:
    """Formula: tridiagonal (3N-2)·tri_bytes + factors 2·N·r·factor_bytes.

    >>> round(storage_bytes(2048, 16) / (2048 * 2048 * 4), 5)
    0.01709
    """
    return (3 * n - 2) * tri_bytes + 2 * n * rank * factor_bytes


def relative_error(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """‖approx − ref‖_F / ‖ref‖_F, computed in float64.

    >>> round(relative_error(torch.ones(4) * 1.1, torch.ones(4)), 6)
    0.1
    """
    ref = ref.detach().double()
    return float(torch.linalg.norm(approx.detach().double() - ref) / torch.linalg.norm(ref))


def tridiag_matmul(sub: torch.Tensor, diag: torch.Tensor, sup: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """T @ x for T with sub-diagonal ``sub`` (N-1), diagonal ``diag`` (N), super-diagonal ``sup`` (N-1);
    x is (N,) or (N, k). Out-of-place (pads instead of slice writes) so autograd sees plain ops."""
    if x.dim() == 1:
        return tridiag_matmul(sub, diag, sup, x[:, None])[:, 0]
    # y_i = d_i x_i + sup_i x_{i+1} + sub_{i-1} x_{i-1}
    return (diag[:, None] * x + F.pad(sup[:, None] * x[1:], (0, 0, 0, 1))
            + F.pad(sub[:, None] * x[:-1], (0, 0, 1, 0)))


def band(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sub, diag, sup) of a square matrix."""
    return A.diagonal(-1), A.diagonal(), A.diagonal(1)


def tridiag_dense(sub: torch.Tensor, diag: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
    return torch.diag(diag) + torch.diag(sup, 1) + torch.diag(sub, -1)


def _svd_r(A: torch.Tensor, rank: int, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-r factors (U·S, V) of A (Eckart-Young); randomized range finder when ``exact`` is off."""
    if exact:
        P, s, Qh = torch.linalg.svd(A, full_matrices=False)
        return P[:, :rank] * s[:rank], Qh[:rank].T.contiguous()
    with torch.random.fork_rng(devices=[]):  # deterministic sketch, the caller's RNG untouched
        torch.manual_seed(0)
        # in float64 (N x (r+10) sketches: cheap): a float32 sketch of an exactly rank-r A left 1.0e-6 of rounding
        # at N=2048, r=16, just above from_dense's tol -- three full O(N³) SVDs then ran and were all discarded
        P, s, Q = torch.svd_lowrank(A.double(), q=min(rank + 10, min(A.shape)), niter=2)
    return (P[:, :rank] * s[:rank]).to(A.dtype), Q[:, :rank].to(A.dtype).contiguous()


def _band_of_lowrank(A: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The band (sub, diag, sup) of the rank-r part L of A = T + L, read only from entries of A off the
    tridiagonal band (where A equals L). For far-apart row/column sets I, J with A[I, J] = P S Qᵀ
    (rank r): L[i, j] = A[i, J] Q S⁻¹ Pᵀ A[I, j] whenever A[i, J] and A[I, j] lie off the band — exact
    for rank-r L (the r×r gauge cancels). Two pairs (I, J) near the top and near the bottom cover every
    band entry; needs N ≥ 4r + 6."""
    n = A.shape[0]
    m = max(rank, min(4 * rank, (n - 6) // 4))  # bigger sets, better-conditioned A[I, J]
    idx = torch.arange(n, device=A.device)
    pairs = {  # name: (I rows, J cols); |i - j| ≥ 2 inside each pair
        "top": (idx[:m], idx[m + 2:2 * m + 2]),
        "bottom": (idx[n - m:], idx[n - 2 * m - 2:n - m - 2]),
    }
    out = [torch.zeros(n - 1, dtype=A.dtype, device=A.device), torch.zeros(n, dtype=A.dtype, device=A.device),
           torch.zeros(n - 1, dtype=A.dtype, device=A.device)]
    # band entry (i, j) for sub (i=k+1, j=k), diag (k, k), sup (k, k+1)
    for o, (di, dj) in enumerate(((1, 0), (0, 0), (0, 1))):
        k = torch.arange(len(out[o]), device=A.device)
        i, j = k + di, k + dj
        use_bottom = i <= n - 2 * m - 4  # 'bottom' pair reaches rows up to n-2m-4, 'top' rows from 2m+3
        for name, sel in (("bottom", use_bottom), ("top", ~use_bottom)):
            I, J = pairs[name]
            P, s, Qh = torch.linalg.svd(A[I][:, J], full_matrices=False)
            P, s, Q = P[:, :rank], s[:rank], Qh[:rank].T
            s_inv = torch.where(s > s[0] * 1e-6, 1 / s, 0.0)  # pseudo-inverse: A[I, J] may have rank < r
            u = A[i[sel]][:, J] @ (Q * s_inv)  # (k, r)
            v = A[I][:, j[sel]].T @ P  # (k, r)
            out[o][sel] = (u * v).sum(-1)
    return out[0], out[1], out[2]


class SemiseparableMatrix:
    """``T + U Vᵀ``: T tridiagonal (sub, diag, sup), U and V of shape (N, r). Any part may require grad;
    products are plain torch ops, so autograd differentiates them. Factors may be stored in a lower
    precision than the tridiagonal: they are cast to the input's dtype for each product."""

    def __init__(self, sub: torch.Tensor, diag: torch.Tensor, sup: torch.Tensor, U: torch.Tensor, V: torch.Tensor):
        n = diag.shape[0]
        if sub.shape != (n - 1,) or sup.shape != (n - 1,):
            raise ValueError(f"sub/sup must have N-1={n - 1} entries, got {tuple(sub.shape)} and {tuple(sup.shape)}")
        if U.dim() != 2 or U.shape != V.shape or U.shape[0] != n:
            raise ValueError(f"U and V must both be (N={n}, r), got {tuple(U.shape)} and {tuple(V.shape)}")
        self.sub, self.diag, self.sup, self.U, self.V = sub, diag, sup, U, V

    @property
    def n(self) -> int:
        return self.diag.shape[0]

    @property
    def rank(self) -> int:
        return self.U.shape[1]

    def __repr__(self) -> str:
        return f"SemiseparableMatrix(n={self.n}, rank={self.rank}, tri={self.diag.dtype}, factors={self.U.dtype})"

    @classmethod
    def random(cls, n: int, rank: int, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = None) -> "SemiseparableMatrix":
        """Gaussian tridiagonal and factors (U, V entries of variance 1/√r, so (UVᵀ)_ij has variance 1)."""
        if n < 2 or not 1 <= rank < n:
            raise ValueError(f"need N ≥ 2 and 1 ≤ rank < N, got N={n}, rank={rank}")
        g = torch.Generator().manual_seed(seed)
        t = [torch.randn(k, generator=g, dtype=dtype) for k in (n - 1, n, n - 1)]
        U, V = (torch.randn(n, rank, generator=g, dtype=dtype) / math.sqrt(math.sqrt(rank)) for _ in range(2))
        return cls(*(x.to(device) for x in (*t, U, V)))

    @classmethod
    def from_dense(cls, A: torch.Tensor, rank: int, refine: int = 10, tol: float = 1e-6) -> "SemiseparableMatrix":
        """Fit T + UVᵀ to a dense A. Starts from the better of (a) the exact band recovery of
        :func:`_band_of_lowrank` (exact when A is tridiagonal + rank r), (b) the truncated SVD of A with
        its band zeroed and (c) the truncated SVD of A (so the result is never worse than the best rank-r
        matrix alone); then alternates T = band(A − UVᵀ), UVᵀ = SVD_r(A − T) — each step the exact
        minimiser over its part, so ‖A − T − UVᵀ‖_F never increases (a local, not global, optimum).
        Each SVD here is a full one, O(N³): fine for N of a few thousand."""
        if A.dim() != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"need a square matrix, got {tuple(A.shape)}")
        n = A.shape[0]
        if not 1 <= rank < n:
            raise ValueError(f"rank must be between 1 and N-1={n - 1}, got {rank}")
        A = A.detach().float()
        best, best_err = None, math.inf
        if n >= 4 * rank + 6:
            T = [b0 - b1 for b0, b1 in zip(band(A), _band_of_lowrank(A, rank))]
            if not all(torch.isfinite(t).all() for t in T):  # degenerate far blocks (A[I, J] ≈ 0)
                T = [b.clone() for b in band(A)]
            best = cls(*T, *_svd_r(A - tridiag_dense(*T), rank, exact=False))
            best_err = best.error(A)
            if best_err <= tol:
                return best
        for start in (A - tridiag_dense(*band(A)), A):  # SVD of the off-band part; of A (Eckart-Young)
            U, V = _svd_r(start, rank)
            S = cls(*(b.clone() for b in band(A - U @ V.T)), U, V)
            if S.error(A) < best_err:
                best, best_err = S, S.error(A)
        for _ in range(refine):
            U, V = _svd_r(A - tridiag_dense(best.sub, best.diag, best.sup), rank)
            S = cls(*(b.clone() for b in band(A - U @ V.T)), U, V)
            err = S.error(A)
            stalled = err >= best_err * (1 - 1e-4)
            if err < best_err:
                best, best_err = S, err
            if stalled or best_err <= tol:
                break
        return best

    # ----- products ----------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(T + UVᵀ) x for x of shape (N,) or (N, k), in O(N·r·k): V first, so no N×N ever exists."""
        if x.shape[0] != self.n:
            raise ValueError(f"x has {x.shape[0]} rows, the matrix is {self.n}×{self.n}")
        U, V = self.U.to(x.dtype), self.V.to(x.dtype)
        return tridiag_matmul(self.sub.to(x.dtype), self.diag.to(x.dtype), self.sup.to(x.dtype), x) + U @ (V.T @ x)

    __matmul__ = matmul

    def to_dense(self) -> torch.Tensor:
        """The N×N matrix, materialised (the reference the products are checked against)."""
        dt = self.diag.dtype
        return tridiag_dense(self.sub, self.diag, self.sup) + self.U.to(dt) @ self.V.to(dt).T

    def error(self, A: torch.Tensor) -> float:
        """Relative Frobenius error against a dense A."""
        return relative_error(self.to_dense(), A)

    # ----- precision and storage -----------------------------------------------------------------
    def with_factors(self, dtype: torch.dtype) -> "SemiseparableMatrix":
        """The same matrix with U, V stored in ``dtype`` (e.g. fp16) and the tridiagonal unchanged."""
        return SemiseparableMatrix(self.sub, self.diag, self.sup, self.U.to(dtype), self.V.to(dtype))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.sub, self.diag, self.sup, self.U, self.V

    def nbytes(self) -> int:
        """Bytes of the storages actually held (measured from the tensors, not the formula)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

"""A learned causal semiseparable sequence-mixing layer, a drop-in for a GPT block's attention.

Per head h the mixing matrix over positions is M_h = diag(d) + subdiag(e) + tril(U Vᵀ) (lower
triangle of the rank-r part, diagonal included), so y_i = d_i v_i + e_{i-1} v_{i-1} + U_iᵀ Σ_{j≤i} V_j v_jᵀ:
a running (r × head_dim) state, O(S·r) per channel instead of attention's O(S²). Unlike attention the
mixing does not depend on the input (like an MLP-Mixer or a Toeplitz/SSM mixer); it is the causal
"semiseparable matrix" view of linear recurrences.

>>> mix = SemiseparableMixing(n=32, d=16, n_head=2, rank=4)
>>> x = torch.randn(3, 20, 16)
>>> mix(x).shape
torch.Size([3, 20, 16])
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..models import GPT, build_model


class SemiseparableMixing(nn.Module):
    """(B, S, D) -> (B, S, D) with S ≤ n: values, causal semiseparable mixing per head, projection.

    U is stored as U_i = c_i Û_i with a fixed row scale c_i = 1/(i+1): Û_i · Σ_{j≤i} V_j v_j / (i+1) is a
    weighted prefix *mean*, bounded in i (an unscaled U let the prefix sum grow with i and training
    stalled, measured while building this layer). Starts near the identity (d = 1, e = 0, Û small
    noise, V_j = 1 in the first component), so the first steps learn which prefix to mix in."""

    def __init__(self, n: int, d: int, n_head: int, rank: int, bias: bool = True):
        super().__init__()
        if d % n_head:
            raise ValueError(f"width {d} is not divisible by {n_head} heads")
        if rank < 1:
            raise ValueError(f"rank {rank}: the mixing's low-rank part needs rank ≥ 1 (e.g. rank=8)")
        self.n, self.n_head, self.rank = n, n_head, rank
        self.value = nn.Linear(d, d, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.diag = nn.Parameter(torch.ones(n_head, n))
        self.sub = nn.Parameter(torch.zeros(n_head, n - 1))
        U, V = 0.02 * torch.randn(n_head, n, rank), 0.02 * torch.randn(n_head, n, rank)
        V[..., 0] = 1.0
        self.U_hat, self.V = nn.Parameter(U), nn.Parameter(V)
        self.register_buffer("row_scale", 1.0 / torch.arange(1, n + 1), persistent=False)

    @property
    def U(self) -> torch.Tensor:
        """(H, n, r) left factors, c_i Û_i."""
        return self.U_hat * self.row_scale[:, None]

    def mix(self, v: torch.Tensor) -> torch.Tensor:
        """v (B, H, S, dh) -> M[:S, :S] v per head, in O(S·r·dh)."""
        S = v.shape[2]
        U, V = self.U[:, :S], self.V[:, :S]  # (H, S, r): a causal matrix's top-left block is its prefix
        state = torch.cumsum(V[None, :, :, :, None] * v[:, :, :, None, :], dim=2)  # (B, H, S, r, dh)
        y = torch.einsum("hsr,bhsrk->bhsk", U, state) + self.diag[None, :, :S, None] * v
        return y + nn.functional.pad(self.sub[None, :, :S - 1, None] * v[:, :, :-1], (0, 0, 1, 0))

    def matrix(self, S: int | None = None) -> torch.Tensor:
        """The dense (H, S, S) mixing matrices, materialised (the reference for :meth:`mix`)."""
        S = S or self.n
        U, V = self.U[:, :S], self.V[:, :S]
        M = torch.tril(U @ V.transpose(1, 2))
        return M + torch.diag_embed(self.diag[:, :S]) + torch.diag_embed(self.sub[:, :S - 1], offset=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        if S > self.n:
            raise ValueError(f"sequence {S} is longer than the mixing matrix ({self.n})")
        v = self.value(x).view(B, S, self.n_head, D // self.n_head).transpose(1, 2)  # (B, H, S, dh)
        return self.proj(self.mix(v).transpose(1, 2).reshape(B, S, D))


def structured_gpt(model: str | GPT = "gpt-tiny", rank: int = 8, seq: int | None = None, **kw: Any) -> GPT:
    """A GPT whose every block mixes positions with :class:`SemiseparableMixing` instead of attention.

    >>> m = structured_gpt("gpt-tiny", rank=4)
    >>> type(m.blocks[0].attn).__name__, m(torch.zeros(2, 8, dtype=torch.long)).shape
    ('SemiseparableMixing', torch.Size([2, 8, 256]))
    """
    if isinstance(model, str):
        model = build_model(model, seq=seq, **kw)
    if not isinstance(model, GPT):
        raise ValueError(f"structured_gpt swaps the attention of colabkit's GPT, got {type(model).__name__}")
    cfg = model.config
    for block in model.blocks:
        device = block.attn.qkv.weight.device
        block.attn = SemiseparableMixing(cfg.block_size, cfg.n_embd, cfg.n_head, rank, bias=cfg.bias).to(device)
    return model

"""``galore:R[:T]``: GaLore (Zhao et al. 2024), Adam on gradients projected to rank R, from the
``galore-torch`` package. Every T steps (default 200) each matrix's projector is recomputed from an SVD
of its gradient; Adam's two moments then live in the R-dimensional space.

State per projected m x n matrix (m >= n): two moments of m x R plus the n x R projector, in fp32:
4·(2·R·m + R·n) bytes instead of AdamW's 8·m·n. Embeddings, the output layer and vectors keep plain
Adam (as in the paper). The package's 8-bit variant (GaLoreAdamW8bit) requires CUDA inside the package
itself, so colabkit exposes the 32-bit one, which runs everywhere.

Found by measuring: galore-torch 1.0 keeps each projector as a *slice view* of the full SVD factor
(``Vh[:rank, :]``), so a projector holds min(m, n)^2 floats instead of R·min(m, n) -- for a 4096 x 4096
matrix at R = 128, 64 MiB instead of 2 MiB. :class:`GaLoreAdamW` compacts the projectors after each
step, so the state matches the paper's formula (the test measures both).

>>> round(galore_state_bytes((768, 256), 32) / (8 * 768 * 256), 3)   # of AdamW's 8 B per parameter
0.146
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ..plan import Context, Plan, PlanError, Technique, register
from .optimizers import STATE_FORMULAS
from ..notices import warn

INSTALL = 'pip install galore-torch   (or: pip install "colabkit[optim]")'
UPDATE_GAP = 200   # the paper's default projector update interval
# The paper's alpha = 0.25 goes with a 10x larger learning rate than Adam's (0.01 vs 0.001); colabkit runs
# every optimizer at the same lr, so alpha = 1 keeps GaLore's update the size of Adam's (measured: loss
# within 5% of AdamW's after 2 steps and 2% after 20 on gpt:4x128; with 0.25 it lags by 12% after 2).
SCALE = 1.0


def galore_state_bytes(shape: tuple[int, ...], rank: int) -> int:
    """Bytes of GaLore state for one parameter: projected Adam moments + projector for a matrix whose
    smaller side exceeds ``rank``; plain Adam's 8 B per element otherwise."""
    if len(shape) != 2 or min(shape) <= rank:
        return 8 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
    big, small = max(shape), min(shape)
    return 4 * (2 * rank * big + rank * small)


def _parse(arg: str | None) -> tuple[int, int]:
    if not arg:
        raise PlanError("galore needs a rank, e.g. galore:32 (or galore:32:200 for the projector update interval)")
    parts = arg.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PlanError("use galore:R or galore:R:T with whole numbers R (rank) and T (update interval)")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else UPDATE_GAP


def projected(model: torch.nn.Module, rank: int) -> set[int]:
    """ids of the weights GaLore projects: 2-D weights of ``nn.Linear`` layers (not the output layer tied
    to the embedding) whose smaller side exceeds ``rank``."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {id(m.weight) for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not out_emb and id(m.weight) not in tied
            and m.weight.requires_grad and min(m.weight.shape) > rank}


def compact_projectors(optimizer: Any) -> int:
    """Replace projector matrices that are views of a larger SVD factor by compact copies; bytes freed."""
    freed = 0
    for st in optimizer.state.values():
        pr = st.get("projector")
        ortho = getattr(pr, "ortho_matrix", None)
        if isinstance(ortho, torch.Tensor) and ortho.untyped_storage().nbytes() > ortho.nbytes:
            freed += ortho.untyped_storage().nbytes() - ortho.nbytes
            pr.ortho_matrix = ortho.clone()
    return freed


def make_galore(groups: list[dict], model: torch.nn.Module, rank: int, gap: int = UPDATE_GAP, lr: float = 3e-4) -> Any:
    """``GaLoreAdamW`` over ``groups`` (decay / no-decay), the projected weights in their own groups."""
    if importlib.util.find_spec("galore_torch") is None:
        raise ImportError(f"'galore' needs the galore-torch package: {INSTALL}")
    from galore_torch import GaLoreAdamW as _Package

    class GaLoreAdamW(_Package):
        """The package's optimizer, with projectors compacted after each step (see the module docstring)."""

        def step(self, closure=None):
            loss = super().step(closure)
            compact_projectors(self)
            return loss

    proj = projected(model, rank)
    if not proj:
        warn(f"colabkit: galore:{rank} projects no weight of this model (every linear layer's smaller side is "
                      f"<= {rank}), so it runs as plain AdamW with 8 B/param of state: use a rank below the "
                      "model's width")
    out = []
    for g in groups:
        plain = [p for p in g["params"] if id(p) not in proj]
        low = [p for p in g["params"] if id(p) in proj]
        if plain:
            out.append({**g, "params": plain})
        if low:
            out.append({**g, "params": low, "rank": rank, "update_proj_gap": gap, "scale": SCALE, "proj_type": "std"})
    return GaLoreAdamW(out, lr=lr, no_deprecation_warning=True)


def _make(groups: list[dict], plan: Plan, ctx: Context) -> Any:
    if ctx.model is None:
        raise PlanError("'galore' needs the model to find its linear layers: build it through colabkit.Trainer")
    rank, gap = plan.get("galore")
    return make_galore(groups, ctx.model, rank, gap, lr=ctx.lr)


def _check(plan: Plan, ctx: Context) -> None:
    if importlib.util.find_spec("galore_torch") is None:
        raise PlanError(f"'galore' needs the galore-torch package: {INSTALL}")
    if "lora" in plan or "qlora" in plan:
        raise PlanError("'galore' projects full-rank gradients; lora/qlora already train low-rank adapters: keep one")
    if "fused-step" in plan:
        raise PlanError("'galore' with 'fused-step': the projector's SVD runs inside backward for every matrix, "
                        "with all of them live at once at the update step: drop fused-step")


def _formula(arg: str | None, shape: tuple[int, ...] | None) -> float:
    rank, _ = _parse(arg)
    if shape is None:
        raise ValueError("galore's state depends on each matrix's shape: pass shape")
    n = 1
    for s in shape:
        n *= s
    return galore_state_bytes(tuple(shape), rank) / n


STATE_FORMULAS["galore"] = _formula

register(Technique(
    name="galore",
    help="GaLore (galore-torch): Adam on gradients projected to rank R, projector updated every T steps",
    parse=_parse,
    group="optimizer",
    examples=("galore:32",),
    check=_check,
    make_optimizer=_make,
    order=40,
))

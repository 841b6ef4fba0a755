"""Demonstrations the notebooks run, built on the Trainer (techniques stay below it).

>>> rows = fp16_overflow_demo(steps=1, init_scale=2.0**40, device="cpu")
>>> rows[0]["skipped"]
True
"""
from __future__ import annotations

from typing import Any

import torch

from .data import TextData
from .models import build_model
from .trainer import Trainer


def fp16_overflow_demo(model: str = "gpt-tiny", steps: int = 6, init_scale: float = 2.0**40,
                       batch: int = 4, seq: int = 32, device: str | torch.device | None = None,
                       seed: int = 0) -> list[dict[str, Any]]:
    """Train ``fp16`` with a loss scale far too large, so the scaled fp16 gradients overflow: the
    GradScaler finds inf, skips the optimizer step (weights unchanged) and halves the scale, until
    the scale fits and steps go through. One record per step: scale used, whether it was skipped.

    >>> rows = fp16_overflow_demo(steps=2, init_scale=2.0**40, device="cpu")
    >>> [r["skipped"] for r in rows], rows[1]["scale"] == rows[0]["scale"] / 2
    ([True, True], True)
    """
    torch.manual_seed(seed)
    trainer = Trainer(build_model(model, seq=seq), "fp16", device=device)
    # Same scaler Trainer builds for fp16, but started at an absurd scale to provoke overflow.
    trainer.scaler = torch.amp.GradScaler(trainer.ctx.device.type, init_scale=init_scale)
    data = TextData()
    rows = []
    for step in range(steps):
        x, y = data.batch(batch, seq, step=step, seed=seed)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        scale = trainer.scaler.get_scale()
        loss = trainer.step(x, y)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        rows.append({"step": step, "scale": scale, "next_scale": trainer.scaler.get_scale(),
                     "skipped": unchanged, "loss": loss})
    return rows

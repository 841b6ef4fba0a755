"""Gradient accumulation ``accum:K``: the effective batch of a step is split into K micro-batches
whose gradients add up before one optimizer step, so activations shrink ~K-fold at the same
effective batch (and the same result, up to float rounding) for ~K smaller, slower forwards.

The split and the loss normalisation live in :meth:`colabkit.trainer.Trainer.step`: each micro-batch's
summed token loss is divided by the token count of the *whole* window. Dividing each micro-batch by
its own count (the pre-2024 transformers behaviour) over-weights short, padded micro-batches and
changes the gradient; :func:`window_loss` computes both so the difference can be seen.

>>> from colabkit.plan import Plan
>>> Plan.parse("accum:4").get("accum")
4
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from ..plan import PlanError, Technique, positive_int, register


def micro_batch_sizes(batch: int, k: int) -> list[int]:
    """Sizes of the K micro-batches ``Trainer.step`` uses for a batch (``tensor_split``: the first
    ``batch % k`` get one more). >>> micro_batch_sizes(10, 4)
    [3, 3, 2, 2]"""
    if k > batch:
        raise PlanError(f"accum:{k} needs at least {k} sequences per step, got batch {batch}: "
                        f"use accum:{batch} or less, or a larger batch")
    return [len(c) for c in torch.arange(batch).tensor_split(k)]


def window_loss(logits_chunks, label_chunks, per_micro_mean: bool = False) -> torch.Tensor:
    """Sum of micro-batch losses as accumulation would add them.

    ``per_micro_mean=False`` (correct): each chunk's summed token loss / tokens of the whole window.
    ``per_micro_mean=True`` (the 2024 bug): each chunk's mean loss / K.
    >>> lg = [torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)]
    >>> lb = [torch.tensor([[1, -100]]), torch.tensor([[1, 2]])]
    >>> round(float(window_loss(lg, lb)), 4)
    1.3863
    """
    n_window = sum(int((y != IGNORE_INDEX).sum()) for y in label_chunks)
    total = 0.0
    for lg, y in zip(logits_chunks, label_chunks):
        s = F.cross_entropy(lg.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if per_micro_mean:
            total = total + s / (y != IGNORE_INDEX).sum().clamp(min=1) / len(label_chunks)
        else:
            total = total + s / max(n_window, 1)
    return total


def _check(plan, ctx) -> None:
    if "fused-step" in plan and plan.get("accum") > 1:
        raise PlanError("accum:K and fused-step conflict: fused-step applies each gradient inside backward, so "
                        "gradients cannot accumulate over micro-batches; drop one (fused-step already frees the "
                        "gradients, accum:K shrinks activations)")


register(Technique(
    name="accum",
    help="gradient accumulation over K micro-batches at the same effective batch; loss normalised by the "
         "window's token count; activations ~1/K",
    parse=lambda arg: positive_int(arg),
    check=_check,
    examples=("accum:2", "accum:4", "accum:8"),
    order=60,
))

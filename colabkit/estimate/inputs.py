"""A batch described by shapes: what a trace feeds the Trainer (``inputs=`` for a user's own model)."""
from __future__ import annotations

from typing import Any

import torch

from ..plan import PlanError


def described(key: str, v: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of one batch entry described by a sample tensor or a ``(shape, dtype)`` pair."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    if isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[1], torch.dtype):
        return tuple(v[0]), v[1]
    raise PlanError(f"inputs[{key!r}] = {v!r}: describe each batch entry by a sample tensor or a (shape, dtype) "
                    "pair, e.g. {'input_ids': ((8, 512), torch.long)}")


def fake_batch(inputs: dict[str, Any] | None, batch: int, seq: int) -> Any:
    """The batch a trace feeds (under ``FakeTensorMode``: shapes, no values). ``inputs`` describes your
    batch: each key a sample tensor or a ``(shape, dtype)`` pair (``{"input_ids": ((8, 512), torch.long),
    "labels": ...}``), given to the Trainer as a batch dict; None: ``(x, y)`` token ids of shape (B, S).
    Values never matter here, so any vocabulary size works.

    >>> b = fake_batch({"pixel_values": ((2, 3, 8, 8), torch.float32), "labels": torch.tensor([1, 0])}, 0, 0)
    >>> {k: (tuple(v.shape), v.dtype) for k, v in b.items()}
    {'pixel_values': ((2, 3, 8, 8), torch.float32), 'labels': ((2,), torch.int64)}
    """
    if inputs is None:
        x = torch.zeros(batch, seq, dtype=torch.long)  # (B, S) ids
        return x, x
    return {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in ((k, described(k, v)) for k, v in inputs.items())}


def batch_shape(inputs: dict[str, Any]) -> tuple[int, int]:
    """(batch, seq) of a batch description: the first two dimensions of its first entry (seq 1 if none).

    >>> batch_shape({"input_ids": ((8, 512), torch.long)})
    (8, 512)
    """
    shapes = [described(k, v)[0] for k, v in inputs.items()]
    if not shapes or not shapes[0]:
        raise PlanError("inputs: describe at least one batch entry with a batch dimension, e.g. "
                        "{'input_ids': ((8, 512), torch.long)}")
    return shapes[0][0], shapes[0][1] if len(shapes[0]) > 1 else 1

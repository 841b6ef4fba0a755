"""What a trace is fed: a batch described by shapes (``inputs=``) and a user's built module, copied with
shapes only (its weights are never read nor duplicated)."""
from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Callable

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
    """(batch, seq) of a batch description: the batch is the first entry's first dimension; seq the tokens of one
    example in its token ids (``input_ids``, else the first integer entry with a sequence dimension: a
    multiple-choice example's choices x length), 1 where there are none (images, audio: the step-time prediction's
    tokens are then examples).

    >>> batch_shape({"input_ids": ((8, 512), torch.long)}), batch_shape({"input_ids": ((8, 4, 64), torch.long)})
    ((8, 512), (8, 256))
    >>> batch_shape({"pixel_values": ((8, 3, 224, 224), torch.float32), "labels": ((8,), torch.long)})
    (8, 1)
    """
    shapes = {k: described(k, v) for k, v in inputs.items()}
    first = next(iter(shapes.values()), ((), None))[0]
    if not first:
        raise PlanError("inputs: describe at least one batch entry with a batch dimension, e.g. "
                        "{'input_ids': ((8, 512), torch.long)}")
    ids = shapes.get("input_ids") or next(((s, d) for s, d in shapes.values()
                                           if len(s) > 1 and not d.is_floating_point and d != torch.bool), None)
    return first[0], math.prod(ids[0][1:]) if ids is not None else 1


def module_factory(module: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A builder of copies of a built ``module`` whose parameters and buffers are new empty tensors of the same
    shape, dtype and ``requires_grad`` (made in whatever mode the caller runs: ``FakeTensorMode`` in a trace,
    so nothing is allocated), ties and submodules kept: an estimate measures the copy, not your weights,
    which may even sit on the meta device.

    >>> f = module_factory(torch.nn.Linear(4, 2))
    >>> m = f(); m.weight.shape, m.weight is f.module.weight
    (torch.Size([2, 4]), False)
    """
    def build() -> torch.nn.Module:
        memo: dict[int, Any] = {}
        for t in itertools.chain(module.parameters(), module.buffers()):
            if id(t) in memo:
                continue
            empty = torch.empty(t.shape, dtype=t.dtype)  # device: the caller's (CPU, or fake under a trace)
            memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else empty
        try:
            return copy.deepcopy(module, memo)
        except Exception as err:  # noqa: BLE001  (a module holding something deepcopy cannot copy)
            raise PlanError(f"could not copy {type(module).__name__} to estimate it ({type(err).__name__}: {err}): "
                            "pass a function that builds the model instead of the built module") from None

    build.__name__ = type(module).__name__
    build.module = module
    return build

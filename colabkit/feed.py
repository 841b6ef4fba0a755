"""The batch of each optimizer step of ``train(data=...)``, a function of (seed, step) only.

``data`` is what people have: colabkit's own corpora (:class:`~colabkit.data.TextData`,
:class:`~colabkit.instruct.InstructData`: anything with ``batch(batch, seq, step=, seed=, device=)``), a list
or map-style ``Dataset`` (a Hugging Face ``datasets.Dataset`` too) of batch dicts (``input_ids`` (B, S),
``labels``, ...: one per step) or of examples
(``batch`` of them collated per step, 1-D sequences right-padded: ids 0, ``attention_mask`` 0, ``labels`` -100),
or a ``DataLoader`` (its dataset, ``batch_size``, ``collate_fn`` and ``drop_last``; shuffled when it shuffles).
Each epoch's order is a permutation drawn from (seed, epoch), so step ``s`` always gets the same batch: a run
killed mid-way and resumed sees exactly the batches it would have seen, without replaying the ones before.

>>> f = feed([{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])}] * 5, batch=2, seq=3, seed=0)
>>> f.batch(0)["input_ids"].shape, f.steps_per_epoch, f.identity, f.size
(torch.Size([2, 3]), 3, {'data': 'list of 5 examples'}, 2)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .data import IGNORE_INDEX, TextData

_PAD = {"labels": IGNORE_INDEX, "attention_mask": 0}  # the pad value of each key (others: 0)


def _first_tensor(item: Any) -> torch.Tensor | None:
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, (tuple, list)) else [item]
    return next((torch.as_tensor(v) for v in values if isinstance(v, (torch.Tensor, list, tuple)) and len(v)), None)


def is_batch(item: Any, example_dims: int = 1) -> bool:
    """A batch dict (or ``(x, y)``) already holds a batch dimension: its ids have ``example_dims`` + 1 dims
    (an example's ids have 1; a multiple-choice example's 2: choices x seq), images 4."""
    if isinstance(item, Mapping) and "pixel_values" in item:
        return torch.as_tensor(item["pixel_values"]).ndim >= 4
    t = torch.as_tensor(item["input_ids"]) if isinstance(item, Mapping) and "input_ids" in item else _first_tensor(item)
    return t is not None and t.ndim >= example_dims + 1


def _stack(key: str, values: list[Any]) -> torch.Tensor:
    try:
        ts = [torch.as_tensor(v) for v in values]
    except (TypeError, ValueError, RuntimeError) as e:  # text, None, ragged nesting: not numbers to stack
        raise ValueError(f"data: the examples' {key!r} are not numbers ({type(values[0]).__name__}: {e}); tokenize "
                         f"text first and drop columns the model does not take (a Hugging Face Dataset: "
                         f"dataset.remove_columns([{key!r}])), or give a DataLoader with your collate_fn") from None
    if all(t.shape == ts[0].shape for t in ts):
        return torch.stack(ts)
    if any(t.ndim != 1 for t in ts):
        raise ValueError(f"data: the examples' {key!r} differ in shape ({sorted({tuple(t.shape) for t in ts})}) and "
                         "are not 1-D sequences to pad: give examples of one shape, or a DataLoader with your collate_fn")
    out = torch.full((len(ts), max(len(t) for t in ts)), _PAD.get(key, 0), dtype=ts[0].dtype)
    for i, t in enumerate(ts):
        out[i, :len(t)] = t
    return out


def collate(examples: list[Any]) -> Any:
    """Examples (dicts, or tuples such as ``(x, y)``) as one batch: each field stacked, 1-D sequences of
    different lengths right-padded (with an ``attention_mask`` added for a dict that has none).

    >>> collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])["attention_mask"].tolist()
    [[1, 1, 1], [1, 0, 0]]
    """
    first = examples[0]
    if isinstance(first, Mapping):
        out = {k: _stack(k, [e[k] for e in examples]) for k in first}
        ids = [len(torch.as_tensor(e["input_ids"])) for e in examples] if "input_ids" in first else []
        if "attention_mask" not in out and ids and len(set(ids)) > 1:
            out["attention_mask"] = (torch.arange(max(ids))[None, :] < torch.tensor(ids)[:, None]).long()
        return out
    return tuple(_stack(f"field {i}", [e[i] for e in examples]) for i in range(len(first)))


class Feed:
    """Step -> batch for one run: ``items`` indexed through a (seed, epoch) permutation (or in order)."""

    def __init__(self, items: Any, per_step: int, seed: int, shuffle: bool = True, collate_fn: Any = None,
                 drop_last: bool = False, kind: str = "list"):
        self.items, self.per_step, self.seed, self.shuffle = items, per_step, seed, shuffle
        self.collate_fn, self.n = collate_fn, len(items)
        if self.n == 0:
            raise ValueError("data is empty: give at least one batch or example")
        full, rest = divmod(self.n, per_step)
        self.steps_per_epoch = full if drop_last or not rest else full + 1
        if self.steps_per_epoch == 0:
            raise ValueError(f"data holds {self.n} examples, fewer than one batch of {per_step} with drop_last=True: "
                             "use a smaller batch, or drop_last=False")
        what = "batches" if collate_fn is None else "examples"
        self.identity = {"data": f"{kind} of {self.n} {what}"}  # a resume must use the same data
        # examples per step (a batch dict's own size: the first one's)
        self.size = per_step if collate_fn is not None else int(_first_tensor(items[0]).shape[0])

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * epoch + 1)
        return torch.randperm(self.n, generator=g).tolist()

    def batch(self, step: int) -> Any:
        """The batch of optimizer step ``step`` (0-based): a function of (seed, step) only."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        idx = self._order(epoch)[pos * self.per_step:(pos + 1) * self.per_step]
        if self.collate_fn is None:  # one batch dict per step (nested lists of numbers, e.g. a Dataset's rows: tensors)
            b = self.items[idx[0]]
            if isinstance(b, Mapping):
                return {k: torch.as_tensor(v) if isinstance(v, (list, tuple)) else v for k, v in b.items()}
            return tuple(b) if isinstance(b, list) else b
        return self.collate_fn([self.items[i] for i in idx])

    def eval_batch(self, step: int) -> Any:
        raise ValueError("eval_every evaluates on colabkit's held-out text windows; with your own data= evaluate "
                         "your held-out set in a callback (on_step_end: event['trainer'].evaluate(batch))")


class TextFeed:
    """colabkit's corpora (``TextData``, ``InstructData``): random windows drawn from (seed, step)."""

    def __init__(self, data: Any, batch: int, seq: int, seed: int, device: torch.device | str):
        self.data, self.size, self.seq, self.seed, self.device = data, batch, seq, seed, device
        self.identity: dict[str, Any] = {}  # the run's batch, seq and seed say it all

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(self.size, self.seq, step=step, seed=self.seed, device=self.device)

    def eval_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(self.size, self.seq, step=10**9 + step, seed=self.seed, device=self.device)


def feed(data: Any, batch: int, seq: int, seed: int, device: torch.device | str = "cpu",
         eval_every: int = 0, example_dims: int = 1) -> TextFeed | Feed:
    """The step -> batch function of ``train(data=...)`` (see the module's docstring); ``example_dims``: the
    dimensions of one example's ids (2 for a multiple-choice model: choices x seq), which tell a list of
    examples from a list of batches."""
    f = _feed(data, batch, seq, seed, device, example_dims)
    if eval_every and isinstance(f, Feed):
        f.eval_batch(0)  # refused before anything is built
    return f


def _feed(data: Any, batch: int, seq: int, seed: int, device: torch.device | str,
          example_dims: int = 1) -> TextFeed | Feed:
    if data is None or _is_corpus(data):
        return TextFeed(data if data is not None else TextData(), batch, seq, seed, device)
    if isinstance(data, torch.utils.data.DataLoader):
        return _loader_feed(data, seed)
    if isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__getitem__") \
            or not hasattr(data, "__len__") or isinstance(data, (str, bytes, Mapping)):
        raise ValueError(f"data: a {type(data).__name__} cannot be indexed by step; give a list or map-style Dataset "
                         "(of batch dicts or examples), a DataLoader over one, or colabkit's TextData")
    kind = "list" if isinstance(data, Sequence) else type(data).__name__
    if len(data) and is_batch(data[0], example_dims):
        return Feed(data, 1, seed, kind=kind)
    return Feed(data, batch, seed, collate_fn=collate, kind=kind)


def _is_corpus(data: Any) -> bool:
    """colabkit's corpus protocol: ``batch(batch, seq, step=, seed=, device=)`` (a Hugging Face ``Dataset``
    has a ``batch(batch_size)`` of its own: it is a dataset of examples)."""
    import inspect

    fn = getattr(data, "batch", None)
    try:
        return callable(fn) and {"seq", "step"} <= set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False


def _loader_feed(loader: torch.utils.data.DataLoader, seed: int) -> Feed:
    """A DataLoader read by index: its dataset, batch size, collate_fn, drop_last and whether it shuffles;
    the order drawn from (seed, epoch) rather than from its own generator, so a resumed run skips ahead."""
    from torch.utils.data import RandomSampler, SequentialSampler

    plain = not isinstance(loader.dataset, torch.utils.data.IterableDataset) and \
        isinstance(loader.sampler, (RandomSampler, SequentialSampler))
    if plain and loader.batch_size is None and loader.batch_sampler is None:  # batch_size=None: items are batches
        return Feed(loader.dataset, 1, seed, shuffle=isinstance(loader.sampler, RandomSampler), kind="DataLoader")
    if not plain or loader.batch_size is None:
        raise ValueError("data: this DataLoader cannot be read by step (an IterableDataset, a custom sampler or "
                         "batch_sampler): give DataLoader(dataset, batch_size=B, shuffle=..., collate_fn=...) over a "
                         "map-style dataset, or the dataset itself")
    return Feed(loader.dataset, loader.batch_size, seed, shuffle=isinstance(loader.sampler, RandomSampler),
                collate_fn=loader.collate_fn, drop_last=loader.drop_last, kind="DataLoader")

"""Batches as people have them, and their loss normalised by the whole effective batch.

A batch is either colabkit's ``(x, y)`` (token ids and the target of each position: already shifted) or
a dict in Hugging Face's convention: ``input_ids``/``attention_mask`` (or ``pixel_values``) and
``labels`` *unshifted* with -100 ignored; any other key goes to the model as a keyword. Outputs may be
a tensor, a tuple (nanoGPT's ``(logits, loss)``) or a ``ModelOutput``.

The loss of one micro-batch is its *summed* loss over the token (or example) count of the whole window
of ``accum:K`` micro-batches, whatever the head, so accumulation equals the un-accumulated step:

- ``causal-lm``: position i predicts label i+1 (labels shifted as transformers does), tokens counted
  over ``labels[..., 1:]``;
- ``token-classification``: one label per position (also masked LM), no shift;
- ``sequence-classification``: one label per example (text or images); float labels are regression
  (MSE) or multi-label (BCE), counted per element, as in transformers.

A model that computes its own loss (``labels`` given) returns the mean over its micro-batch; it is
re-weighted by that micro-batch's count over the window's (what ``num_items_in_batch`` does in
transformers' Trainer). Anything else takes ``loss_fn(outputs, labels, num_items_in_batch)``, transformers'
``compute_loss_func`` convention. What cannot become a loss is a :class:`PlanError` saying what to pass.

>>> logits = torch.zeros(1, 4, 8)                     # (B, S, V)
>>> labels = torch.tensor([[5, 1, 2, -100]])           # unshifted: 2 tokens are predicted
>>> int(count(labels, "causal-lm")), round(float(summed_loss(logits, labels, "causal-lm")), 4)
(2, 4.1589)
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .models import logits_of
from .plan import PlanError

HEADS = ("causal-lm", "token-classification", "sequence-classification")
# transformers' class-name suffixes (stable across versions; peft wrappers are unwrapped first)
_SUFFIXES = {
    "causal-lm": ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"),
    "token-classification": ("ForTokenClassification", "ForMaskedLM"),
    "sequence-classification": ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
                                "ForMultipleChoice"),
    # transformers' CTC models compute their loss themselves (labels: (B, target length), -100 padded);
    # "ctc" averages over examples (ctc_loss_reduction="mean"), "ctc-sum" adds them (the default, "sum")
    "ctc": ("ForCTC",),
}
_NAMED_HEADS = tuple(suffix for suffixes in _SUFFIXES.values() for suffix in suffixes)  # a class that names its head
LossFn = Callable[[Any, "torch.Tensor | None", torch.Tensor], torch.Tensor]


@dataclass
class Batch:
    """One forward's inputs: ``args`` (positional), ``kwargs`` (everything but the labels), ``labels``,
    and ``aligned`` (colabkit's ``(x, y)``: the target of each position is given, nothing to shift)."""

    args: tuple
    kwargs: dict
    labels: torch.Tensor | None
    aligned: bool = False

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"arg{i}", a) for i, a in enumerate(self.args)] + list(self.kwargs.items())
        named.append(("labels", self.labels))
        return [(k, v) for k, v in named if isinstance(v, torch.Tensor)]

    @property
    def size(self) -> int:
        """Examples in the batch: dim 0 of its first tensor that has one."""
        return next((t.shape[0] for _, t in self.tensors() if t.ndim), 1)

    def to(self, device: torch.device) -> "Batch":
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()},
                     move(self.labels), self.aligned)

    def split(self, k: int) -> list["Batch"]:
        """K micro-batches along dim 0 of every tensor (``tensor_split``: the first ``B % k`` get one more).
        A tensor without the batch along dim 0 cannot be split: refused with its name."""
        if k == 1:
            return [self]
        b = self.size
        if k > b:
            raise PlanError(f"accum:{k} needs at least {k} sequences (examples) per step, got batch {b}: "
                            f"use accum:{b} or less, or a larger batch")
        for name, t in self.tensors():
            if t.ndim == 0 or t.shape[0] != b:
                raise PlanError(f"accum:{k} splits every tensor of the batch along dim 0, but {name!r} has shape "
                                f"{tuple(t.shape)} and the batch has {b} examples: give it a leading batch dimension, "
                                "or use accum:1")
        part = lambda v: v.tensor_split(k) if isinstance(v, torch.Tensor) else [v] * k  # noqa: E731
        args = [part(a) for a in self.args]
        kwargs = {key: part(v) for key, v in self.kwargs.items()}
        labels = part(self.labels)
        return [Batch(tuple(a[i] for a in args), {key: v[i] for key, v in kwargs.items()}, labels[i], self.aligned)
                for i in range(k)]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a peft ``PeftModel`` wrapper (colabkit's own LoRA keeps the model's class)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def forward_params(model: torch.nn.Module) -> tuple[list[str], bool]:
    """Names of ``model.forward``'s parameters and whether it takes ``**kwargs``."""
    params = inspect.signature(model.forward).parameters.values()
    return ([p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
            any(p.kind == p.VAR_KEYWORD for p in params))


def make_batch(model: torch.nn.Module, batch: Any, y: torch.Tensor | None = None, labels_to_model: bool = True) -> Batch:
    """A :class:`Batch` from ``(x, y)``, ``((x, y))`` or a dict; ``labels_to_model`` passes ``labels`` to a
    model whose forward takes them (so it computes its own loss). Keys the forward does not take are
    refused, except the main input (``input_ids``/``pixel_values``), given positionally to a forward that
    names it otherwise (``forward(idx)``).

    >>> from colabkit.models import build_model
    >>> b = make_batch(build_model("gpt-tiny"), {"input_ids": torch.zeros(2, 8, dtype=torch.long),
    ...                                          "labels": torch.zeros(2, 8, dtype=torch.long)})
    >>> len(b.args), sorted(b.kwargs), b.labels.shape
    (1, [], torch.Size([2, 8]))
    """
    if isinstance(batch, (tuple, list)) and y is None and len(batch) == 2:
        batch, y = batch
    if isinstance(batch, torch.Tensor):
        if y is None:
            raise PlanError("step(x) needs the targets: step(x, y) with y the target of each position, or a batch "
                            "dict {'input_ids': ..., 'labels': ...} in transformers' convention (labels unshifted)")
        return Batch((batch,), add_decoder_inputs(model, {}, y), y, aligned=True)  # (T5, BART: y feeds the decoder)
    if not isinstance(batch, Mapping):
        raise PlanError(f"a batch is (x, y) or a dict such as {{'input_ids', 'attention_mask', 'labels'}}, "
                        f"got {type(batch).__name__}")
    if y is not None:
        raise PlanError("a batch dict carries its targets under 'labels': pass step(batch), not step(batch, y)")
    kwargs = dict(batch)
    labels = kwargs.pop("labels", None)
    names, var_kw = forward_params(model)
    args: tuple = ()
    if not var_kw:
        unknown = [k for k in kwargs if k not in names]
        main = [k for k in unknown if k in ("input_ids", "pixel_values")]
        free = [n for n in names if n not in kwargs]
        if len(main) == 1 and free:  # forward(idx) / forward(x): the main input goes first, positionally
            args = (kwargs.pop(main[0]),)
            unknown.remove(main[0])
        if unknown:
            raise PlanError(f"{type(model).__name__}.forward takes ({', '.join(names)}); the batch also has "
                            f"{unknown}: drop or rename those keys")
    if labels is not None and labels_to_model and (var_kw or "labels" in names):
        kwargs["labels"] = labels
    elif labels is not None:
        add_decoder_inputs(model, kwargs, labels)
    return Batch(args, kwargs, labels)


def add_decoder_inputs(model: torch.nn.Module, kwargs: dict, labels: torch.Tensor) -> dict:
    """An encoder-decoder model (T5, BART) builds its decoder's inputs from the ``labels`` it is given; where
    colabkit keeps the labels from it (``chunked-ce``, ``loss_fn=``) they are built here as the model builds
    them (``prepare_decoder_input_ids_from_labels``: shifted right, -100 as padding) into ``kwargs``, in place.
    Other models, or a batch that has its decoder inputs: unchanged.

    >>> add_decoder_inputs(torch.nn.Linear(2, 2), {}, torch.zeros(1, 3, dtype=torch.long))
    {}
    """
    m = unwrap(model)
    if not getattr(getattr(m, "config", None), "is_encoder_decoder", False) \
            or kwargs.get("decoder_input_ids") is not None or kwargs.get("decoder_inputs_embeds") is not None:
        return kwargs
    make = getattr(m, "prepare_decoder_input_ids_from_labels", None)
    if not callable(make):
        raise PlanError(f"{type(m).__name__} is an encoder-decoder model that builds its decoder inputs from the labels, "
                        "which colabkit keeps from it here (chunked-ce or loss_fn= compute the loss): put "
                        "'decoder_input_ids' in the batch, or drop chunked-ce / loss_fn=")
    kwargs["decoder_input_ids"] = make(labels=labels)
    return kwargs


def head_of(model: torch.nn.Module, b: Batch, task: str | None = None) -> str:
    """The head whose loss convention applies: ``task`` if given, else transformers' model class, else
    the labels' shape ((B, S): causal LM, transformers' convention for your own LM; (B,): classification).
    ``(x, y)`` batches are never shifted: y already holds each position's target."""
    if task is not None:
        if task not in HEADS:
            raise PlanError(f"task={task!r}: use one of {', '.join(HEADS)}, or loss_fn= for anything else")
        return task
    name = type(unwrap(model)).__name__
    for head, suffixes in _SUFFIXES.items():
        if name.endswith(suffixes):
            if head == "causal-lm" and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
                return "token-classification"  # seq2seq: labels align with the decoder's positions
            if head == "ctc":
                return "ctc-sum" if getattr(getattr(unwrap(model), "config", None), "ctc_loss_reduction", "sum") == "sum" else "ctc"
            return "token-classification" if b.aligned and head == "causal-lm" else head
    labels = b.labels
    if labels is not None and labels.ndim >= 2 and not labels.is_floating_point():
        return "token-classification" if b.aligned else "causal-lm"
    return "sequence-classification"


def n_classes(model: torch.nn.Module, head: str) -> int | None:
    """How many classes a head's integer labels index: the LM head's rows (the vocabulary, padding
    included) for language models, ``config.num_labels`` for classification heads; None if unknown.

    >>> from colabkit.models import build_model
    >>> n_classes(build_model("gpt-tiny"), "causal-lm")
    256
    """
    m = unwrap(model)
    cfg = getattr(m, "config", None)
    if head == "sequence-classification" or type(m).__name__.endswith("ForTokenClassification"):
        n = getattr(cfg, "num_labels", None)
        return n if isinstance(n, int) else getattr(m, "_colabkit_classes", None)
    emb = m.get_output_embeddings() if callable(getattr(m, "get_output_embeddings", None)) else None
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2 and w.is_floating_point():  # not a packed 4-bit weight
        return w.shape[0]
    n = getattr(cfg, "vocab_size", None)
    return n if isinstance(n, int) else getattr(m, "_colabkit_classes", None)  # (learned: learn_classes)


def learn_classes(model: torch.nn.Module, out: Any, b: Batch, head: str) -> None:
    """After a forward of a model whose number of classes nothing names (a plain module's classifier: no config,
    no LM head), learn it from the logits (their last dimension) and check this batch's labels against it (one
    device sync, once); later batches are checked before their forward (:func:`check_labels`), as an LM's are.

    >>> m, b = torch.nn.Linear(4, 3), Batch((torch.zeros(2, 4),), {}, torch.tensor([0, 3]))
    >>> learn_classes(m, torch.zeros(2, 3), b, "sequence-classification")
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: labels hold 1 ids outside [0, 3) (min 3, max 3; -100 is the only negative allowed); this classification head needs labels of shape (2,) and dtype torch.long (class ids in [0, 3)), or float labels: (2,) for regression (one output), (2, 3) for multi-label: check the number of classes (config.num_labels) against your label set
    """
    if n_classes(model, head) is not None or not isinstance(b.labels, torch.Tensor) or b.labels.is_floating_point():
        return
    logits = logits_of(out)
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        return
    unwrap(model)._colabkit_classes = int(logits.shape[-1])
    check_labels(model, b, head)


def _main_input(b: Batch) -> torch.Tensor | None:
    if b.args and isinstance(b.args[0], torch.Tensor):
        return b.args[0]
    return next((b.kwargs[k] for k in ("input_ids", "inputs_embeds", "pixel_values")
                 if isinstance(b.kwargs.get(k), torch.Tensor)), None)


def check_ids(model: torch.nn.Module, b: Batch) -> None:
    """Refuse token ids the model's input embedding has no row for, before the forward (torch says "index out of
    range in self" on the CPU, a device-side assert on a GPU). The embedding is the one the model names as its
    token table (``get_input_embeddings()``: transformers' models and colabkit's GPT); a plain module's
    embeddings are not guessed at (its first may be a position or feature table). Integer ``input_ids`` (or
    the first argument) only.

    >>> from colabkit.models import build_model
    >>> check_ids(build_model("gpt-tiny"), Batch((torch.tensor([[1, 256]]),), {}, None))
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: input_ids hold 1 ids outside [0, 256) (min 256, max 256): the model's input embedding has 256 rows. Check that the tokenizer matches the model (len(tokenizer) against config.vocab_size); after adding tokens, call model.resize_token_embeddings(len(tokenizer))
    """
    x = b.args[0] if b.args and isinstance(b.args[0], torch.Tensor) else b.kwargs.get("input_ids")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool \
            or x.is_meta or torch._guards.detect_fake_mode((x,)) is not None:  # values unknown when estimating
        return
    m = unwrap(model)
    emb = token_table(m)
    if emb is None:  # a plain module: each of its tables checks its own lookups (lookups_checked)
        return
    rows = position_rows(m)
    if rows is not None and x.shape[-1] > rows:
        raise PlanError(f"input_ids have length {x.shape[-1]}, and {type(m).__name__} has a learned position table of "
                        f"{rows} rows: truncate your sequences to {rows} (tokenizer(..., truncation=True, "
                        f"max_length={rows})), or use a model with a longer context")
    n = emb.num_embeddings
    bad = (x >= n) | (x < 0)
    if bool(bad.any()):  # on the host, before the ids reach the device's kernels
        v = x[bad]
        raise PlanError(f"input_ids hold {int(bad.sum())} ids outside [0, {n}) (min {int(v.min())}, max {int(v.max())}): "
                        f"the model's input embedding has {n} rows. Check that the tokenizer matches the model "
                        "(len(tokenizer) against config.vocab_size); after adding tokens, call "
                        "model.resize_token_embeddings(len(tokenizer))")


def token_table(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The embedding a model names as its token table (``get_input_embeddings()``: transformers' models and
    colabkit's GPT), or None (a plain module, or a model that has none)."""
    try:
        emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    except NotImplementedError:  # transformers' default for a model that has none
        emb = None
    return emb if isinstance(emb, torch.nn.Embedding) else None


_CORPUS = ("if these are colabkit's own text (the default data of train() and the CLI: UTF-8 bytes, ids 0-255), give the "
           "table at least 256 rows, or train on your own batches: train(model, data=...), or train --data FILE.py:FN")


def _check_lookup(name: str, module: torch.nn.Embedding, args: tuple) -> None:
    idx = args[0] if args else None
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_meta \
            or torch._guards.detect_fake_mode((idx,)) is not None:  # values unknown when estimating
        return
    n = module.num_embeddings
    bad = (idx >= n) | (idx < 0)
    if bool(bad.any()):  # before the lookup's kernel: on a GPU a device-side assert would end the session
        v, k = idx[bad], int(bad.sum())
        raise PlanError(f"the model's embedding {name!r} ({n} rows) was given {k} {'index' if k == 1 else 'indices'} "
                        f"outside [0, {n}) (min {int(v.min())}, max {int(v.max())}): the ids your batches hold must "
                        f"index its rows; {_CORPUS}")


def lookup_tables(model: torch.nn.Module) -> dict[int, str]:
    """A plain module's ``nn.Embedding`` tables by id, with their names (empty for a model that names its token
    table: :func:`check_ids` checks it once per batch) -- what :func:`lookups_checked` guards."""
    m = unwrap(model)
    if token_table(m) is not None:
        return {}
    return {id(mod): name for name, mod in m.named_modules() if isinstance(mod, torch.nn.Embedding)}


@contextlib.contextmanager
def lookups_checked(tables: dict[int, str]):
    """While a step runs: each of a plain module's embedding ``tables`` (:func:`lookup_tables`) refuses an index it
    has no row for, before its lookup (torch says "index out of range in self" on the CPU, a device-side assert on a
    GPU), with the table's name -- :func:`check_ids` cannot tell which of a plain module's embeddings takes the ids.
    One host read per lookup. A hook for the step only: nothing stays on the user's model (it pickles as it was).

    >>> m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> with lookups_checked(lookup_tables(m)):
    ...     m(torch.tensor([[1, 12]]))
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: the model's embedding '0' (10 rows) was given 1 index outside [0, 10) (min 12, max 12): the ids your batches hold must index its rows; if these are colabkit's own text (the default data of train() and the CLI: UTF-8 bytes, ids 0-255), give the table at least 256 rows, or train on your own batches: train(model, data=...), or train --data FILE.py:FN
    """
    if not tables:
        yield
        return

    def hook(module: torch.nn.Module, args: tuple) -> None:
        name = tables.get(id(module))
        if name is not None:
            _check_lookup(name, module, args)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")  # GPT-2 / colabkit's GPT, BERT, BART's


def position_rows(model: torch.nn.Module) -> int | None:
    """Positions a model's learned position table has (GPT-2's ``wpe``, BERT's ``position_embeddings``): a longer
    sequence indexes past it (a device-side assert on a GPU); None without one (rotary or relative positions: Llama,
    T5). Looked up once per model.

    >>> from colabkit.models import build_model
    >>> position_rows(build_model("gpt-tiny")), position_rows(build_model("llama:2x64"))
    (256, None)
    """
    m = unwrap(model)
    if "_colabkit_positions" not in m.__dict__:
        tables = [t for name, t in m.named_modules() if isinstance(t, torch.nn.Embedding) and name.endswith(_POSITION_TABLES)]
        offset = getattr(tables[0], "offset", 0) if tables else 0  # BART's learned table starts 2 rows in
        m.__dict__["_colabkit_positions"] = tables[0].num_embeddings - offset if tables else None
    return m.__dict__["_colabkit_positions"]


def multiple_choice(model: torch.nn.Module) -> bool:
    """A transformers ``...ForMultipleChoice`` model: an example's ids are (choices, seq), its label a choice's index."""
    return type(unwrap(model)).__name__.endswith("ForMultipleChoice")


def check_labels(model: torch.nn.Module, b: Batch, head: str) -> None:
    """Refuse labels that cannot be ``head``'s targets before the forward, naming the expected shape and
    dtype (torch's own errors come later and say less: "Expected input batch_size (32) to match target
    batch_size (24)", "Target 300 is out of bounds", on a GPU a device-side assert).

    >>> from colabkit.models import build_model
    >>> x = torch.zeros(2, 8, dtype=torch.long)
    >>> check_labels(build_model("gpt-tiny"), Batch((x,), {}, x[:, :4]), "causal-lm")
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: labels have shape (2, 4) and dtype torch.int64; this causal-lm head needs labels of shape (2, 8) (one per input position) and dtype torch.long: class ids in [0, 256), -100 to ignore
    """
    y = b.labels
    if not isinstance(y, torch.Tensor):
        return
    m = unwrap(model)
    seq2seq = bool(getattr(getattr(m, "config", None), "is_encoder_decoder", False))
    x = _main_input(b)
    tokens = x is not None and x.ndim == 2 and not x.is_floating_point()  # input_ids (B, S)
    got = f"labels have shape {tuple(y.shape)} and dtype {y.dtype}"
    lm_like = head == "sequence-classification" and y.is_floating_point() and tokens and y.shape == x.shape \
        and not type(m).__name__.endswith(_SUFFIXES["sequence-classification"])
    if lm_like:  # float labels shaped like input_ids on a model that is not a classifier: token ids as floats
        head = "causal-lm"
    n = n_classes(model, head)
    choices = multiple_choice(m)
    if choices:  # labels index the choices, dim 1 of the inputs (B, choices, S); config.num_labels is not used
        n = int(x.shape[1]) if x is not None and x.ndim >= 2 else None
    ids = f"class ids in [0, {n})" if n else "class ids"
    if head in ("causal-lm", "token-classification"):
        if seq2seq:
            shape, where, ok = f"({b.size}, target length)", "(the decoder's targets)", y.ndim == 2 and y.shape[0] == b.size
        elif x is not None and x.ndim in (2, 3) and (tokens or x.is_floating_point()):  # input_ids / inputs_embeds
            shape, where, ok = str(tuple(x.shape[:2])), "(one per input position)", tuple(y.shape) == tuple(x.shape[:2])
        else:
            # other inputs (pixel_values: segmentation maps, ...): only the batch dimension is known
            shape, where, ok = f"({b.size}, ...)", "(one per position)", y.ndim >= 1 and y.shape[0] == b.size
        what = "step(x, y)'s y (each input position's target)" if b.aligned and not seq2seq else f"this {head} head"
        want = f"{what} needs labels of shape {shape} {where} and dtype torch.long: {ids}, -100 to ignore"
        if y.dtype != torch.long or not ok:
            raise PlanError(f"{got}; {want}")
        if seq2seq and not {"decoder_input_ids", "decoder_inputs_embeds"} & set(b.kwargs) \
                and getattr(m.config, "decoder_start_token_id", None) is None:  # transformers' raw AttributeError
            raise PlanError(f"{type(m).__name__} makes its decoder's inputs by shifting the labels right after "
                            "config.decoder_start_token_id, which this config does not set (a config built by hand; "
                            "transformers 5 keeps it in generation_config): set model.config.decoder_start_token_id "
                            "(T5's is its pad id, 0), or pass decoder_input_ids")
    elif choices:
        want = (f"this multiple-choice head needs labels of shape ({b.size},) and dtype torch.long: the right choice's "
                f"index, in [0, {n or 'choices'}) (dim 1 of inputs shaped (batch, choices, seq))")
        if y.dtype != torch.long or tuple(y.shape) != (b.size,):
            raise PlanError(f"{got}; {want}")
    elif head == "sequence-classification":
        want = (f"this classification head needs labels of shape ({b.size},) and dtype torch.long ({ids}), "
                f"or float labels: ({b.size},) for regression (one output), ({b.size}, {n or 'classes'}) for multi-label")
        ok_int = y.dtype == torch.long and (y.ndim == 1 or tuple(y.shape) == (b.size, 1))  # transformers: labels.view(-1)
        # float labels: regression with one output, else multi-label with one per class (transformers' problem_type)
        ok_float = y.is_floating_point() and (n in (None, 1) or tuple(y.shape) == (b.size, n))
        if y.ndim == 0 or y.shape[0] != b.size or not (ok_int or ok_float):
            raise PlanError(f"{got}; {want}")
        if y.is_floating_point() or n == 1:  # regression / multi-label: no class ids to range-check
            return
    else:
        return
    classes = head == "sequence-classification" or type(m).__name__.endswith("ForTokenClassification")  # num_labels
    if n and not y.is_meta and torch._guards.detect_fake_mode((y,)) is None:  # values unknown when estimating
        shifted = head == "causal-lm" and not seq2seq
        y = y[..., 1:] if shifted else y  # the shift drops the first label: never a target
        bad = (y >= n) | ((y < 0) & (y != IGNORE_INDEX))
        if bool(bad.any()):  # one check per batch, on the host before the labels reach the device's kernels
            v, targets = y[bad], "; counted over the targets: the shift drops each row's first label" if shifted else ""
            raise PlanError(f"labels hold {int(bad.sum())} ids outside [0, {n}) (min {int(v.min())}, max {int(v.max())}; "
                            f"-100 is the only negative allowed{targets}); {want}" + ("" if choices else
                            ": check the number of classes (config.num_labels) against your label set" if classes else
                            ": check that the tokenizer matches the model (its vocabulary)"))


def check_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A transformers-style call ``model(*args, **kwargs)`` checked before its forward, where a loop other than
    colabkit's calls the model (transformers' Trainer, TRL's: :class:`colabkit.hf.MemoryCallback`): its token
    ids (:func:`check_ids`) and, on a model whose class names its head (``...ForCausalLM``,
    ``...ForSequenceClassification``, ...: transformers' loss conventions), its ``labels`` (:func:`check_labels`).
    A user's own module computing its own loss has its labels left alone: their convention is its own.

    >>> from colabkit.models import build_model
    >>> check_call(build_model("gpt-tiny"), (), {"input_ids": torch.tensor([[300]])})
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: input_ids hold 1 ids outside [0, 256) (min 300, max 300): the model's input embedding has 256 rows. Check that the tokenizer matches the model (len(tokenizer) against config.vocab_size); after adding tokens, call model.resize_token_embeddings(len(tokenizer))
    """
    b = Batch(tuple(args), {k: v for k, v in kwargs.items() if k != "labels"}, kwargs.get("labels"))
    check_ids(model, b)
    if isinstance(b.labels, torch.Tensor) and type(unwrap(model)).__name__.endswith(_NAMED_HEADS):
        check_labels(model, b, head_of(model, b))


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Label i+1 at position i, -100 at the end (transformers' ForCausalLMLoss: the logits are not copied)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count(labels: torch.Tensor | None, head: str, examples: int = 1) -> torch.Tensor | int:
    """Items a head's loss averages over: non-ignored (shifted for causal LM) integer labels, every
    element of float labels; ``examples`` when there are no labels (``loss_fn``)."""
    if labels is None:
        return examples
    if head.startswith("ctc"):  # the model's own loss: a mean over examples ("ctc"), or their sum ("ctc-sum")
        return labels.shape[0]
    if labels.is_floating_point():
        return labels.numel()
    if head == "causal-lm":
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, head: str, problem_type: str | None = None) -> torch.Tensor:
    """The head's loss summed over its items (fp32): cross-entropy for class ids; for float labels MSE
    (``regression``, or one output) or BCE-with-logits (``multi_label_classification``)."""
    if labels.is_floating_point():
        if hasattr(logits, "cross_entropy_sum"):
            raise PlanError("chunked-ce computes a cross-entropy over class ids, and these labels are floats (regression or "
                            "multi-label): drop chunked-ce")
        if problem_type == "regression" or (problem_type is None and logits.shape[-1] == 1):
            return F.mse_loss(logits.float().reshape(labels.shape), labels.float(), reduction="sum") \
                if logits.numel() == labels.numel() else _mismatch(logits, labels)
        if logits.shape != labels.shape:
            _mismatch(logits, labels)
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")
    if head.startswith("ctc"):
        raise PlanError("a CTC model computes its loss itself from labels (transformers' ...ForCTC): give the batch's "
                        "targets as 'labels', or pass loss_fn=f(outputs, labels, num_items_in_batch)")
    if head == "causal-lm":
        labels = _shifted(labels)
    if head == "sequence-classification" and labels.ndim == 2 and labels.shape[1] == 1 and logits.ndim == 2:
        labels = labels[:, 0]  # one class id per example, kept in a column (transformers takes labels.view(-1))
    if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
        _mismatch(logits, labels)
    if hasattr(logits, "cross_entropy_sum"):  # logits that exist chunk by chunk inside their loss (chunked-ce)
        return logits.cross_entropy_sum(labels)
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _mismatch(logits: torch.Tensor, labels: torch.Tensor):
    raise PlanError(f"cannot make a loss from the model's output {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                    f"of dtype {labels.dtype}: for a language model give labels shaped like input_ids (B, S), dtype "
                    "torch.long; for classification one class id per example, shape (B,), dtype torch.long (float "
                    "labels are regression targets (B,) with one output, or multi-label (B, classes)); for anything "
                    "else pass loss_fn=f(outputs, labels, num_items_in_batch)")


def loss_of(out: Any) -> torch.Tensor | None:
    """The loss a model computed itself: ``out.loss``, a scalar tensor output, or the scalar in a tuple
    (transformers' ``(loss, logits)``, nanoGPT's ``(logits, loss)``); None if there is none."""
    if isinstance(out, torch.Tensor):
        return out if out.ndim == 0 else None
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        loss = out.get("loss") if isinstance(out, Mapping) else out.loss
        return loss if isinstance(loss, torch.Tensor) else None
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.ndim == 0 and t.is_floating_point()), None)
    return None


def micro_loss(out: Any, b: Batch, head: str, n_window: torch.Tensor | int, n_micro: int, accum: int,
               loss_fn: LossFn | None = None, problem_type: str | None = None) -> torch.Tensor:
    """One micro-batch's share of the window's mean loss (see the module docstring)."""
    if loss_fn is not None:
        return loss_fn(out, b.labels, n_window)
    own = loss_of(out)
    if own is not None and "labels" in b.kwargs and head == "ctc-sum":  # a sum over the micro-batch: sums add up
        return own
    if own is not None and "labels" in b.kwargs:  # the model's mean over its own micro-batch: re-weight
        return own * (n_micro / n_window)
    if own is not None and b.labels is None:
        if accum > 1:
            raise PlanError("the model computes its own loss from keys other than 'labels', so the window's token count "
                            "is unknown and accum:K would weight micro-batches wrongly: name the targets 'labels', "
                            "pass loss_fn=f(outputs, labels, num_items_in_batch), or use accum:1")
        return own
    if b.labels is None:
        raise PlanError("the batch has no 'labels' and the model returned no loss: add 'labels' to the batch "
                        "(transformers' convention: unshifted, -100 ignored) or pass loss_fn=")
    try:
        logits = logits_of(out)
    except TypeError as e:
        raise PlanError(f"{e}: return logits (a tensor, a tuple starting with them, or an output with .logits), "
                        "or pass loss_fn=") from None
    return summed_loss(logits, b.labels, head, problem_type) / n_window


"""A small generated English corpus and a byte-level tokenizer, so any model trains on real text
offline and the loss visibly falls in a demo.

>>> data = TextData()
>>> x, y = data.batch(2, 8, step=0, seed=0)
>>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
(torch.Size([2, 8]), True)
"""
from __future__ import annotations

import functools
import random

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

IGNORE_INDEX = -100  # labels with this value are padding: excluded from loss and token counts

_SUBJECTS = ["the model", "a student", "the GPU", "my notebook", "the optimizer", "every layer",
             "the small network", "a researcher", "the training loop", "the tracker"]
_VERBS = ["stores", "measures", "frees", "saves", "keeps", "moves", "counts", "checks", "shards", "computes"]
_OBJECTS = ["the gradients", "its activations", "the optimizer state", "eight bits per value",
            "a copy of the weights", "the peak memory", "every parameter", "the loss", "a checkpoint",
            "the attention scores"]
_ENDS = ["before the step", "on the host", "in half precision", "during the backward pass",
         "after each batch", "without a copy", "in place", "on a free T4", "one layer at a time", "again"]


@functools.lru_cache(maxsize=4)  # a str: immutable, generated once per process
def corpus(n_sentences: int = 4000, seed: int = 1234) -> str:
    """Generated sentences with a small grammar: regular enough to learn in a few hundred steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDS)}."
        out.append(s[0].upper() + s[1:])
    return " ".join(out) + "\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256). >>> ByteTokenizer().decode(ByteTokenizer().encode("hi"))
    'hi'"""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def _in_a_mode() -> bool:
    """A dispatch mode (MemoryTracker, fake tensors) or a function mode (``with torch.device(...)``) is on."""
    return _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled()


@functools.lru_cache(maxsize=1)
def _corpus_ids() -> torch.Tensor:
    """The default corpus as byte ids (210k), built once per process: a list of ints made into a tensor took
    ~20 ms, paid by every measure(), train() and selftest step that made a TextData()."""
    return torch.tensor(ByteTokenizer().encode(corpus()), dtype=torch.long)


class TextData:
    """Random windows of the tokenised corpus. Batches depend only on (seed, step), so a resumed
    run sees exactly the batches it would have seen."""

    def __init__(self, text: str | None = None, tokenizer: ByteTokenizer | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        if not text and type(self.tokenizer) is ByteTokenizer and not _in_a_mode():
            self.tokens = _corpus_ids()  # shared and read only: batch() indexes it (a copy)
        else:  # under a mode (a tracker, fake tensors, a default device) built as before: the mode sees the same
            self.tokens = torch.tensor(self.tokenizer.encode(text or corpus()), dtype=torch.long)

    def batch(self, batch: int, seq: int, step: int, seed: int = 0, device: str | torch.device = "cpu"):
        """Inputs (B, S) and next-token labels (B, S) for one optimizer step."""
        if seq + 1 >= len(self.tokens):
            raise ValueError(f"seq={seq} is longer than the corpus ({len(self.tokens)} tokens)")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(seq + 1)  # (B, S+1)
        window = self.tokens[idx]
        return window[:, :-1].to(device), window[:, 1:].to(device)

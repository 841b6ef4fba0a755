"""colabkit.data: the generated corpus and TextData's tokens against the tokenizer's own encoding, and what a
TextData() costs (every measure, train and selftest step builds one)."""
import random

import torch

import colabkit.data as data
from colabkit import MemoryTracker
from colabkit.data import ByteTokenizer, TextData, corpus


class _Bytes(ByteTokenizer):
    """The same ids through the general path (a tokenizer that is not exactly ByteTokenizer)."""


def test_tokens_are_the_tokenizers_ids_of_the_corpus():
    ref = torch.tensor(ByteTokenizer().encode(corpus()), dtype=torch.long)  # the tokenizer's list of ids
    for d in (TextData(), TextData(tokenizer=_Bytes()), TextData(corpus())):
        assert d.tokens.dtype == torch.long and torch.equal(d.tokens, ref)
    assert not torch.equal(TextData(corpus(seed=7)).tokens[:ref.numel()], ref)  # control: another corpus differs


def test_the_corpus_is_built_once_per_process_and_modes_see_what_they_saw(monkeypatch):
    """TextData() generated the 4000-sentence corpus and made its 210k byte ids a tensor from a list of ints each
    time: ~35 ms of CPU, paid by every measure(), train() and (once per step) selftest check. Now both are built
    once. Under a mode nothing changes: a MemoryTracker saw no tensor made from a list, and sees none now (the
    shared one would be a 1.7 MB tensor it never saw allocated); a default device still gets the tokens.
    Control: a new seed is generated (the counter counts)."""
    built = []

    class Counted(random.Random):
        def __init__(self, seed=None):
            built.append(seed)
            super().__init__(seed)
    monkeypatch.setattr(data.random, "Random", Counted)
    corpus.cache_clear()
    data._corpus_ids.cache_clear()
    first = TextData()
    assert all(TextData().tokens is first.tokens for _ in range(3))
    assert built == [1234]
    corpus(seed=99)
    assert built == [1234, 99]  # the control
    with MemoryTracker(device="cpu", alert_at=None) as mt:
        tracked = TextData()
    assert tracked.tokens is not first.tokens and torch.equal(tracked.tokens, first.tokens)
    assert mt.report()["peak_bytes"] == 0
    with torch.device("meta"):
        assert TextData().tokens.is_meta
    corpus.cache_clear()  # the next caller builds its own, with the real random.Random
    data._corpus_ids.cache_clear()

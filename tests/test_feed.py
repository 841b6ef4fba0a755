"""train(model, data=...) on the user's own data (colabkit.feed): a list of batch dicts, a map-style Dataset of
examples and a DataLoader, killed mid-way (in process, and by a real SIGKILL in a forked child) and resumed,
end with the uninterrupted run's weights; on_oom="shrink" splits a batch dict; bad data is refused."""
import os
import shutil
import signal
import sys

import pytest
import torch

from colabkit.checkpoints import list_checkpoints
from colabkit.data import TextData
from colabkit.feed import Feed
from colabkit.models import build_model
from colabkit.train import train
from tests.forking import fork

KW = dict(seq=16, seed=5, device="cpu", progress=False, track=False)
_TOKENS = TextData().tokens


def _window(i: int, n: int = 16) -> torch.Tensor:
    return _TOKENS[37 * i:37 * i + n]


class Examples(torch.utils.data.Dataset):
    """A map-style dataset of 10 examples: {"input_ids": (16,), "labels": (16,)} (unshifted, as transformers')."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"input_ids": _window(i), "labels": _window(i)}


def batch_dicts():
    return [{"input_ids": torch.stack([_window(4 * j + k) for k in range(4)]),
             "labels": torch.stack([_window(4 * j + k) for k in range(4)])} for j in range(3)]


def hf_dataset():
    import datasets

    rows = [Examples()[i] for i in range(10)]
    return datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]})  # lists of ints


DATA = {"list of batch dicts": batch_dicts, "Dataset of examples": Examples, "Hugging Face Dataset": hf_dataset,
        "DataLoader": lambda: torch.utils.data.DataLoader(Examples(), batch_size=4, shuffle=True)}


class _Killed(BaseException):
    """Stands for SIGKILL: nothing catches it and no end-of-run checkpoint is written."""


@pytest.mark.parametrize("kind", list(DATA))
def test_killed_and_resumed_run_ends_with_the_uninterrupted_weights(kind, tmp_path, monkeypatch):
    make, d = DATA[kind], str(tmp_path / "ck")
    whole = train("gpt:2x64", data=make(), steps=5, batch=4, **KW)
    train_mod = sys.modules["colabkit.train"]
    step = train_mod._step

    def killed_at_3(trainer, *a, **k):
        if trainer.step_count == 3:
            raise _Killed
        return step(trainer, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(train_mod, "_step", killed_at_3)
        with pytest.raises(_Killed):
            train("gpt:2x64", data=make(), steps=5, batch=4, checkpoint_dir=d, checkpoint_every=2, **KW)
    assert [s for s, _ in list_checkpoints(d)] == [2]
    shutil.copytree(d, str(tmp_path / "copy"))
    resumed = train("gpt:2x64", data=make(), steps=5, batch=4, checkpoint_dir=d, checkpoint_every=2, resume=True, **KW)
    assert resumed["resumed_from"].endswith("ckpt-00000002.ckpt")
    assert resumed["weights_sha256"] == whole["weights_sha256"] and resumed["losses"] == whole["losses"][2:]
    # negative control: a feed that restarts at the resumed step (a DataLoader iterated afresh) ends elsewhere
    restarted = Feed.batch
    monkeypatch.setattr(Feed, "batch", lambda self, s: restarted(self, s - 2))
    other = train("gpt:2x64", data=make(), steps=5, batch=4, checkpoint_dir=str(tmp_path / "copy"), resume=True, **KW)
    assert other["resumed_from"].endswith("ckpt-00000002.ckpt") and other["weights_sha256"] != whole["weights_sha256"]


def test_sigkilled_forked_run_resumes_to_the_same_weights(tmp_path):
    d = str(tmp_path / "ck")
    loader = lambda: torch.utils.data.DataLoader(Examples(), batch_size=2, shuffle=True)  # noqa: E731
    whole = train("gpt:2x64", data=loader(), steps=7, batch=2, **KW)

    def killer(event):  # the child dies by SIGKILL after step 5 (checkpoints at 2 and 4): no clean-up runs
        if event["step"] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
    pid = fork(lambda: train("gpt:2x64", data=loader(), steps=7, batch=2, checkpoint_dir=d, checkpoint_every=2,
                             callbacks=[killer], **KW) and 0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [s for s, _ in list_checkpoints(d)] == [2, 4]
    resumed = train("gpt:2x64", data=loader(), steps=7, batch=2, checkpoint_dir=d, checkpoint_every=2, resume=True, **KW)
    assert resumed["resumed_from"].endswith("ckpt-00000004.ckpt") and resumed["weights_sha256"] == whole["weights_sha256"]


def test_every_example_once_per_epoch_in_a_seeded_order():
    f = Feed(list(range(10)), 4, seed=1, collate_fn=list)
    epoch = [x for s in range(3) for x in f.batch(s)]  # 4 + 4 + 2 (the last batch is short, as a DataLoader's)
    assert sorted(epoch) == list(range(10)) and epoch != list(range(10))
    again = [x for s in range(3, 6) for x in f.batch(s)]
    assert sorted(again) == list(range(10)) and again != epoch  # the next epoch: another permutation
    assert Feed(list(range(10)), 4, seed=1, collate_fn=list, drop_last=True).steps_per_epoch == 2


class _OOMAbove(torch.nn.Module):
    """A GPT that runs out of memory for a micro-batch above ``limit`` sequences (after its forward)."""

    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.gpt, self.limit = build_model("gpt:2x64"), limit

    @property
    def config(self):
        return self.gpt.config

    def forward(self, input_ids):
        out = self.gpt(input_ids)
        if input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return out


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_shrink_splits_a_batch_dict_with_the_same_weights(capsys):
    """A batch dict split 4 -> 2 -> 1 sequences ends with accum:4's weights bit for bit (the same sums). Against
    the run that never shrank (one micro-batch of 4) the computation is the same and only fp32's summation order
    differs: in float64 the two agree within 1e-12 (measured 3e-15), far inside the issue's 1e-6; in fp32 they
    differ by ~1e-6 (1.2e-6 here: AdamW's first steps divide each gradient by its own size, so a rounding in a
    near-cancelling gradient moves its update). Negative control: dropping half of each batch dict instead of
    splitting it moves the weights by more than 1e-4, in float64 too."""
    kw = dict(KW, steps=3, batch=4)
    out = train(_OOMAbove(1), data=batch_dicts(), on_oom="shrink", **kw)  # 4 -> 2 -> 1 sequences per micro-batch
    assert [(s["micro_batch"], s["to_micro_batch"]) for s in out["oom_shrinks"]] == [(4, 2), (2, 1)]
    ref = train(_OOMAbove(10**9), data=batch_dicts(), plan="accum:4", **kw)  # never out of memory
    assert _diff(out["trainer"].model.state_dict(), ref["trainer"].model.state_dict()) == 0

    def wide(limit: int) -> torch.nn.Module:
        m = _OOMAbove(limit)
        m.gpt.double()
        return m
    shrunk = train(wide(1), data=batch_dicts(), on_oom="shrink", **kw)["trainer"].model.state_dict()
    whole = train(wide(10**9), data=batch_dicts(), **kw)["trainer"].model.state_dict()
    assert {v.dtype for v in whole.values() if v.is_floating_point()} == {torch.float64}
    assert _diff(shrunk, whole) <= 1e-12
    half = [{k: v[:2] for k, v in b.items()} for b in batch_dicts()]
    assert _diff(train(wide(10**9), data=half, **kw)["trainer"].model.state_dict(), whole) > 1e-4


def test_bad_data_is_refused_with_what_to_do():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()
    for data, match in [(Stream(), "cannot be indexed by step"), ([], "data is empty"),
                        (torch.utils.data.DataLoader(Stream(), batch_size=2), "cannot be read by step")]:
        with pytest.raises(ValueError, match=match):
            train("gpt:2x64", data=data, steps=1, batch=2, **KW)
    with pytest.raises(ValueError, match="eval_every"):
        train("gpt:2x64", data=batch_dicts(), steps=1, eval_every=1, **KW)


def test_batch_dicts_of_lists_train_as_their_tensors():
    """Batch dicts holding nested lists (a pre-batched Hugging Face Dataset's rows, JSON) are batches of tensors:
    the same weights as the same batches given as tensors (was: StopIteration in the OOM guard's batch size)."""
    kw = dict(steps=2, seed=1, device="cpu", progress=False, track=False)
    as_lists = [{k: v.tolist() for k, v in b.items()} for b in batch_dicts()]
    got = train(lambda: build_model("gpt:2x64"), data=as_lists, **kw)  # built after train seeds
    want = train(lambda: build_model("gpt:2x64"), data=batch_dicts(), **kw)
    assert got["weights_sha256"] == want["weights_sha256"] and got["micro_batch"] == 4
    other = train(lambda: build_model("gpt:2x64"), data=batch_dicts()[::-1], **kw)  # negative control: other batches differ
    assert other["weights_sha256"] != want["weights_sha256"]


def test_a_text_column_is_refused_saying_to_tokenize_or_drop_it():
    """Examples with a column of strings (a tokenized Hugging Face Dataset still holding 'text'): colabkit's error
    naming the column and what to do (was torch's "new(): invalid data type 'str'")."""
    rows = [{"text": "a b", **Examples()[i]} for i in range(4)]
    with pytest.raises(ValueError, match=r"the examples' 'text' are not numbers .*remove_columns\(\['text'\]\)"):
        train("gpt:2x64", data=rows, steps=1, batch=2, **KW)
    out = train("gpt:2x64", data=[{k: v for k, v in r.items() if k != "text"} for r in rows], steps=1, batch=2, **KW)
    assert out["step"] == 1  # negative control: without the column it trains


def test_ready_batches_decide_their_size_and_the_run_says_so(capsys):
    """A DataLoader's batch_size and a list of batch dicts decide a step's size, whatever train(batch=) says --
    and the run says so, where train's batch= is not what steps (it was silent). Examples are grouped by batch=."""
    kw = dict(steps=1, seq=16, device="cpu", progress=False, batch=8)
    rows = [{"input_ids": _window(i), "labels": _window(i)} for i in range(16)]
    out = train(lambda: build_model("gpt:2x32"), data=torch.utils.data.DataLoader(rows, batch_size=4), **kw)
    assert out["micro_batch"] == 4 and "a batch of 4 as the DataLoader makes it" in capsys.readouterr().out
    out = train(lambda: build_model("gpt:2x32"), data=batch_dicts(), **kw)
    assert out["micro_batch"] == 4 and "one of your batches as it is (4 per step)" in capsys.readouterr().out
    out = train(lambda: build_model("gpt:2x32"), data=rows, **kw)  # examples: grouped by batch=, nothing to say
    assert out["micro_batch"] == 8 and "each step takes" not in capsys.readouterr().out


def test_a_dataloader_of_ready_batches_trains_as_the_batches_themselves():
    """DataLoader(batches, batch_size=None) -- each item a batch already (what the review's user wrote): the same
    weights as the list of batches itself. Control: a custom batch_sampler, which cannot be read by step, is refused
    with its reason."""
    from colabkit import weights_sha256

    loader = torch.utils.data.DataLoader(batch_dicts(), batch_size=None)
    got = train("gpt:2x64", data=loader, steps=3, **KW)["trainer"].model
    want = train("gpt:2x64", data=batch_dicts(), steps=3, **KW)["trainer"].model
    assert weights_sha256(got) == weights_sha256(want)
    custom = torch.utils.data.DataLoader(batch_dicts(), batch_sampler=[[0, 1], [2]])
    with pytest.raises(ValueError, match="cannot be read by step"):
        train("gpt:2x64", data=custom, steps=1, **KW)

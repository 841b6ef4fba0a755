"""The trace cache on disk (colabkit.estimate.trace_cache): a later process answers from the traces an
earlier one stored -- the same figures, no trace run -- and anything that could change a trace (colabkit's
source, torch's version) or a damaged entry makes it trace again."""
import importlib
import os
import pickle
from collections import OrderedDict

import pytest

from colabkit.estimate import estimate

trace_mod = importlib.import_module("colabkit.estimate.trace")
cache = importlib.import_module("colabkit.estimate.trace_cache")

MODEL = "gpt:4x32"  # four blocks: extrapolated from 2- and 3-layer traces, each built from a base trace


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """The cache switched on in a folder of this test's; the process's own traces forgotten; trace() counted."""
    monkeypatch.setenv(cache.ENV, str(tmp_path / "traces"))
    monkeypatch.setattr(trace_mod, "_CACHE", OrderedDict())
    calls = []
    real = trace_mod.trace

    def counted(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(trace_mod, "trace", counted)
    return tmp_path / "traces", calls


def _new_process(monkeypatch):
    """What a new process starts with: no trace in memory (the disk folder stays)."""
    monkeypatch.setattr(trace_mod, "_CACHE", OrderedDict())


def _figures(r):
    return r["peak_bytes"], r["breakdown"], r["phase_peaks"], r["flops"], r["notes"]


def test_a_later_process_answers_from_disk(on_disk, monkeypatch):
    folder, calls = on_disk
    first = estimate(MODEL, "checkpoint", batch=1, seq=16, gpu="t4")
    assert calls and len(list(folder.rglob("*.pkl"))) >= 3  # the plan, its depths and their base traces
    calls.clear()
    _new_process(monkeypatch)
    assert _figures(estimate(MODEL, "checkpoint", batch=1, seq=16, gpu="t4")) == _figures(first)
    assert calls == []
    # another optimizer with the same model-side tokens: its base traces are on disk, only the step is replayed
    _new_process(monkeypatch)
    other = estimate(MODEL, "checkpoint+adamw4bit", batch=1, seq=16, gpu="t4")
    assert calls == []
    monkeypatch.setenv(cache.ENV, "off")  # the reference: the same question traced from scratch
    _new_process(monkeypatch)
    assert _figures(estimate(MODEL, "checkpoint+adamw4bit", batch=1, seq=16, gpu="t4")) == _figures(other)
    assert calls  # control: with the cache off it did trace


def test_another_stamp_traces_again(on_disk, monkeypatch):
    """An edited colabkit (or another torch) has another stamp: its process finds none of the old entries."""
    folder, calls = on_disk
    estimate(MODEL, "baseline", batch=1, seq=16, gpu="t4")
    real = cache.stamp()
    monkeypatch.setattr(cache, "stamp", lambda: "another-version")
    _new_process(monkeypatch)
    calls.clear()
    estimate(MODEL, "baseline", batch=1, seq=16, gpu="t4")
    assert calls
    assert {p.parent.name for p in folder.rglob("*.pkl")} == {"another-version", real}


def test_the_stamp_follows_the_source(tmp_path, monkeypatch):
    src = tmp_path / "colabkit"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(cache, "_PACKAGE", src)
    one = cache.stamp.__wrapped__()
    assert cache.stamp.__wrapped__() == one  # the same source: the same stamp (another process computes it so)
    (src / "a.py").write_text("x = 2\n")
    assert cache.stamp.__wrapped__() != one
    monkeypatch.setattr(cache.torch, "__version__", "0.0-other")
    (src / "a.py").write_text("x = 1\n")
    assert cache.stamp.__wrapped__() != one


def test_a_damaged_entry_is_traced_again(on_disk, monkeypatch):
    folder, calls = on_disk
    first = estimate(MODEL, "baseline", batch=1, seq=16, gpu="t4")
    for p in folder.rglob("*.pkl"):
        p.write_bytes(b"not a pickle")
    _new_process(monkeypatch)
    calls.clear()
    assert _figures(estimate(MODEL, "baseline", batch=1, seq=16, gpu="t4")) == _figures(first)
    assert calls
    for p in folder.rglob("*.pkl"):  # each damaged file replaced by a good one
        assert pickle.loads(p.read_bytes())[0].startswith("(")


def test_a_colliding_key_reads_as_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    cache.store(("a",), 1)
    path = cache._path(("a",))
    path.write_bytes(pickle.dumps((repr(("b",)), 2)))
    assert cache.load(("a",)) is None


def test_off_and_unwritable(tmp_path, monkeypatch, on_disk):
    folder, _ = on_disk
    monkeypatch.setenv(cache.ENV, "off")
    estimate("gpt-tiny", "baseline", batch=2, seq=16, gpu=None, device="cpu")
    assert not folder.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cache.ENV, str(blocker))  # a folder that cannot be made: estimates still answer
    assert estimate("gpt-tiny", "checkpoint", batch=2, seq=16, gpu=None, device="cpu")["peak_bytes"] > 0
    assert cache.clear() == 0


def test_clear_and_old_stamps_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    for i in range(cache.KEEP_STAMPS + 2):
        monkeypatch.setattr(cache, "stamp", lambda i=i: f"v{i}")
        cache.store(("k",), i)
        os.utime(tmp_path / f"v{i}", (i, i))  # distinct mtimes in order, whatever the file system's resolution
    kept = sorted(p.name for p in tmp_path.iterdir())  # pruned as each new stamp's folder was made
    assert kept == [f"v{i}" for i in range(2, cache.KEEP_STAMPS + 2)]
    assert cache.clear() == len(kept)
    assert not tmp_path.exists()


def test_an_hf_folder_is_not_kept_on_disk(on_disk, tmp_path, monkeypatch):
    """hf:<folder> names a config file that can change under the same name: cached per process only, so an
    edited config.json is estimated afresh (control: the GPT preset beside it is stored)."""
    import json

    folder, _ = on_disk
    model = tmp_path / "my-model"
    model.mkdir()

    def write(n_embd):
        (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                       "n_layer": 2, "n_head": 2, "n_embd": n_embd,
                                                       "vocab_size": 128, "n_positions": 64}))

    write(32)
    small = estimate(f"hf:{model}", "baseline", batch=1, seq=16, gpu=None, device="cpu")["peak_bytes"]
    assert not list(folder.rglob("*.pkl"))
    write(64)
    _new_process(monkeypatch)
    assert estimate(f"hf:{model}", "baseline", batch=1, seq=16, gpu=None, device="cpu")["peak_bytes"] > small
    estimate("gpt-tiny", "baseline", batch=1, seq=16, gpu=None, device="cpu")
    assert list(folder.rglob("*.pkl"))

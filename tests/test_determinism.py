"""Issue 24 defect 10: same seed, same bytes.

* Two runs with one seed write byte-identical checkpoints, whatever state Python's and NumPy's global
  generators were in before (two processes start them from the OS's entropy; here they are set apart by hand).
* A CPU run's weights depend on the thread count (the reference: the same run at another thread count gives
  other weights); a resume in a process with another thread count runs with the checkpoint's and ends with
  the uninterrupted run's weights.
* ``deterministic=True`` turns on torch's deterministic algorithms for the run only, and sets cuBLAS's
  workspace; ``--deterministic`` reaches train and bench.
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from colabkit import train
from colabkit.checkpoints import list_checkpoints, read_checkpoint

RUN = dict(steps=2, batch=2, seq=16, progress=False, track=False)


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run_after(entropy, d):
    random.seed(entropy)          # what a fresh process would start from
    np.random.seed(entropy)
    train("gpt:2x32", checkpoint_dir=str(d), checkpoint_every=2, **RUN)
    return list_checkpoints(str(d))[-1][1]


def test_two_runs_with_one_seed_write_byte_identical_checkpoints(tmp_path):
    a, b = _run_after(1, tmp_path / "a"), _run_after(2, tmp_path / "b")
    sa, sb = read_checkpoint(a), read_checkpoint(b)
    assert sa["rng"]["python"] == sb["rng"]["python"]                      # before the fix: differ
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(sa["rng"]["numpy"], sb["rng"]["numpy"]))
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()                                      # every tensor, every RNG, the manifest


def test_resume_with_another_thread_count_continues_bit_for_bit(tmp_path, threads, capsys):
    torch.set_num_threads(2)
    whole = train("gpt:2x64", steps=3, batch=4, seq=32, progress=False, track=False)["weights_sha256"]
    torch.set_num_threads(1)
    other = train("gpt:2x64", steps=3, batch=4, seq=32, progress=False, track=False)["weights_sha256"]
    assert other != whole  # the reference: on this CPU the thread count changes the weights' last bits
    torch.set_num_threads(2)
    train("gpt:2x64", steps=1, batch=4, seq=32, progress=False, track=False, checkpoint_dir=str(tmp_path))
    torch.set_num_threads(1)  # the resuming process has another thread count
    out = train("gpt:2x64", steps=3, batch=4, seq=32, progress=False, track=False, checkpoint_dir=str(tmp_path),
                resume=True)
    assert out["weights_sha256"] == whole and torch.get_num_threads() == 2   # before the fix: == other
    assert "resuming with 2 CPU threads" in capsys.readouterr().out


def _no_cublas_config(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so whatever the test sets is undone after it
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")


def test_deterministic_run_only(monkeypatch):
    _no_cublas_config(monkeypatch)
    seen = []
    out = train("gpt:2x32", deterministic=True, **RUN, callbacks=[
        lambda r: seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))])
    assert seen == [(True, ":4096:8")] * 2 and not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # CUDA never started: the environment as it was
    assert out["weights_sha256"] == train("gpt:2x32", **RUN)["weights_sha256"]  # on a CPU the same bytes either way


def test_cli_deterministic_reaches_train_and_bench(monkeypatch):
    from colabkit import __main__ as cli
    import importlib
    train_mod = importlib.import_module("colabkit.train")  # the module (colabkit.train is also the function)

    got = []
    monkeypatch.setattr(train_mod, "train", lambda *a, **kw: got.append(kw["deterministic"]) or dict.fromkeys(
        ("step", "loss", "weights_sha256", "complete", "losses", "accum", "oom_shrinks", "resumed_from", "simulated"), 0))
    monkeypatch.setattr(train_mod, "measure", lambda *a, **kw: got.append(kw["deterministic"]) or {"ok": True})
    _no_cublas_config(monkeypatch)
    assert cli.main(["train", "--deterministic", "--json", os.devnull]) == 0
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert cli.main(["bench", "--deterministic", "--json", os.devnull]) == 0
    assert cli.main(["bench", "--json", os.devnull]) == 0
    assert got == [True, True, False]
    assert cli.main(["train", "--deterministic", "--world-size", "2", "--plan", "zero:1"]) == 2  # refused, not dropped


def test_measure_deterministic_for_the_measurement_only():
    from colabkit import measure

    seen = set()
    r = measure("gpt:2x32", batch=2, seq=16, steps=1, device="cpu", deterministic=True,
                on_sample=lambda s: seen.add(torch.are_deterministic_algorithms_enabled()))
    assert r["ok"] and seen == {True} and not torch.are_deterministic_algorithms_enabled()

"""The tracker's categories are exact for known cases (fp32 AdamW: 4/4/8 bytes per parameter)."""
import json
import re
import warnings

import pytest
import torch
import torch.nn as nn

from colabkit.memory import CATEGORIES, MemoryTracker, format_report
from colabkit.models import GPTConfig, GPT, count_params


def _adam_steps(model, x, steps=2, tracker_kwargs=None):
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with MemoryTracker(model, opt, **(tracker_kwargs or {})) as mt:
        for s in range(steps):
            mt.set_step(s)
            with mt.phase("forward"):
                loss = model(x).square().mean()
            with mt.phase("backward"):
                loss.backward()
            with mt.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
    return mt, opt


def test_fp32_adamw_bytes_per_parameter_exact():
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    n = count_params(model)
    mt, opt = _adam_steps(model, torch.randn(16, 128))
    r = mt.report()
    n_tensors = len(list(model.parameters()))
    assert r["breakdown"]["params"] == 4 * n
    assert r["breakdown"]["grads"] == 4 * n
    # exp_avg + exp_avg_sq (8 B/param) + one fp32 'step' scalar per parameter tensor
    assert r["breakdown"]["optimizer"] == 8 * n + 4 * n_tensors


def test_activations_of_one_linear_layer_match_formula():
    # Forward of y = W x + b under no other op saves nothing new but creates y: B*out*4 bytes.
    lin = nn.Linear(256, 1024)
    x = torch.randn(32, 256)
    with MemoryTracker(lin) as mt:
        with mt.phase("forward"):
            y = lin(x)
    assert mt.report()["breakdown"]["activations"] == 32 * 1024 * 4
    # A GELU after it keeps its input and adds its output: two (B, out) fp32 tensors.
    seq = nn.Sequential(nn.Linear(256, 1024), nn.GELU())
    with MemoryTracker(seq) as mt:
        with mt.phase("forward"):
            y = seq(x)
    assert mt.report()["breakdown"]["activations"] == 2 * 32 * 1024 * 4
    del y


def test_gpt_block_activations_match_count():
    # One GPT block, fp32, B=2, S=32, D=64, 1 head: count the saved/created tensors by hand.
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=1, vocab_size=256, block_size=32)
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 32))
    with MemoryTracker(model) as mt:
        with mt.phase("forward"):
            logits = model(x)
    acts = mt.report()["breakdown"]["activations"]
    B, S, D, V = 2, 32, 64, 256
    # lower bound: embeddings out + residual stream + qkv + attention out + mlp hidden(x2) + logits
    lower = 4 * (B * S * D * 4 + B * S * 3 * D + B * S * 4 * D * 2 + B * S * V)
    assert lower <= acts <= 3 * lower
    del logits


def test_peak_and_at_peak_consistent_and_phases_ordered():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    mt, _ = _adam_steps(model, torch.randn(8, 64), steps=3)
    r = mt.report()
    assert sum(r["at_peak"].values()) == r["peak_bytes"]
    for c in CATEGORIES:
        assert r["breakdown"][c] >= r["at_peak"][c]
    phases = [s["phase"] for s in mt.timeline if s["phase"] in ("forward", "backward", "optimizer")]
    assert phases == ["forward", "backward", "optimizer"] * 3
    steps = [s["step"] for s in mt.timeline if s["phase"] == "forward"]
    assert steps == [0, 1, 2]
    assert "peak" in format_report(r)


def test_frees_are_seen_and_leak_is_visible():
    model = nn.Linear(256, 256)
    keep = []
    with MemoryTracker(model) as mt:
        for _ in range(3):
            with mt.phase("forward"):
                loss = model(torch.randn(64, 256)).sum()
            keep.append(loss)  # keeps each graph (and its activations) alive: a leak
        del loss
        leaked = mt.current()["activations"]
        keep.clear()
        freed = mt.current()["activations"]
    assert leaked >= 3 * 64 * 256 * 4
    assert freed == 0


def test_alert_warns_once_with_largest_category():
    model = nn.Linear(512, 512)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with MemoryTracker(model, budget_bytes=2_000_000, alert_at=0.9) as mt:
            for _ in range(3):
                with mt.phase("forward"):
                    y = model(torch.randn(1024, 512))
                del y
    msgs = [str(x.message) for x in w if "colabkit: memory reached" in str(x.message)]
    assert len(msgs) == 1 and "largest category" in msgs[0]
    reached = int(re.search(r"(\d+)% of the budget", msgs[0])[1])
    assert reached > 90, msgs[0]  # said when it crosses the alert line: what it reached then (one 2 MiB output)
    assert mt.alerts == msgs


def test_snapshot_cpu_json(tmp_path):
    model = nn.Linear(64, 64)
    with MemoryTracker(model) as mt:
        with mt.phase("forward"):
            y = model(torch.randn(4, 64))
        path = mt.snapshot(str(tmp_path / "snap.json"))
    data = json.load(open(path))
    cats = {r["category"] for r in data["live"]}
    assert {"params", "activations"} <= cats
    del y


def test_views_of_untracked_tensors_are_not_counted():
    w = torch.randn(512, 512)  # created before the tracker: not ours
    with MemoryTracker(device="cpu") as mt:
        with mt.phase("forward"):
            v = w.t()[:10]  # views allocate nothing
    assert mt.report()["peak_bytes"] == 0
    del v


def test_tracker_does_not_keep_models_alive():
    """A finished measure() must release its model, optimizer and tracker (on a GPU, leaked state would
    pile up across a notebook's runs until it OOMs). Negative control: a kept record's model stays."""
    import gc
    import weakref

    import colabkit

    model = colabkit.build_model("gpt-tiny")
    ref = weakref.ref(model)
    colabkit.measure(lambda: model, "baseline", batch=2, seq=16, steps=1, device="cpu")
    gc.collect()
    assert ref() is not None            # still ours: we hold it
    del model
    gc.collect()
    assert ref() is None, "the tracker kept the model alive"
    before = sum(isinstance(o, colabkit.MemoryTracker) for o in gc.get_objects())
    for _ in range(3):
        colabkit.measure("gpt-tiny", "baseline", batch=2, seq=16, steps=1, device="cpu")
    gc.collect()
    assert sum(isinstance(o, colabkit.MemoryTracker) for o in gc.get_objects()) == before


def test_storage_resized_in_place_keeps_its_category_and_the_patch_is_undone():
    # FSDP2 frees a gathered parameter with storage.resize_(0) and re-allocates it with resize_(n); the
    # tracker counts the new size at once, in the same category; nested trackers both see it, and the
    # original UntypedStorage.resize_ is back once the last one exits (an exception included)
    model = torch.nn.Linear(256, 256)
    w, b = 256 * 256 * 4, 256 * 4  # bytes of weight and bias (numel x 4, independent of the tracker)
    with MemoryTracker(model, device="cpu", alert_at=None) as outer:
        with MemoryTracker(model, device="cpu", alert_at=None) as inner:
            model.weight.untyped_storage().resize_(0)
            assert outer.current()["params"] == inner.current()["params"] == b
            model.weight.untyped_storage().resize_(2 * w)  # re-allocated (larger: a regrowth, not a restore)
            assert inner.current()["params"] == 2 * w + b
        assert "resize_" in vars(torch.UntypedStorage)  # the outer tracker is still active
        model.weight.untyped_storage().resize_(w)
    assert outer.report()["breakdown"]["params"] == 2 * w + b and outer.current()["params"] == w + b
    assert "resize_" not in vars(torch.UntypedStorage)  # torch's own method again
    with pytest.raises(RuntimeError):
        with MemoryTracker(device="cpu"):
            raise RuntimeError("boom")
    assert "resize_" not in vars(torch.UntypedStorage)

"""Depth extrapolation of hub-shaped models whose blocks alternate (Gemma-2's sliding-window and global
attention), against the full trace (issue 36, 2026-11-27)."""
from __future__ import annotations

import pytest

import colabkit


@pytest.mark.slow  # ~10 s of full traces; fast twin: test_estimate_fast.py::test_a_peak_that_moves_with_depth_is_extrapolated_from_its_segment
def test_alternating_sliding_and_global_blocks_extrapolate_as_their_full_trace(tmp_path, monkeypatch):
    """A Gemma-2-shaped model (10 blocks alternating sliding-window and global attention, a local folder's
    config) at 8x its window: estimated from 2 and 3 blocks, checkpointed, it equals the full 10-block trace.
    Why the uniform extrapolation holds: the window changes no bytes in the trace (the same peak at a window of
    16 and of 4096 tokens, on 4 blocks). Control: without the middle block's own lines the checkpointed recompute's
    peak, which sits in the second block (the first makes no input gradient), is missed (0.44% low)."""
    import importlib

    import transformers

    from colabkit.estimate.trace import full_trace

    depth_mod = importlib.import_module("colabkit.estimate.depth")
    trace_mod = importlib.import_module("colabkit.estimate.trace")
    def folder(layers: int, window: int) -> str:
        cfg = transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=window, max_position_embeddings=512)
        assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
        cfg.save_pretrained(tmp_path / f"{layers}-{window}")
        return f"hf:{tmp_path / f'{layers}-{window}'}"

    kw = dict(batch=2, seq=128, gpu="t4")
    with full_trace():  # the premise, on 4 blocks: the window changes no bytes
        short, wide = (colabkit.estimate(folder(4, w), "checkpoint", **kw)["peak_bytes"] for w in (16, 4096))
        full = colabkit.estimate(folder(10, 16), "checkpoint", **kw)["peak_bytes"]
    assert short == wide
    fast = colabkit.estimate(folder(10, 16), "checkpoint", **kw)
    assert any("10 layers extrapolated" in n for n in fast["notes"]), fast["notes"]
    assert abs(fast["peak_bytes"] / full - 1) <= 0.0005, (fast["peak_bytes"], full)
    monkeypatch.setattr(depth_mod, "_middle_lines", lambda *a: [])
    monkeypatch.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())
    ends_only = colabkit.estimate(folder(10, 16), "checkpoint", **kw)["peak_bytes"]
    assert ends_only < (1 - 0.003) * full

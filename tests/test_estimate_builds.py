"""What the estimator builds, and what it leaves behind (issue 36, review of 2026-11-27): an encoder-decoder
folder is built as the sequence-to-sequence model it is, and estimating first leaves how later models are built
as it was."""
from __future__ import annotations

import importlib

import pytest
import torch

from colabkit import build_model, estimate, weights_sha256


def test_an_encoder_decoder_folder_is_estimated_and_trained_with_token_pairs(tmp_path, monkeypatch):
    """hf:<folder> of a T5 config, offline: built as a sequence-to-sequence model (it was built as a causal LM,
    which transformers refuses for T5 with a page of class names), estimated for baseline, chunked-ce and
    checkpoint, the baseline equal to the measured peak within 1% (CPU). colabkit's loop takes (x, y) token
    pairs for it -- y feeds the decoder shifted right, as T5 builds it from labels -- and its loss equals the
    model's own loss on {"input_ids": x, "labels": y} within 1e-5. Control: built as a causal LM, the estimate
    fails."""
    import transformers

    import colabkit.models as models
    from colabkit import Trainer

    monkeypatch.setattr(models, "hub_unreachable", lambda: "offline (test)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    cfg.save_pretrained(tmp_path / "t5")
    name = f"hf:{tmp_path / 't5'}"
    for plan in ("chunked-ce", "checkpoint"):
        assert estimate(name, plan, batch=2, seq=32, gpu="t4")["peak_bytes"] > 0
    est = estimate(name, "baseline", batch=2, seq=32, device="cpu", gpu=None)["peak_bytes"]
    got = colabkit_measure(name)
    assert est == pytest.approx(got, rel=0.01), (est, got)
    torch.manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 12))
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        own = float(model(input_ids=x, labels=y).loss)
    assert Trainer(model, "baseline", device="cpu").evaluate(x, y) == pytest.approx(own, rel=1e-5)
    monkeypatch.setattr(models, "auto_class", lambda config: transformers.AutoModelForCausalLM)
    trace_mod = importlib.import_module("colabkit.estimate.trace")
    monkeypatch.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        estimate(name, "baseline", batch=2, seq=32, device="cpu", gpu=None)


def colabkit_measure(name: str) -> int:
    from colabkit import measure

    r = measure(name, "baseline", batch=2, seq=32, steps=2, device="cpu")
    assert r["ok"], r["error"]
    return r["peak_bytes"]


def test_estimating_first_leaves_how_models_are_built_as_it_was():
    """A fresh process that estimates before it builds any transformers model, then builds one: the same weights
    as a build without the estimate (until 2026-11-27 the trace swapped torch.nn.init's initialisers for no-ops
    while it built, and transformers, first imported inside, kept the no-ops: every later model started from
    randn weights, loss ~125 instead of ~5.5, and plan='auto' trained other weights than its own plan)."""
    import os
    import subprocess
    import sys

    code = ("import torch, colabkit; colabkit.estimate('llama:2x128', 'baseline', batch=1, seq=16, gpu='t4'); "
            "torch.manual_seed(0); print(colabkit.weights_sha256(colabkit.build_model('llama:2x128')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": root, "COLABKIT_TRACE_CACHE": "off"})
    assert out.returncode == 0, out.stderr[-2000:]
    torch.manual_seed(0)
    assert out.stdout.split()[-1] == weights_sha256(build_model("llama:2x128"))

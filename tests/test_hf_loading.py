"""Issue 24 defect 6, checked on the CPU: every ``from_pretrained`` colabkit makes passes the dtype keyword the
installed transformers understands (``dtype=`` from 4.56, ``torch_dtype=`` before; without one, 5.x loads the
checkpoint's own dtype), and a 4-bit hub model goes whole onto the one device the tracker watches, also where
there are two GPUs (Kaggle's 2xT4), instead of ``device_map="auto"`` splitting it over both."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from colabkit.notices import ColabkitWarning

transformers = pytest.importorskip("transformers")


def _fake_from_pretrained(monkeypatch, tf):
    seen = {}
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", lambda source, **kw: seen.update(kw) or nn.Linear(1, 1))
    return seen


@pytest.mark.parametrize("version, keyword", [("5.0.0", "dtype"), ("4.56.0", "dtype"), ("4.45.2", "torch_dtype")])
def test_hub_model_is_loaded_in_fp32_with_the_installed_keyword(monkeypatch, version, keyword):
    from colabkit import models

    tf = importlib.import_module("transformers")  # the module colabkit imports now (not this file's import-time one)
    seen = _fake_from_pretrained(monkeypatch, tf)
    monkeypatch.setattr(tf, "__version__", version)
    monkeypatch.setattr(models, "hub_unreachable", lambda *a, **k: None)  # "online": the hub path is taken
    models.build_model("hf:some/model")
    # before the fix: no keyword at all (transformers 5.x then loads bf16 weights for a bf16 checkpoint)
    assert seen == {keyword: torch.float32}


def test_4bit_model_goes_whole_to_the_current_device_of_two(monkeypatch):
    from colabkit import hf_models

    tf = hf_models._transformers()
    seen = _fake_from_pretrained(monkeypatch, tf)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)       # Kaggle's 2xT4
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)     # this process drives the second one
    monkeypatch.setattr(tf, "BitsAndBytesConfig", lambda **kw: kw)
    hf_models.load_hf_4bit("some/model")
    assert seen["device_map"] == {"": 1} and seen["dtype"] == torch.float16
    seen.clear()
    hf_models.load_hf_4bit("some/model", device_map="auto")          # asked for explicitly: passed on as asked
    assert seen["device_map"] == "auto"


def test_memory_callback_warns_when_device_map_split_the_model(recwarn):
    from colabkit.hf import check_one_device

    m = nn.Linear(1, 1)
    m.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "lm_head": "cpu"}
    check_one_device(m)                                   # one GPU (+ CPU offload): measured as it is
    assert not [w for w in recwarn if "split over" in str(w.message)]
    m.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}   # device_map="auto" on Kaggle's 2xT4
    with pytest.warns(ColabkitWarning, match=r"split over 2 GPUs \(cuda:0, cuda:1"):
        check_one_device(m)

"""Fast twins of heavy estimator tests (marked slow in tests/test_estimate.py and tests/test_estimate_trust.py):
the same claim, checked with fewer traces."""
import pytest
import torch

import colabkit
from colabkit.estimate.planner import _fast_estimate, gpt2_shape
from colabkit.models import GPT, count_params, hf_from_config


def _params(width: int) -> int:
    with torch.device("meta"):
        return count_params(GPT(gpt2_shape(width)))


@pytest.mark.parametrize("plan,at_least,width", [("checkpoint+adamw8bit+fused-step", 2.0e9, 2368),
                                                 ("qlora:16+checkpoint", 14e9, 4928)])
def test_smallest_gpt2_shape_of_the_size_fits_t4(plan, at_least, width):
    """Twin of test_estimate.py::test_largest_with_memory_plans_t4 (issue 6: >= 2.0B full training, >= 14B
    QLoRA on a T4): ``largest`` bisects over GPT-2-shaped widths in steps of 64 with this same estimate, so
    its answer reaches ``at_least`` exactly when the smallest width of that size fits -- one estimate
    instead of a dozen. (The bisection itself: test_largest_baseline_t4_in_issue_range.)"""
    assert _params(width) >= at_least > _params(width - 64)  # the smallest such width
    r = _fast_estimate(gpt2_shape(width), plan, 1, 1024, "t4", None)
    assert r["fits"] and r["peak_bytes"] <= r["budget_bytes"], (r["peak_bytes"], r["budget_bytes"])


def test_baseline_t4_bounds_of_largest():
    """Twin of test_estimate.py::test_largest_baseline_t4_in_issue_range (fp32 AdamW, 16 B/param: 0.5-1.0B on
    a T4): the smallest width of >= 0.5B fits and the smallest of > 1.0B does not, so the bisection's answer
    lies between. (The bisection runs in planner.largest's doctest and test_largest_agrees_with_a_full_trace.)"""
    assert _params(1472) >= 0.5e9 > _params(1408) and _params(1856) > 1.0e9 >= _params(1792)
    lo, hi = (_fast_estimate(gpt2_shape(w), "baseline", 1, 1024, "t4", None) for w in (1472, 1856))
    assert lo["fits"] and lo["peak_bytes"] <= lo["budget_bytes"]
    assert not hi["fits"]


def test_attention_traced_as_the_t4_runs_it(monkeypatch):
    """Twin of test_estimate_trust.py::test_attention_traced_as_the_t4_runs_it_offline on GPT-2's own config
    (the shipped one, offline) cut to 2 layers, a 1024-token vocabulary and seq 512: the T4 trace keeps no
    S x S matrix (memory-efficient kernel, dropout included), attention:math adds at least one fp32
    B x H x S x S matrix per layer; negative control: the CPU profile (dropout sends SDPA to the math
    kernel) is detected by the same margin."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = hf_from_config("gpt2").config
    cfg.n_layer, cfg.vocab_size = 2, 1024
    S = 512
    base = colabkit.estimate(cfg, "baseline", batch=1, seq=S, gpu="t4")
    math = colabkit.estimate(cfg, "attention:math", batch=1, seq=S, gpu="t4")
    matrices = cfg.n_layer * 1 * cfg.n_head * S * S * 4
    assert math["peak_bytes"] - base["peak_bytes"] >= matrices
    assert any("memory-efficient kernel" in n and "dropout 0.1" in n for n in base["notes"])
    cpu = colabkit.estimate(cfg, "baseline", batch=1, seq=S, device="cpu")
    assert cpu["peak_bytes"] - base["peak_bytes"] >= matrices

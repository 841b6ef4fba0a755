"""GPU profiles: CUDA's device name matched word for word, and the H200 profile (datasheet figures)."""
from __future__ import annotations

import pytest

from colabkit import estimate
from colabkit.env import GPU_PROFILES, profile_for


@pytest.mark.parametrize("name, key", [
    ("Tesla T4", "t4"), ("NVIDIA L4", "l4"), ("Tesla P100-PCIE-16GB", "p100"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    # a substring is not a word: an NVIDIA T400/T4000 is no T4, an L40S no L4, an H100 no H200 (and back)
    ("NVIDIA T400", None), ("NVIDIA T400 4GB", None), ("Quadro T4000", None), ("NVIDIA L40S", None),
    ("NVIDIA L40", None), ("NVIDIA GeForce RTX 3090", None)])
def test_profile_for_matches_whole_words(name, key):
    assert profile_for(name) == key


def test_h200_profile_estimates_with_its_datasheet_figures():
    """The H200 (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense): an estimate on it is judged against its own
    capacity and its step time uses its own figures -- more memory and bandwidth than an H100's, same FLOPs."""
    h200, h100 = (estimate("gpt:2x256", "bf16", batch=4, seq=128, gpu=g) for g in ("h200", "h100"))
    assert h200["budget_bytes"] == GPU_PROFILES["h200"]["capacity_bytes"] > 1.7 * h100["budget_bytes"]
    assert h200["step_time"]["dtype"] == "bf16" and "H200" in h200["step_time"]["source"]
    assert h200["step_time"]["terms"]["compute"] == pytest.approx(h100["step_time"]["terms"]["compute"])
    assert h200["step_time"]["terms"]["memory"] == pytest.approx(h100["step_time"]["terms"]["memory"] * 3350 / 4800)

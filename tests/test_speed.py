"""Predicted step time (colabkit.estimate.speed) against measured CPU steps: FLOPs and kernel bytes counted
on fake tensors over this CPU's measured matmul rate, copy bandwidth (per kernel size) and per-kernel cost of
an eager training step, against real Trainer steps timed untracked and interleaved (colabkit.timing).

Five plans of gpt:4x256 at batch 4 x seq 128 whose step times are apart, each a different kind of cost:
fewer matmuls (lora), more matmuls (checkpoint's recompute), memory-bound kernels (compress:int8's
quantize/dequantize), more and smaller kernels plus a factored optimizer (adafactor+compress:int8+accum:4).
Measured on CPU, 2 cores, torch 2.13.0+cpu (2026-11-26), five runs of 5-7 interleaved rounds, ratio to
baseline predicted / measured (median): lora:8 0.82 / 0.85-0.90, checkpoint 1.20 / 1.19-1.27, compress:int8
1.37 / 1.38-1.45, adafactor+compress:int8+accum:4 1.68 / 1.58-1.77 -- every predicted ratio within 10% of
the measured one (the test allows 25%). On a 2-core AMD EPYC (same day): lora:8 0.77 / 0.66, checkpoint
1.22 / 1.27, compress:int8 1.10 / 1.20, adafactor+compress:int8+accum:4 1.30 / 1.31 (matmuls cheaper
relative to memory there: compress:int8 costs less than checkpoint, predicted and measured). Adjacent plans differ by 14-23% in prediction and 10-27% in
measurement; the closest pair measured is lora:8 / baseline (10-18%)."""
from __future__ import annotations

import pytest
import torch

from colabkit import build_model, estimate
from colabkit.estimate.speed import count_flops, predict_step_time
from colabkit.timing import interleaved, ratio
from colabkit.trainer import Trainer

MODEL, B, S = "gpt:4x256", 4, 128
PLANS = ["lora:8", "baseline", "checkpoint", "compress:int8", "adafactor+compress:int8+accum:4"]


def _runner(model, batch, seq, plan):
    torch.manual_seed(0)
    trainer = Trainer(build_model(model, seq=seq), plan, device="cpu")
    x = torch.randint(0, 256, (batch, seq))
    return lambda: trainer.step(x, x)


def _apart(r_meas):
    """The pairs of plans the measurement tells apart (> 15%)."""
    return [(a, b) for i, a in enumerate(PLANS) for b in PLANS[i + 1:] if abs(r_meas[a] / r_meas[b] - 1) > 0.15]


def _wrong(r_pred, r_meas):
    """What a prediction gets wrong against the measurement: a plan's ratio to baseline off by more than 25%,
    or the order of a pair the measurement tells apart -- whatever the CPU (a 2-core Xeon runs checkpoint
    faster than compress:int8, a 2-core EPYC the other way round, both within 10% of each other)."""
    off = [(p, r_pred[p], r_meas[p]) for p in PLANS if abs(r_pred[p] / r_meas[p] - 1) > 0.25]
    return off + [(a, b) for a, b in _apart(r_meas) if (r_pred[a] < r_pred[b]) != (r_meas[a] < r_meas[b])]


def _check_against_measured(model, batch, seq):
    pred = {p: predict_step_time(model, p, batch, seq)["step_time_s"] for p in PLANS}
    r_pred = {p: pred[p] / pred["baseline"] for p in PLANS}
    # ratios: the median of the per-round ratios (each round runs every plan back to back: a burst of load on
    # the shared machine hits all of them)
    meas = interleaved({p: _runner(model, batch, seq, p) for p in PLANS}, warmup=1, repeats=7)
    r_meas = {p: ratio(meas, p, "baseline") for p in PLANS}
    assert len(_apart(r_meas)) >= 5, r_meas  # the plans' step times are apart: the order means something
    assert _wrong(r_pred, r_meas) == [], (r_pred, r_meas)
    return r_pred, r_meas


@pytest.mark.slow  # fast twin: test_predicted_step_times_of_a_smaller_model_rank_and_ratio_like_measured_ones
def test_predicted_step_times_rank_and_ratio_like_measured_ones():
    _check_against_measured(MODEL, B, S)


def test_predicted_step_times_of_a_smaller_model_rank_and_ratio_like_measured_ones():
    """The same five plans and the same check on gpt:2x256 at batch 4 x seq 128 (half the measured work;
    2 layers: counted whole, no depth extrapolation). Measured on CPU, 2 cores, torch 2.13.0+cpu (2026-11-26),
    predicted / measured ratio to baseline, two runs with the machine quiet: lora:8 0.76 / 0.64-0.65,
    checkpoint 1.22 / 1.25-1.28, compress:int8 1.09 / 1.20, adafactor+compress:int8+accum:4 1.27 / 1.38 (gpt:4x256
    in the same minute: 0.76 / 0.65-0.67, 1.22 / 1.27-1.29, 1.09 / 1.21, 1.29 / 1.34-1.37); three with other
    test runs on both cores: lora:8 0.76 / 0.65-0.72, checkpoint 1.22 / 1.24-1.25, compress:int8 1.11 /
    1.18-1.26, adafactor+compress:int8+accum:4 1.34 / 1.44-1.49; 7-9 of the 10 pairs apart. (At seq 64, a
    third of the work, lora:8 reached +25% with the machine quiet: too near the test's 25%.)"""
    r_pred, r_meas = _check_against_measured("gpt:2x256", 4, 128)
    # negative control: a prediction blind to checkpoint's recomputation (checkpoint = baseline) is caught:
    # the measurement tells the two apart (1.24-1.40x on this CPU at every size tried)
    blind = dict(r_pred, checkpoint=r_pred["baseline"])
    assert _wrong(blind, r_meas), (blind, r_meas)


def test_flops_follow_the_textbook_count():
    # 6 x (matmul) parameters x tokens for a step (Kaplan et al. 2020: embeddings are lookups, not matmuls);
    # attention: torch's SDPA formulas, 2 matmuls of 2*S*S*D forward and 5 in backward (scores recomputed)
    model = build_model(MODEL)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    L, D = model.config.n_layer, model.config.n_embd
    f = count_flops(MODEL, "baseline", B, S)["flops"]
    assert f == 6 * n * B * S + 14 * L * B * S * S * D
    assert count_flops(MODEL, "adamw8bit", B, S)["flops"] == f  # the optimizer changes no matmul


def test_estimate_reports_step_time_with_its_source():
    r = estimate("gpt:2x768", "fp16+checkpoint+offload:optimizer", batch=1, seq=256, gpu="t4")
    s = r["step_time"]  # offload:optimizer: 8 B/param over PCIe each step outweighs the fp16 matmuls
    t = s["terms"]  # on a GPU the launches overlap the device's work; PCIe and the host's AdamW step do not
    overlapped = max(t["launches"] + t.get("step_overhead", 0), t["compute"] + t["memory"])
    assert r["step_time_s"] == pytest.approx(overlapped + t["pcie"] + t["host_update"])
    assert r["step_time_s"] < sum(t.values()) and r["tokens_per_s"] == 256 / r["step_time_s"]
    assert s["terms"]["pcie"] > s["terms"]["compute"] and "PCIe 3.0" in s["source"] and s["uncertainty"] > 0


@pytest.mark.parametrize("plan", [
    "baseline",
    # (checkpoint's deep counts against a full trace: also test_estimate_fast.py's step-counts test, fast)
    # fast twin: test_deep_gpt_counts_are_extrapolated_exactly[baseline]
    pytest.param("checkpoint", marks=pytest.mark.slow),
    # fast twin: test_deep_gpt_counts_are_extrapolated_exactly[baseline]
    pytest.param("lora:8", marks=pytest.mark.slow)])
def test_deep_gpt_counts_are_extrapolated_exactly(plan, monkeypatch):
    """A GPT deeper than the trace's depths is counted at 2 and 3 layers and extrapolated (every block runs the
    same kernels): equal to counting the whole model, and cached per shape, not per builder (the planner makes a
    new builder per candidate: `plan` went from 48 s to seconds). Control: a count that ignores depth is off."""
    from colabkit.estimate import speed
    from colabkit.estimate.trace import gpt_builder
    from colabkit.models import gpt_config

    cfg = gpt_config("gpt:5x64", dropout=0.0)
    full = speed._count(gpt_builder(cfg), plan, 2, 32)
    ext = speed._flops(gpt_builder(cfg), plan, 2, 32)
    assert ext[:4] == full[:4]  # FLOPs, kernels, bytes, trainable parameters: exact
    # bytes by kernel size: the same total; the buckets are approximate (a kernel over all parameters, the fused
    # optimizer's, moves to a larger size bucket with depth, which changes its CPU bandwidth by a few %)
    assert sum(b for _, b in ext[4]) == sum(b for _, b in full[4])
    shallow = speed._flops(gpt_builder(gpt_config("gpt:3x64", dropout=0.0)), plan, 2, 32)  # counted for ext
    assert shallow[0] < 0.8 * full[0]
    calls = []
    monkeypatch.setattr(speed, "_count", lambda *a: calls.append(a) or full)
    speed._flops(gpt_builder(cfg), plan, 2, 32)  # a new builder of the same shape: from the cache
    assert not calls


def test_step_time_follows_each_dtypes_measured_rate(monkeypatch):
    """lora:8's frozen base runs in bf16 on a CPU: its matmuls (4 x frozen linear parameters x tokens, forward
    and the input's gradient, plus the attention's 14 x L x B x S^2 x D -- counted per dtype) go at the bf16
    rate measured on this CPU. With the measured rates patched so that bf16 is 3x slower than fp32 (an Intel
    Xeon with AVX512-BF16 ran lora:8 at 1.6x baseline), lora:8 is predicted slower than baseline, and with bf16
    3x faster, well below it. Control: a dtype-blind model (every FLOP at fp32) predicts the same either way."""
    from colabkit.estimate import speed

    model = build_model("gpt:2x256")
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    L, D, b, s = model.config.n_layer, model.config.n_embd, 4, 128
    bf16 = 4 * n * b * s + 14 * L * b * s * s * D
    counts = count_flops("gpt:2x256", "lora:8", b, s)
    assert counts["flops_bf16"] == bf16 and counts["flops_fp16"] == 0
    fp32 = speed.cpu_throughput()["fp32"]
    ratios = {}
    for factor in (1 / 3, 3):
        monkeypatch.setattr(speed, "cpu_matmul_rate", lambda d, f=factor: fp32 * (f if d == "bf16" else 1))
        lora = predict_step_time("gpt:2x256", "lora:8", b, s)
        narrow = sum(f for _, f in counts["narrow_flops"])  # the adapters' rank-8 matmuls, at their own rate
        assert lora["terms"]["compute"] == pytest.approx((counts["flops"] - bf16 - narrow) / fp32 + bf16 / (fp32 * factor)
                                                         + sum(f / speed.cpu_narrow_rate(*sh) for sh, f in counts["narrow_flops"]))
        ratios[factor] = lora["step_time_s"] / predict_step_time("gpt:2x256", "baseline", b, s)["step_time_s"]
    assert ratios[1 / 3] > 1 > 0.6 > ratios[3], ratios
    # control: every FLOP at fp32 (the model before) keeps lora:8 below baseline on the slow-bf16 CPU too
    base = predict_step_time("gpt:2x256", "baseline", b, s)["step_time_s"]
    blind = counts["flops"] / fp32 + lora["terms"]["memory"] + lora["terms"]["launches"]
    assert blind / base < 1 < ratios[1 / 3]


_SLOW_BF16 = """
import sys, time, torch
sys.path.insert(0, "tests")
torch.set_num_threads(1)

def rate(dtype, n=256):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    t = time.process_time()
    for _ in range(20):
        a @ b
    return 20 / (time.process_time() - t)

fp32, bf16 = rate(torch.float32), rate(torch.bfloat16)
assert bf16 < 0.8 * fp32, ("oneDNN capped below AVX512-BF16 should run bf16 matmuls slower than fp32", bf16 / fp32)
from test_speed import _check_against_measured
r_pred, r_meas = _check_against_measured("gpt:2x256", 4, 128)
assert r_meas["lora:8"] > 1 and r_pred["lora:8"] > 1, (r_pred, r_meas)  # on this CPU lora's bf16 base costs more
print("ok", round(bf16 / fp32, 2), r_pred, r_meas)
"""


@pytest.mark.slow  # fast twin: test_step_time_follows_each_dtypes_measured_rate
def test_predicted_step_times_hold_where_bf16_is_slower_than_fp32():
    """The Intel Xeon of issue 36, reproduced on any x86 CPU: oneDNN told to stop at AVX512 without its BF16
    extension (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, read when a process starts) runs bf16 matmuls slower than
    fp32 (0.4x on a 2-core EPYC), as that Xeon ran lora:8's bf16 base. The same five plans' predicted
    ratios against measured ones, in a process started so: lora:8 is predicted and measured above baseline and
    every ratio within the same 25% (the rates are measured in that process, nothing assumed)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE", PYTHONPATH=root, OMP_NUM_THREADS="1")
    # A second try where the first fails: the rates the prediction measures in that process and the step times
    # it is checked against are both taken on a machine the rest of the suite loads (once in 4 CI runs the load
    # moved the prediction of lora:8 from 1.72-1.78x baseline, quiet, to 1.58x, against 1.92x measured; the
    # order of lora:8 and adafactor+compress:int8+accum:4 then flipped). Both tries must fail to fail.
    tries = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _SLOW_BF16], capture_output=True, text=True, env=env, cwd=root,
                             timeout=600)
        tries.append(out.stderr[-1500:])
        if out.returncode == 0 and "ok" in out.stdout:
            return
    pytest.fail("\n---- second try ----\n".join(tries))


def test_narrow_matmuls_of_a_lora_step_take_their_predicted_time():
    """A LoRA adapter's matmuls have a side of rank 8: (B*S, D) @ (D, 8) and back. A CPU runs them several times
    below its square-matmul rate, so the step-time model times each narrow shape on this CPU
    (speed.cpu_narrow_rate). Reference: torch.profiler's self CPU time of those very calls in real lora:8
    steps (shapes recorded), within 2x of the prediction. Control: the same FLOPs at the square 256^3 rate
    (the model before) predict under half of what they take."""
    from torch.profiler import ProfilerActivity, profile

    from colabkit.estimate import speed
    from colabkit.estimate.counting import NARROW

    b, s = 4, 128
    counts = count_flops("gpt:2x256", "lora:8", b, s)
    narrow = counts["narrow_flops"]
    assert narrow and all(min(sh[:3]) <= NARROW and sh[3] == torch.float32 for sh, _ in narrow)
    assert sum(f for (m, k, n, _), f in narrow if m == b * s and n == 8) > 0  # x @ A^T: (B*S, D) @ (D, 8)
    step = _runner("gpt:2x256", b, s, "lora:8")
    step()
    steps = 3
    shapes = {tuple(sh[:3]) for sh, _ in narrow}
    # The rates (cached per process) are timed again right before the profile, and a second try is taken: both
    # figures are wall-clock on a machine the rest of the suite loads (once, with helpers running notebooks beside
    # the suite, the profile took 5x the rates timed minutes earlier). Both tries must fail to fail.
    tries = []
    for _ in range(2):
        speed.cpu_narrow_rate.cache_clear()
        predicted = sum(f / speed.cpu_narrow_rate(*sh) for sh, f in narrow)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
        measured = 0.0
        for e in prof.key_averages(group_by_input_shape=True):
            dims = [d for d in e.input_shapes if len(d) == 2]
            if e.key in ("aten::mm", "aten::addmm") and len(dims) >= 2:
                a, w = dims[-2], dims[-1]
                if (a[0], a[1], w[1]) in shapes:
                    measured += e.self_cpu_time_total / 1e6 / steps
        assert measured > 0
        tries.append((predicted, measured))
        if 0.5 < predicted / measured < 2:
            break
    assert 0.5 < predicted / measured < 2, tries
    square = sum(f for _, f in narrow) / speed.cpu_throughput()["fp32"]
    assert square < 0.5 * measured, (square, measured)


def test_t4_step_time_lora_in_half_precision_qlora_dequantizes_bandwidth_achievable():
    """On a T4 (no bf16) lora/qlora's frozen base computes in fp16 (techniques.lora.compute_dtype): their
    matmuls at the datasheet's 65 TFLOPS fp16 x 0.35 achievable, not 8.1 TFLOPS fp32 (the control: baseline
    stays at fp32); an L4 (native bf16) at its 121 TFLOPS bf16. qlora adds the NF4 dequantization of every
    quantized linear weight (GPT: 12 D^2 per block, the head excluded) in forward and backward (and the
    recomputation under checkpoint): NF4 + absmax read, fp16 written, over 320 GB/s x 0.7 (Jia et al. 2019
    measure ~220 GB/s on a T4), as the other memory-bound kernels are."""
    from colabkit.techniques.lora import nf4_bytes

    b, s, D, L = 4, 128, 256, 2
    base = estimate("gpt:2x256", "baseline", batch=b, seq=s, gpu="t4")
    assert base["step_time"]["terms"]["compute"] == pytest.approx(base["flops"] / (8.1e12 * 0.6))
    assert base["step_time"]["terms"]["memory"] == pytest.approx(base["kernel_bytes"] / (320e9 * 0.7))
    lora = estimate("gpt:2x256", "lora:8", batch=b, seq=s, gpu="t4")
    assert lora["step_time"]["dtype"] == "fp16"
    assert lora["step_time"]["terms"]["compute"] == pytest.approx(lora["flops"] / (65e12 * 0.35))
    l4 = estimate("gpt:2x256", "lora:8", batch=b, seq=s, gpu="l4")
    assert l4["step_time"]["terms"]["compute"] == pytest.approx(l4["flops"] / (121e12 * 0.4))
    q = L * 12 * D * D  # the quantized linear weights
    for plan, passes in (("qlora:8", 2), ("qlora:8+checkpoint", 3)):
        r = estimate("gpt:2x256", plan, batch=b, seq=s, gpu="t4")
        assert r["nf4_params"] == q and r["step_time"]["dtype"] == "fp16"
        assert r["step_time"]["terms"]["dequant"] == pytest.approx(passes * (nf4_bytes(q) + 2 * q) / (320e9 * 0.7))
    assert "dequant" not in lora["step_time"]["terms"]  # control: lora's 16-bit base is never dequantized

"""Calibration's fitting and storage, on the CPU, from the recorded file tests/data/calibration_t4_constructed.json
(a CONSTRUCTED example, not a GPU measurement: see its CONSTRUCTED_EXAMPLE field); and the CLI's refusal
without a GPU."""
import json
from pathlib import Path

import pytest
import torch

from colabkit.estimate import estimate
from colabkit.estimate import overheads as ov
from colabkit.estimate.calibrate import NoGPUError, calibrate, calibration_table, fit
from tests.conftest import requires_cuda

DATA = Path(__file__).parent / "data" / "calibration_t4_constructed.json"


@pytest.fixture
def recorded():
    with open(DATA) as f:
        m = json.load(f)
    assert "NOT A GPU MEASUREMENT" in m["CONSTRUCTED_EXAMPLE"]
    return m


def test_fit_is_the_measurement_arithmetic(recorded):
    p = fit(recorded)
    ratios = [s["reserved_peak"] / s["allocated_peak"] - 1 for s in recorded["steps"]]
    assert p["fragmentation"] == pytest.approx(sum(ratios) / 3, abs=1e-4)
    assert p["fragmentation_uncertainty"] == pytest.approx(max(ratios) - min(ratios), abs=1e-4)
    assert p["context_bytes"] == recorded["context_bytes"]
    assert p["capacity_bytes"] == recorded["capacity_bytes"]


def test_stored_profile_is_used_by_later_estimates(recorded, tmp_path, monkeypatch):
    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))
    uncalibrated = estimate("gpt:2x64", "baseline", batch=2, seq=32, gpu="t4")
    r = calibrate(recorded, store=True)
    stored = json.loads((tmp_path / "t4.json").read_text())
    assert r["stored"] == str(tmp_path / "t4.json") and stored == r["fitted"]
    after = estimate("gpt:2x64", "baseline", batch=2, seq=32, gpu="t4")
    assert after["overheads"]["cuda_context"] == recorded["context_bytes"]
    assert after["overheads"]["fragmentation"] == int(stored["fragmentation"] * after["peak_bytes"])
    assert after["budget_bytes"] == recorded["capacity_bytes"]
    # negative control: before storing, and with calibration=False, the assumed ladder is used
    ladder = ov.CONTEXT_LADDER["torch"][0] + ov.CONTEXT_LADDER["cublas"][0]
    assert uncalibrated["overheads"]["cuda_context"] == ladder != recorded["context_bytes"]
    off = estimate("gpt:2x64", "baseline", batch=2, seq=32, gpu="t4", calibration=False)
    assert off["overheads"]["cuda_context"] == ladder
    # the report: the error of each step before and after, as the arithmetic on the file gives it
    for row, step in zip(r["after"], recorded["steps"]):
        used = recorded["context_bytes"] + step["reserved_peak"]
        assert row["measured_used"] == used
        assert row["need_error"] == pytest.approx((row["estimate_need"] - used) / used)
    assert "profile t4" in calibration_table(r)


def test_unknown_gpu_is_refused(recorded):
    with pytest.raises(ValueError, match="no GPU profile matches"):
        calibrate(dict(recorded, gpu="NVIDIA GeForce RTX 3090"), store=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_cli_says_it_needs_a_gpu(capsys):
    from colabkit.__main__ import main

    with pytest.raises(NoGPUError, match="needs a CUDA GPU"):
        calibrate(store=False)
    # ``python -m colabkit calibrate`` is main(["calibrate"]): its exit status and stderr, in this process
    capsys.readouterr()
    assert main(["calibrate"]) == 2
    out, err = capsys.readouterr()
    assert "needs a CUDA GPU" in err and err.count("\n") == 1 and err.startswith("error: ") and out == ""


@requires_cuda
def test_measure_device_on_this_gpu(tmp_path, monkeypatch):
    from colabkit.estimate.calibrate import measure_device

    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))
    m = measure_device()
    assert m["context_bytes"] > 0 and m["capacity_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert all(s["reserved_peak"] >= s["allocated_peak"] > 0 for s in m["steps"])
    r = calibrate(m, key=None if ov_profile(m) else "t4", store=True)
    print(calibration_table(r))
    assert all(abs(row["allocated_error"]) < 0.25 for row in r["after"])  # the trace vs max_memory_allocated


def ov_profile(m):
    from colabkit.env import profile_for

    return profile_for(m["gpu"])


def test_host_terms_are_fitted_stored_and_enter_the_step_time(recorded, tmp_path, monkeypatch):
    """A launch-bound step's time is a line in its kernels (found on an H200, 2026-11-27: gpt:4x256's 160-kernel
    step took 11 ms against 1.4 ms predicted with an assumed 5 us a launch). The calibrated profile carries the
    line; later predictions on that GPU add its two terms, and uncalibrated ones do not."""
    import importlib

    from colabkit import predict_step_time

    speed_mod = importlib.import_module("colabkit.estimate.speed")
    host = [{"model": "gpt:1x32", "batch": 1, "seq": 16, "kernels": 67, "step_s": 4.0e-3},
            {"model": "gpt:3x32", "batch": 1, "seq": 16, "kernels": 129, "step_s": 6.0e-3}]
    p = fit(dict(recorded, host=host))
    launch = 2.0e-3 / 62
    assert p["speed"]["launch_s"] == pytest.approx(launch, rel=1e-6)
    assert p["speed"]["step_overhead_s"] == pytest.approx(4.0e-3 - 67 * launch, rel=1e-6)
    monkeypatch.setenv(ov.PROFILE_ENV, str(tmp_path))
    before = predict_step_time("gpt:2x64", "baseline", 2, 32, gpu="t4")
    calibrate(dict(recorded, host=host), store=True)
    after = predict_step_time("gpt:2x64", "baseline", 2, 32, gpu="t4")
    kernels = after["terms"]["launches"] / p["speed"]["launch_s"]
    assert "step_overhead" not in before["terms"] and after["terms"]["step_overhead"] == pytest.approx(
        p["speed"]["step_overhead_s"])
    assert kernels == pytest.approx(before["terms"]["launches"] / 5e-6)  # the same kernels, the measured cost each
    assert after["step_time_s"] > before["step_time_s"]
    assert "step_overhead" not in fit(recorded).get("speed", {})  # no host measurement: no host terms
    # the host's AdamW rate, measured in calibration, replaces the assumed Colab host's in offload:optimizer's step
    slow = predict_step_time("gpt:2x64", "offload:optimizer", 2, 32, gpu="t4")["terms"]["host_update"]
    calibrate(dict(recorded, host=host, host_update_bytes_per_s=4 * speed_mod.HOST_BYTES_PER_S), store=True)
    fast = predict_step_time("gpt:2x64", "offload:optimizer", 2, 32, gpu="t4")["terms"]["host_update"]
    assert fast == pytest.approx(slow / 4)


def test_host_measurement_twin_predicts_a_third_step_on_this_cpu():
    """The GPU's host measurement run on this CPU (its twin): the line through the two tiny models predicts
    a third launch-bound step, out of the fitted points and timed in the same interleaved rounds, within a
    factor of two on a shared machine."""
    import importlib

    speed = importlib.import_module("colabkit.estimate.speed")
    *pts, third = speed.measure_host("cpu", models=speed.HOST_MODELS + (("gpt:5x32", 1, 16),))
    assert [p["model"] for p in pts] == [m for m, _, _ in speed.HOST_MODELS]
    assert pts[0]["kernels"] < pts[1]["kernels"] < third["kernels"] and all(p["step_s"] > 0 for p in pts)
    line = speed.fit_host(pts)
    pred = line["step_overhead_s"] + third["kernels"] * line["launch_s"]
    assert 0.5 < third["step_s"] / pred < 2.0, (third, pred, line)


def test_host_update_rate_is_timed_in_wall_time_for_a_gpu(monkeypatch):
    """calibrate times the host's optimizer step with device="cuda": wall time, since the host's threads run in
    parallel and the CPU's process time adds them up (the H200 host's 16 threads read as a 16x slower step).
    The optimizer is the one offload:optimizer builds (torch's fused AdamW on the CPU), not a default AdamW."""
    import importlib

    speed = importlib.import_module("colabkit.estimate.speed")
    seen = []
    real = speed.time_fn

    def spy(fn, *a, device=None, **kw):
        seen.append((device, getattr(getattr(fn, "__self__", None), "defaults", {}).get("fused")))
        return real(fn, *a, **kw)  # timed here on the CPU's clock: no GPU to synchronize

    monkeypatch.setattr(speed, "time_fn", spy)
    assert speed.measure_host_update(2**10, device="cuda") > 0 and speed.measure_host_update(2**10) > 0
    assert seen == [("cuda", True), (None, True)]

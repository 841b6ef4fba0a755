"""colabkit.timing: the one way speed is measured (untracked, warmed up, interleaved)."""
import time

import torch

import colabkit
from colabkit.timing import interleaved, ratio, time_fn


def _work(n):
    a = torch.ones(64, 64)
    for _ in range(n):
        a = a @ a / 64.0
    return a


def test_interleaved_runs_warmup_then_rounds_in_turn():
    calls = []
    interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=2, repeats=3)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3  # warm-up each, then A B A B A B


def test_ratio_tracks_the_work_done():
    # twice the matmuls costs about twice the CPU time; equal work about 1x (negative control)
    t = interleaved({"x1": lambda: _work(200), "x2": lambda: _work(400), "x1b": lambda: _work(200)}, repeats=5)
    assert 1.5 < ratio(t, "x2", "x1") < 2.7
    assert 0.7 < ratio(t, "x1b", "x1") < 1.4


def test_cpu_clock_is_process_time_so_sleeping_costs_nothing():
    t = time_fn(lambda: time.sleep(0.02), warmup=0, repeats=2)
    assert t.clock == "cpu process time" and t.median < 0.01  # wall time would be >= 0.02


def test_step_times_times_untracked_trainer_steps():
    t = colabkit.step_times("gpt-tiny", ["baseline", "accum:2"], batch=2, seq=16, repeats=2, device="cpu")
    assert set(t) == {"baseline", "accum:2"}
    assert all(v.median > 0 and v.low <= v.median <= v.high for v in t.values())

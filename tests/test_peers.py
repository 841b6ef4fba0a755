"""benchmarks/peers.py (issue 25) at tiny sizes: every row runs and lands in the JSON and the table; the
state bytes it reports agree with the peers' own (bitsandbytes' AdamW8bit layout) and with theory."""
import json
import itertools
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from colabkit.models import build_model
from colabkit.techniques.optimizers import optimizer_state_bytes
from forking import fork_call
from tests.test_core import _benchmark_script  # benchmarks/peers.py as a module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_every_row(tmp_path) -> None:
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["quick"] and "torch" in data["versions"] and data["device"].startswith("CPU")
    rows = {r["what"]: r for r in data["rows"]}
    assert {r["kind"] for r in data["rows"]} == {"cli", "estimate", "optimizer", "disk", "tracker"}
    assert all(r["exit_code"] == 0 for r in data["rows"] if r["kind"] == "cli")
    for r in data["rows"]:  # every timing positive, every ratio a finite positive number
        assert all(t["median_s"] > 0 and t["low_s"] <= t["median_s"] <= t["high_s"] for t in r["timings"].values())
        assert all(math.isfinite(x) and x > 0 for x in r["ratios"].values()), r["what"]
    a8 = rows["adamw8bit"]
    # colabkit's AdamW8bit keeps bitsandbytes' state bytes (bnb adds two 256-entry quantization maps: 2 KiB)
    assert abs(a8["state_bytes"]["adamw8bit"] - a8["state_bytes"]["bitsandbytes AdamW8bit"]) <= 2048 + 8
    fused = rows["adamw"]["state_bytes"]["torch fused AdamW"]
    assert rows["adamw"]["state_bytes"]["adamw"] == fused  # the token is torch's AdamW: the same state
    assert 8 * rows["adamw"]["params"] <= fused <= 8 * rows["adamw"]["params"] + 4 * 200  # + a 4-byte step per tensor
    model = build_model(data["sizes"]["opt_model"], seq=data["sizes"]["opt_seq"])
    theory, n_tensors = optimizer_state_bytes(model, "adamw8bit"), len(list(model.parameters()))
    # + per tensor: a 4-byte step, and each absmax count rounded up to whole blocks (2 moments x 4 bytes)
    assert theory <= a8["state_bytes"]["adamw8bit"] <= theory + 12 * n_tensors, (theory, a8["state_bytes"])
    md = (tmp_path / "peers.md").read_text()
    assert "| what | colabkit | peer |" in md and "quick mode" in md
    for name in ("adamw4bit", "adamw8bit", "adam-mini", "galore:32", "offload:disk", "MemoryTracker"):
        assert name in md, name


def _forked_cli(calls: list):
    """A stand-in for peers.py's ``subprocess.run`` of ``python -m colabkit <args>``: the launch it asks for is
    recorded, and the command runs as ``main(args)`` in a forked child of this process (imports already
    paid): a child process whose exit status and CPU time (RUSAGE_CHILDREN) the row records, stdout through a
    pipe."""
    from colabkit.__main__ import main

    def run(cmd, capture_output, text, env, cwd):
        calls.append((cmd, env, cwd))
        assert cmd[:3] == [sys.executable, "-m", "colabkit"] and capture_output and text
        done = fork_call(main, cmd[3:])
        return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, "")
    return run


def test_estimate_row_traces_every_call(tmp_path, monkeypatch):
    """The in-process estimate row times a new question: every call traces (another sequence each call, and
    the trace cache on disk switched off, which a user's machine has on). Control: with the row's own switch-off undone, calls after the
    first are answered from the disk."""
    import importlib

    peers = _benchmark_script("peers")
    trace_mod = importlib.import_module("colabkit.estimate.trace")
    cfg = peers.SIZES["quick"]
    monkeypatch.setenv("COLABKIT_TRACE_CACHE", str(tmp_path))
    calls = []
    real = trace_mod.trace
    monkeypatch.setattr(trace_mod, "trace", lambda *a, **k: calls.append(a[3]) or real(*a, **k))  # (its seq)
    peers.estimate_row(cfg)
    per_call = len(calls) // (1 + cfg["est_repeats"])
    assert per_call >= 1 and len(calls) == per_call * (1 + cfg["est_repeats"])
    assert len(set(calls)) == 1 + cfg["est_repeats"]  # another sequence length each call: nothing seen before
    assert os.environ["COLABKIT_TRACE_CACHE"] == str(tmp_path)  # restored after the row
    calls.clear()
    # control: the same question every call, with the row's switch-off undone: the disk cache answers
    monkeypatch.setattr(peers, "TRACE_ENV", "COLABKIT_NOT_THE_SWITCH")
    monkeypatch.setattr(peers, "questions", lambda seq: itertools.repeat(seq))
    peers.estimate_row(cfg)
    assert len(calls) < per_call * (1 + cfg["est_repeats"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the CLI row's child is forked")
def test_peers_quick_rows_in_process(tmp_path, monkeypatch, capsys):
    """Fast twin of test_peers_quick_runs_every_row: ``peers.py --quick`` through its ``main(argv)`` in this process,
    every row at the quick sizes, the same assertions on the same JSON and table; the CLI row's ``python -m colabkit``
    child forked from this process (see _forked_cli) instead of a fresh interpreter, its launch (interpreter,
    one thread, this checkout first on the path) checked. Negative control: a CLI row whose command fails is
    refused by the same assertions."""
    peers = _benchmark_script("peers")
    calls = []
    monkeypatch.setattr(peers, "subprocess", types.SimpleNamespace(run=_forked_cli(calls)))  # peers' name only
    threads = torch.get_num_threads()
    try:
        assert peers.main(["--quick", "--out", str(tmp_path / "peers")]) == 0
    finally:
        torch.set_num_threads(threads)  # run() sets one thread for its timings
    assert "| what | colabkit | peer |" in capsys.readouterr().out  # the table, printed
    (args,) = dict(peers.SIZES["quick"]["cli"]).values()
    assert len(calls) == 1 + peers.SIZES["quick"]["cli_repeats"]  # a warm-up run, then the timed ones
    for cmd, env, cwd in calls:
        assert cmd == [sys.executable, "-m", "colabkit", *args] and cwd == peers.ROOT == ROOT
        assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    _check_every_row(tmp_path)
    # negative control: the CLI row of a command that exits 2 (an unknown plan token) fails the same checks
    data = json.loads((tmp_path / "peers.json").read_text())
    calls.clear()
    monkeypatch.setitem(peers.SIZES["quick"], "cli", [("estimate", [*args, "--plan", "no-such-token"])])
    data["rows"] = [r for r in data["rows"] if r["kind"] != "cli"] + peers.cli_rows(peers.SIZES["quick"])
    assert [r["exit_code"] for r in data["rows"] if r["kind"] == "cli"] == [2]
    (tmp_path / "peers.json").write_text(json.dumps(data))
    with pytest.raises(AssertionError):
        _check_every_row(tmp_path)


@pytest.mark.slow  # fast twin: test_peers_quick_rows_in_process
def test_peers_quick_runs_every_row(tmp_path):
    out = tmp_path / "peers"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_every_row(tmp_path)

"""``python -m colabkit selftest`` on a CPU: the CPU twin of every GPU check, one JSON document on stdout saying
``"simulated": true``, each check with its result (CUDA-only ones skipped, never passed), the report files
written; a failing check (an ordering statement of offload deleted: a copy read before it landed) exits 1."""
from __future__ import annotations

import json
import os
import importlib
import subprocess
import sys

import pytest
import torch

from colabkit import device as dev

st = importlib.import_module("colabkit.selftest")  # the module (colabkit.selftest is the function)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_simulated_report(out: str, tmp_path) -> None:
    r = json.loads(out)  # stdout holds the JSON only
    assert r["simulated"] is True and r["ok"] is True
    status = {c["name"]: c["status"] for c in r["checks"]}
    assert list(status) == list(st.CHECKS)
    cuda_only = {"paged-adamw8bit", "peak vs estimate: paged-adamw8bit", "calibrate"}
    assert {n for n, s in status.items() if s == "skipped"} == cuda_only
    assert all(s == "pass" for n, s in status.items() if n not in cuda_only)
    skipped = [c for c in r["checks"] if c["status"] == "skipped"]
    assert all(c["detail"].startswith("skipped: needs CUDA") for c in skipped)
    for c in r["checks"]:
        if c["name"].startswith("peak vs estimate") and c["status"] == "pass":
            assert abs(c["predicted_bytes"] - c["measured_bytes"]) / c["measured_bytes"] == pytest.approx(
                abs(c["estimate_error"]), abs=1e-4)
    assert {"torch", "bitsandbytes", "transformers", "peft"} <= set(r["versions"])
    saved = json.loads((tmp_path / "selftest.json").read_text())
    assert saved["checks"] == r["checks"]
    md = (tmp_path / "selftest.md").read_text()
    assert "simulated" in md and all(f"| {n} | {s} |" in md for n, s in status.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU twin: on a GPU the checks run for real")
def test_selftest_on_cpu_is_the_simulated_twin_in_process(tmp_path, monkeypatch, capfd):
    """Fast twin of test_cli_selftest_on_cpu_is_the_simulated_twin: ``python -m colabkit selftest --json - --out DIR``
    is ``main([...])``, run here with the same arguments from the same folder; capfd holds what reached the
    process's stdout (file descriptor 1 included), which must be the JSON document only. Negative control:
    a report with a failing check is refused by the same assertions."""
    from colabkit.__main__ import main

    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert main(["selftest", "--json", "-", "--out", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert "please attach them to your issue" in err  # colabkit's message went to stderr, not into the JSON
    _check_simulated_report(out, tmp_path)
    broken = json.loads(out)  # negative control: one check failed -> ok False, and the assertions say so
    broken["checks"][0]["status"], broken["ok"] = "fail", False
    with pytest.raises(AssertionError):
        _check_simulated_report(json.dumps(broken), tmp_path)


@pytest.mark.slow  # fast twin: test_selftest_on_cpu_is_the_simulated_twin_in_process
def test_cli_selftest_on_cpu_is_the_simulated_twin(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "colabkit", "selftest", "--json", "-", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _check_simulated_report(p.stdout, tmp_path)


def test_a_failing_check_exits_1(tmp_path, monkeypatch):
    from colabkit.__main__ import main

    # inject a failure: the compute stream no longer waits for the side stream's event (a missing wait_event)
    monkeypatch.setattr(dev.DevicePair, "use", lambda self, event: None)
    out = tmp_path / "r.json"
    assert main(["selftest", "--check", "offload:params", "--json", str(out), "--out", str(tmp_path)]) == 1
    r = json.loads(out.read_text())
    (c,) = r["checks"]
    assert c["status"] == "fail" and r["ok"] is False and "max |diff| nan" in c["detail"]  # read before it landed
    monkeypatch.undo()  # the negative control: the same check on the real code passes
    assert main(["selftest", "--check", "offload:params", "--json", str(out), "--out", str(tmp_path)]) == 0


def test_a_crashing_check_is_a_failure_and_the_rest_run():
    def boom(dev, size):
        raise RuntimeError("CUDA error: an illegal memory access")

    rows = st.run_checks([boom, st.CHECKS["fp16 + GradScaler"]], "cpu", st.SIZES["smoke"])
    assert [r["status"] for r in rows] == ["fail", "pass"] and "illegal memory access" in rows[0]["detail"]


def test_unknown_check_is_a_one_line_error(capsys):
    from colabkit.__main__ import main

    assert main(["selftest", "--check", "offload:everything"]) == 2
    assert "error: unknown check(s) offload:everything" in capsys.readouterr().err

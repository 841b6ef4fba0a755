"""``python -m colabkit selftest`` on a CPU: the CPU twin of every GPU check, one JSON document on stdout saying
``"simulated": true``, each check with its reference answer and its result (CUDA-only ones skipped, never passed),
the report files written; a failing check (an ordering statement of offload deleted: a copy read before it landed;
a technique's update scaled by 1.01: a wrong answer) exits 1. The whole CPU selftest runs once for this module
(the ``cpu_report`` fixture)."""
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
checks = importlib.import_module("colabkit.selftest_checks")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_ONLY = {"paged-adamw8bit", "peak vs estimate: paged-adamw8bit", "calibrate", "attention:efficient",
             "attention:efficient + checkpoint", "attention:flash", "attention:flash + checkpoint"}
# what issue 34 asks the selftest to add, each a check with a reference answer
NEW_CHECKS = ["fp16 + offload:optimizer (overflow injected)", "offload:disk", "accum:2 + offload:optimizer", "chunked-ce",
              "fused-step", "fused-step + adamw8bit", "offload:params + adamw8bit", "adamw4bit", "adamw8bit: bitsandbytes vs colabkit kernel", "attention:math",
              "attention:math + checkpoint", "attention:efficient", "attention:efficient + checkpoint", "attention:flash",
              "attention:flash + checkpoint", "HF Trainer + qlora:4", "--deterministic", "step time vs prediction"]


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """``python -m colabkit selftest --json FILE --out DIR`` in process, once for the module: (exit code, the
    JSON report, DIR)."""
    from colabkit.__main__ import main

    out = tmp_path_factory.mktemp("selftest")
    rc = main(["selftest", "--json", str(out / "report.json"), "--out", str(out)])
    return rc, json.loads((out / "report.json").read_text()), out


def _check_simulated_report(out: str, tmp_path) -> None:
    r = json.loads(out)  # stdout holds the JSON only
    assert r["simulated"] is True and r["ok"] is True
    status = {c["name"]: c["status"] for c in r["checks"]}
    assert list(status) == list(st.CHECKS)
    cuda_only = CUDA_ONLY
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
def test_selftest_on_cpu_is_the_simulated_twin_in_process(cpu_report, tmp_path, monkeypatch, capfd):
    """Fast twin of test_cli_selftest_on_cpu_is_the_simulated_twin: the report of ``python -m colabkit selftest``
    (``main([...])`` in process, the module's run) holds the simulated twin of every check; and ``--json -``
    puts the JSON document alone on the process's stdout (capfd: file descriptor 1 included; one cheap check).
    Negative control: a report with a failing check is refused by the same assertions."""
    from colabkit.__main__ import main

    rc, report, out = cpu_report
    assert rc == 0
    _check_simulated_report(json.dumps(report), out)
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert main(["selftest", "--check", "fused-step", "--json", "-", "--out", str(tmp_path)]) == 0
    stdout, err = capfd.readouterr()
    assert "please attach them to your issue" in err  # colabkit's message went to stderr, not into the JSON
    assert [c["name"] for c in json.loads(stdout)["checks"]] == ["fused-step"]
    broken = json.loads(json.dumps(report))  # negative control: one check failed -> ok False, and the assertions say so
    broken["checks"][0]["status"], broken["ok"] = "fail", False
    with pytest.raises(AssertionError):
        _check_simulated_report(json.dumps(broken), out)


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


# ----- issue 34: the new checks, each against a reference answer ---------------------------------------------
def _check_new_checks_listed(report: dict) -> None:
    rows = {c["name"]: c for c in report["checks"]}
    assert report["simulated"] is True and set(NEW_CHECKS) <= set(rows)
    for name in NEW_CHECKS:
        c = rows[name]
        assert c["status"] in ("pass", "skipped"), (name, c["detail"])
        assert c["status"] == "skipped" or c["reference"], name  # what it was held against, said
        assert c["status"] != "skipped" or c["detail"].startswith("skipped: "), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU twin: on a GPU the checks run for real")
def test_selftest_json_lists_the_new_checks_with_reference_and_status(cpu_report):
    """``selftest --json`` on a CPU lists every check issue 34 adds, each with its reference answer and status;
    only the CUDA-only attention backends are skipped here, with the reason. Negative control: a report
    whose check lost its reference, or that lacks one of the new checks, is refused."""
    rc, report, _ = cpu_report
    assert rc == 0
    _check_new_checks_listed(report)
    rows = {c["name"]: c for c in report["checks"]}
    assert {n for n in NEW_CHECKS if rows[n]["status"] == "skipped"} == {n for n in NEW_CHECKS if n in CUDA_ONLY}
    assert "halved each step: True" in rows["fp16 + offload:optimizer (overflow injected)"]["detail"]
    assert "pinned host peak" in rows["accum:2 + offload:optimizer"]["detail"]
    for mutate in (lambda r: r["checks"][-1].pop("reference"), lambda r: r["checks"].pop()):
        bad = json.loads(json.dumps(report))
        mutate(bad)
        with pytest.raises((AssertionError, KeyError)):
            _check_new_checks_listed(bad)


def test_an_update_off_by_1_percent_fails_its_check(tmp_path, monkeypatch):
    """A technique whose update is 1.01 times the right one (offload:disk's AdamW step, monkeypatched) makes
    selftest exit 1 with that check failed on the number: a wrong answer, not a crash. Negative control:
    unpatched, the same check passes and selftest exits 0."""
    from colabkit.__main__ import main
    from colabkit.techniques import disk_offload

    step = disk_offload.DiskAdamW.step

    def off_by_1_percent(self, *a, **kw):
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        loss = step(self, *a, **kw)
        with torch.no_grad():
            for p, b in zip(params, before):
                p.add_((p - b) * 0.01)  # Δw -> 1.01 Δw
        return loss
    out = tmp_path / "r.json"
    argv = ["selftest", "--check", "offload:disk", "--json", str(out), "--out", str(tmp_path)]
    monkeypatch.setattr(disk_offload.DiskAdamW, "step", off_by_1_percent)
    assert main(argv) == 1
    r = json.loads(out.read_text())
    (c,) = r["checks"]
    assert c["status"] == "fail" and r["ok"] is False and "traceback" not in c  # failed on the number
    import re
    diff = float(re.match(r"update vs reference: rel\. diff (\S+) ", c["detail"])[1])
    assert diff > checks.UPDATE_TOL  # the update is off (1% per step, more once the next gradients follow)
    monkeypatch.undo()  # the negative control
    assert main(argv) == 0
    assert json.loads(out.read_text())["checks"][0]["status"] == "pass"


def test_without_bitsandbytes_its_checks_say_skipped_and_notebook_09_passes(monkeypatch):
    """bitsandbytes absent (find_spec says so): its checks are "skipped" with the reason, the report stays ok,
    and notebook 09's selftest cell (run here on that report, as on a GPU) passes. Negative control: the
    same cell fails on a GPU report where a CUDA path was skipped, and on one with a failed check."""
    import types

    real = checks.importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    monkeypatch.setattr(st, "env", lambda: {"platform": "test", "profile": None})
    r = st.selftest("cpu", checks=["adamw8bit: bitsandbytes vs colabkit kernel", "HF Trainer + qlora:4"])
    assert [c["status"] for c in r["checks"]] == ["skipped", "skipped"] and r["ok"] is True
    assert all("bitsandbytes is not installed" in c["detail"] for c in r["checks"][:2])

    with open(os.path.join(ROOT, "notebooks", "09_will_it_fit.ipynb")) as f:  # plain JSON: nbformat's validation is slow
        cells = ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    (cell,) = [c for c in cells if "colabkit.selftest(" in c]

    display = types.ModuleType("IPython.display")  # the cell's display calls: no IPython needed to run it here
    display.Markdown, display.display = str, lambda *a: None
    monkeypatch.setitem(sys.modules, "IPython.display", display)

    def run_cell(report: dict) -> None:
        report = {**report, "simulated": False, "device": "a GPU"}
        ck = types.SimpleNamespace(selftest=lambda **kw: report, write_selftest=lambda rep, d: ("a.md", "a.json"),
                                   selftest_markdown=lambda rep: "")
        exec(compile(cell, "09_will_it_fit.ipynb", "exec"),
             {"colabkit": ck, "SMOKE": True, "IN_COLAB": False, "DEVICE": "cuda"})

    with_errors = {**r, "checks": r["checks"] + [{"name": "e", "status": "pass", "detail": "", "estimate_error": 0.01}]}
    run_cell(with_errors)  # a GPU without bitsandbytes: passes
    cuda_skip = {"name": "paged-adamw8bit", "status": "skipped", "detail": "skipped: needs CUDA (x)"}
    for bad in ({**with_errors, "checks": with_errors["checks"] + [cuda_skip]},
                {**with_errors, "checks": with_errors["checks"] + [{**cuda_skip, "status": "fail", "detail": "x"}]}):
        with pytest.raises(AssertionError):
            run_cell(bad)


# ----- the seam's selftest verbs: on CUDA they make the intended torch.cuda calls --------------------------
def test_widened_races_sleep_on_the_side_stream_and_sync_debug_sets_and_restores(monkeypatch):
    """With ``torch.cuda`` replaced by a recording stand-in (the twin as runtime, the pair told it is on CUDA):
    inside ``widened_races`` each entry to the side stream first sleeps there; ``sync_debug("error")`` sets
    the mode for the block and restores it. Negative control: outside the blocks nothing is recorded."""
    calls = []
    pair = dev.DevicePair("cpu", runtime=dev.CudaTwin())
    pair.cuda = True
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: calls.append(("sleep", n, pair.rt.current_stream() is pair.stream)))
    mode = ["warn"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: (mode.__setitem__(0, m), calls.append(("mode", m))))
    with pair.side():
        pass
    assert calls == []  # negative control
    with pair.widened_races(123):
        with pair.side():
            assert calls == [("sleep", 123, True)]
        with pair.side():
            pass
    with pair.side():
        pass
    assert calls == [("sleep", 123, True)] * 2
    calls.clear()
    with pair.sync_debug("error"):
        assert mode == ["error"]
    assert calls == [("mode", "error"), ("mode", "warn")] and mode == ["warn"]


SELFTEST_SEAM = ("torch.cuda._sleep", "torch.cuda.set_sync_debug_mode")


def _selftest_seam_calls(source: str) -> list[str]:
    import io
    import tokenize
    code = "".join(tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                   if tok.type not in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE))
    return [c for c in SELFTEST_SEAM if c in code]


def test_race_widening_and_sync_debug_calls_only_in_device_py():
    import pathlib
    root = pathlib.Path(dev.__file__).parents[1]  # the whole colabkit package
    found = {p.relative_to(root).as_posix(): calls for p in sorted(root.rglob("*.py")) if (calls := _selftest_seam_calls(p.read_text()))}
    assert found == {"device/pair.py": list(SELFTEST_SEAM)}, found
    assert _selftest_seam_calls("torch . cuda._sleep(5)\n") == ["torch.cuda._sleep"]  # negative control
    assert _selftest_seam_calls("# torch.cuda._sleep(5)\nx = 'torch.cuda.set_sync_debug_mode'\n") == []


def test_the_no_sync_paths_run_under_sync_debug(monkeypatch):
    """adamw4bit's step and fused-step's per-parameter steps (inside backward) run under the seam's
    ``sync_debug("error")``: a stand-in that raises, as CUDA's "error" mode raises on a sync, fails exactly
    those checks. Negative control: plain fused-step (AdamW, no promise made) does not enter it."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def strict(self, mode="error"):
        entered.append(mode)
        raise RuntimeError("called a synchronizing CUDA operation")
        yield
    monkeypatch.setattr(dev.DevicePair, "sync_debug", strict)
    names = ["adamw4bit", "fused-step + adamw8bit", "fused-step"]
    rows = st.run_checks([st.CHECKS[n] for n in names], "cpu", st.SIZES["smoke"])
    assert [r["status"] for r in rows] == ["fail", "fail", "pass"], [r["detail"] for r in rows]
    assert all("synchronizing" in r["detail"] for r in rows[:2]) and set(entered) == {"error"}


def test_the_offload_checks_widen_the_race_windows(monkeypatch):
    """fp16 and accumulation with offload run their steps inside the seam's ``widened_races`` (on CUDA the side
    stream sleeps before each copy). Negative control: offload:disk's check (no side-stream race) does not."""
    import contextlib

    pairs = []

    @contextlib.contextmanager
    def recording(self, cycles=0):
        pairs.append(self)
        yield
    monkeypatch.setattr(dev.DevicePair, "widened_races", recording)
    rows = st.run_checks([st.CHECKS["accum:2 + offload:optimizer"]], "cpu", st.SIZES["smoke"])
    assert rows[0]["status"] == "pass" and len(pairs) == 1 and pairs[0].stats()["copies"] > 0  # the pair that copied
    pairs.clear()
    assert st.run_checks([st.CHECKS["offload:disk"]], "cpu", st.SIZES["smoke"])[0]["status"] == "pass" and pairs == []


def test_update_tolerance_follows_the_measured_noise_floor(monkeypatch):
    """The same step computed in another order (each batch's rows reversed) moves Adam's update by the
    device's rounding noise: tiny on a CPU, 1-3e-2 on an H200 (2026-11-27), where math against fused
    attention, chunked cross-entropy and deterministic algorithms all failed a CPU-sized tolerance. A check
    allows FLOOR_FACTOR times that floor, never less than UPDATE_TOL."""
    cpu, size = torch.device("cpu"), st.SIZES["smoke"]
    monkeypatch.setattr(checks, "_FLOORS", {})
    ref = checks._trained("baseline", cpu, size)
    rev = checks._trained("baseline", cpu, size, reversed_rows=True)
    assert checks.loss_diff(rev, ref) <= checks.LOSS_TOL  # the same mathematics: the same losses
    floor = checks.noise_floor("baseline", cpu, size, ref)
    assert floor == checks.update_diff(rev, ref) and floor < checks.UPDATE_TOL  # on a CPU: below the constant
    assert checks.update_tol("baseline", cpu, size, ref) == (checks.UPDATE_TOL, floor)
    (key,) = checks._FLOORS
    checks._FLOORS[key] = 1e-2  # a floor as the H200 showed: the tolerance follows it
    assert checks.update_tol("baseline", cpu, size, ref) == (checks.FLOOR_FACTOR * 1e-2, 1e-2)
    # negative control: without reversal the "floor" would be zero (the run repeats itself bit for bit)
    assert checks.update_diff(checks._trained("baseline", cpu, size), ref) == 0.0


def test_gradient_path_checks_step_with_sgd_and_catch_a_wrong_gradient(monkeypatch):
    """chunked-ce's check compares both runs under SGD (update = lr * gradient), where rounding stays rounding: the
    reversed-rows floor is ~1e-6 here. A head gradient 5% too large must fail it; unpatched, it passes."""
    from colabkit.techniques import chunked_ce

    size = st.SIZES["smoke"]
    monkeypatch.setattr(checks, "_FLOORS", {})
    r = checks.CHECKS["chunked-ce"](torch.device("cpu"), size)
    assert r["ok"] and "both with SGD" in r["reference"], r
    assert [k[0] for k in checks._FLOORS] == ["sgd"]  # the reference really trained with SGD (its floor's key)
    backward = chunked_ce.ChunkedCrossEntropy.backward

    def five_percent_off(ctx, *grads):
        gh, gw, *rest = backward(ctx, *grads)
        return (gh, gw * 1.05 if gw is not None else None, *rest)

    monkeypatch.setattr(chunked_ce.ChunkedCrossEntropy, "backward", staticmethod(five_percent_off))
    bad = checks.CHECKS["chunked-ce"](torch.device("cpu"), size)
    assert not bad["ok"], bad

"""Memory logging: the TensorBoard event file read back equals the run's own record; CSV likewise;
W&B offline unless logged in; clear errors for a missing package or an unknown backend."""
import csv
import glob
import importlib.util
import os
import sys
import types

import pytest

import colabkit
from colabkit.logs import make_loggers


def _steps_max(timeline, key):
    out = {}
    for s in timeline:
        if s["phase"] != "setup" and s["phase"] != "end":
            out[s["step"] + 1] = max(out.get(s["step"] + 1, 0), key(s))
    return out


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None and not os.environ.get("CI"),
                    reason="tensorboard not installed (pip install -e '.[dev]')")
def test_tensorboard_scalars_equal_the_runs_record(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = colabkit.train("gpt:2x64", steps=20, batch=4, seq=32, progress=False, log="tensorboard", log_dir=str(tmp_path))
    files = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert len(files) == 1
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    peaks = {e.step: e.value for e in ea.Scalars("memory/step_peak_bytes")}
    assert sorted(peaks) == list(range(1, 21))
    assert max(peaks.values()) == out["report"]["peak_bytes"]        # the run's measured peak, to the byte
    assert peaks == _steps_max(out["timeline"], lambda s: s["phase_peak"])
    acts = {e.step: e.value for e in ea.Scalars("memory/activations_bytes")}   # at the phase boundaries
    assert acts == _steps_max(out["timeline"], lambda s: s["categories"]["activations"])
    assert max(acts.values()) <= out["report"]["breakdown"]["activations"]     # the own peak can fall inside a phase
    losses = [e.value for e in ea.Scalars("loss")]
    assert losses == pytest.approx(out["losses"], rel=1e-6)           # stored as float32
    assert losses != pytest.approx(out["losses"][::-1], rel=1e-6)     # (order matters: the check can fail)


def test_csv_rows_equal_the_record(tmp_path):
    out = colabkit.train("gpt:2x64", steps=4, batch=4, seq=32, progress=False, log=["csv"], log_dir=str(tmp_path))
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["loss"]) for r in rows] == out["losses"]
    assert max(float(r["memory/step_peak_bytes"]) for r in rows) == out["report"]["peak_bytes"]
    assert float(rows[0]["memory/params_bytes"]) == out["report"]["breakdown"]["params"]


def test_wandb_offline_unless_logged_in(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append((step, metrics))

        def finish(self):
            calls.append("finish")

    def login(prompt=True, verify=False):   # wandb's signature: with prompt=False, False when no key is stored
        assert prompt is False and verify is False   # never an interactive prompt or a server round trip
        return False

    fake = types.SimpleNamespace(login=login, init=lambda **kw: calls.append(("init", kw["mode"])) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else None)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    lg = make_loggers("wandb", str(tmp_path))[0]
    assert lg.mode == "offline" and calls[0] == ("init", "offline")
    lg.write(3, {"loss": 1.0}); lg.close()
    assert calls[1:] == [(3, {"loss": 1.0}), "finish"]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert make_loggers("wandb", str(tmp_path))[0].mode == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    fake.login = lambda prompt=True, verify=False: True      # `wandb login` done earlier (.netrc)
    assert make_loggers("wandb", str(tmp_path))[0].mode == "online"


def test_missing_package_and_unknown_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_loggers("tensorboard", str(tmp_path))
    with pytest.raises(ValueError, match="unknown log backend"):
        make_loggers("mlflow", str(tmp_path))


def test_a_failing_backend_closes_the_ones_already_opened(tmp_path, monkeypatch):
    import colabkit.logs as logs

    opened = []
    real = logs.CSVLogger

    class Spy(real):
        def __init__(self, directory):
            super().__init__(directory)
            opened.append(self)
    monkeypatch.setitem(logs._MAKERS, "csv", Spy)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)   # tensorboard "not installed"
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_loggers("csv,tensorboard", str(tmp_path))
    assert len(opened) == 1 and opened[0]._f.closed
    ok = make_loggers("csv, CSV", str(tmp_path))        # control: alone it stays open, and only once
    assert len(ok) == 1 and not ok[0]._f.closed
    ok[0].close()
    with pytest.raises(ValueError, match="--log-dir"):
        make_loggers("csv", str(tmp_path / "metrics.csv" / "sub"))   # a folder inside a file


def test_a_run_without_tracker_says_memory_is_not_logged(tmp_path):
    with pytest.warns(UserWarning, match="no memory figures"):
        colabkit.train("gpt:2x64", steps=2, batch=2, seq=16, progress=False, track=False, log="csv", log_dir=str(tmp_path))
    assert list(csv.DictReader(open(tmp_path / "metrics.csv")))[0].keys() == {"step", "loss", "step_time_s"}
    import warnings

    with warnings.catch_warnings():                   # control: with the tracker, memory is logged, no warning
        warnings.simplefilter("error")
        colabkit.train("gpt:2x64", steps=1, batch=2, seq=16, progress=False, log="csv", log_dir=str(tmp_path))
    assert "memory/step_peak_bytes" in list(csv.DictReader(open(tmp_path / "metrics.csv")))[0]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None and not os.environ.get("CI"),
                    reason="tensorboard not installed (pip install -e '.[dev]')")
def test_a_second_tensorboard_run_in_the_same_folder_warns(tmp_path):
    """Re-running a cell with the same log_dir puts two event files in one TensorBoard run (their steps mix;
    notebook 01's read-back failed that way): say so."""
    import warnings

    with warnings.catch_warnings():                   # control: the first run in a fresh folder is silent
        warnings.simplefilter("error")
        make_loggers("tensorboard", str(tmp_path))[0].close()
    with pytest.warns(UserWarning, match="fresh log_dir per run"):
        make_loggers("tensorboard", str(tmp_path))[0].close()


def test_resumed_run_continues_its_csv_and_a_refused_plan_leaves_no_logs(tmp_path):
    kw = dict(batch=2, seq=16, seed=1, progress=False, log="csv", log_dir=str(tmp_path / "logs"),
              checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    colabkit.train("gpt:2x64", steps=3, **kw)            # rows 1-3 written, checkpoint at step 2 (and 3 at the end)
    colabkit.train("gpt:2x64", steps=5, resume=True, **kw)
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    with pytest.raises(colabkit.PlanError):
        colabkit.train("gpt:2x64", plan="adamw+sgd", steps=1, batch=2, seq=16, progress=False, log="csv",
                       log_dir=str(tmp_path / "refused"))
    assert not (tmp_path / "refused" / "metrics.csv").exists()

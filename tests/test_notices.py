"""colabkit's warnings reach a user who set nothing up (Python's default filters, as in a script or a notebook),
pointing at the user's own line. Until 2026-11-27 the memory alerts were ResourceWarnings, which Python hides by
default: a run past 90% of its budget said nothing outside pytest."""
from __future__ import annotations

import os
import warnings

import colabkit
from colabkit import alerts, memory, notices
from tests.test_cli import _python_default_warning_filters


def _shown(**kw) -> list[warnings.WarningMessage]:
    """The warnings a fresh ``python`` would print for a tiny run over a 1 MB budget (its weights alone are ~0.5 MB)."""
    with warnings.catch_warnings(record=True) as shown:
        _python_default_warning_filters()
        colabkit.train("gpt-tiny", steps=1, batch=2, seq=16, device="cpu", budget_bytes=1_000_000, progress=False)
    return [w for w in shown if "of the budget" in str(w.message)]


def test_memory_alerts_are_shown_by_default_at_the_users_line(monkeypatch):
    """One warning for the event -- what the tracker recorded when memory crossed the line, and the planner's
    answer -- as MemoryAlert (a ColabkitWarning, a UserWarning), attributed to this file's train() call. (Until
    2026-11-27 the tracker and the end-of-step check each warned, with different figures.) Controls: warnings.warn's
    own stacklevel names colabkit's source, and the old ResourceWarning category is not shown at all."""
    shown = _shown()
    assert len(shown) == 1, [str(w.message) for w in shown]
    w = shown[0]
    assert w.category is colabkit.MemoryAlert and w.filename == __file__
    assert "memory reached" in str(w.message) and "planner" in str(w.message)
    assert issubclass(colabkit.MemoryAlert, UserWarning)
    monkeypatch.setattr(notices, "stacklevel", lambda: 2)
    assert {os.path.basename(w.filename) for w in _shown()} == {"alerts.py"}
    old = lambda msg, category: warnings.warn(msg, ResourceWarning, stacklevel=2)  # noqa: E731
    monkeypatch.setattr(memory, "warn", old)
    monkeypatch.setattr(alerts, "warn", old)
    assert _shown() == []


def test_only_colabkit_categories_go_through_warn():
    """A warning of another category would dodge colabkit's filters (the CLI's, a user's): refused."""
    try:
        notices.warn("x", RuntimeWarning)
    except TypeError as e:
        assert "ColabkitWarning" in str(e)
    else:
        raise AssertionError("warn() took a RuntimeWarning")


def test_a_cpu_run_is_advised_what_a_cpu_takes_and_the_own_model_where_to_ask():
    """On a CPU the advice keeps what a CPU run accepts (it refuses offload and attention:efficient; its allocator
    has no CUDA setting) -- each remedy left is accepted by Plan.check there, each dropped one refused; the
    alert says the share of the budget reached. A run of the user's own module is told where the planner answers
    for it, not "no plan fits" (the planner was never asked)."""
    import re

    import torch

    from colabkit import Context, Plan, PlanError
    from colabkit.memory import ADVICE, advice

    cpu = torch.device("cpu")
    for cat, remedies in ADVICE.items():
        said = advice(cat, "cpu")
        for token, words in remedies:
            if token in (None, "cuda"):
                assert (words in said) == (token is None), (cat, words, said)
                continue
            try:
                Plan.parse(token).check(Context(device=cpu))
                ok = True
            except PlanError:
                ok = False
            assert (words in said) == ok, (cat, token, said)
        assert advice(cat, "cuda").count(",") >= said.count(",")
    assert "offload:params" in advice("params", "cuda") and "PYTORCH_CUDA_ALLOC_CONF" in advice("other", "cuda")

    def build():
        return torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))

    ids = torch.randint(0, 256, (4, 16))
    with warnings.catch_warnings(record=True) as shown:
        _python_default_warning_filters()
        colabkit.train(build, data=[{"input_ids": ids, "labels": ids}] * 2, steps=2, batch=4, seq=16, device="cpu",
                       budget_bytes=300_000, progress=False)
    said = [str(w.message) for w in shown if w.category is colabkit.MemoryAlert]
    assert len(said) == 1 and "colabkit.choose_plan(build" in said[0] and "device='cpu'" in said[0], said
    assert "fits" not in said[0], said  # the planner was not asked: it says nothing of what fits
    assert re.search(r"memory reached [\d.]+ KiB, \d+% of the budget", said[0]), said[0]


def test_the_cli_shows_colabkit_warnings_without_a_source_line():
    """A command has no line of the user's: its warnings print as 'MemoryAlert: ...', one line each (a process of
    its own: pytest records warnings in place of printing them)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "colabkit", "train", "--model", "gpt-tiny", "--steps", "1", "--batch", "2",
                        "--seq", "16", "--device", "cpu", "--budget-bytes", "1000000"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    alerts = [ln for ln in r.stderr.splitlines() if "MemoryAlert" in ln]
    assert len(alerts) == 1 and all(ln.startswith("MemoryAlert: colabkit: ") for ln in alerts), r.stderr
    assert "warn(" not in r.stderr and ".py:" not in r.stderr, r.stderr


def test_a_warning_raised_inside_the_users_code_names_the_call_into_colabkit(tmp_path, monkeypatch):
    """colabkit runs the user's code (their model's forward, their callback), and a warning is raised in there: it
    names the line that called colabkit -- this file's train() -- not the user's code that colabkit called (here a
    callback in the user's own file that warns through colabkit). Control: the innermost frame outside colabkit
    and the libraries is the user's file."""
    import sys

    (tmp_path / "users_code.py").write_text(
        "import colabkit.notices\n"
        "def on_step_end(event):\n"
        "    colabkit.notices.warn('colabkit: a note from inside the run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_code

    def noted() -> warnings.WarningMessage:
        with warnings.catch_warnings(record=True) as shown:
            _python_default_warning_filters()
            colabkit.train("gpt-tiny", steps=1, batch=2, seq=16, device="cpu", progress=False, track=False,
                           callbacks=[users_code.on_step_end])
        return next(w for w in shown if "a note from inside" in str(w.message))
    assert noted().filename == __file__

    def innermost() -> int:
        frame, level = sys._getframe(2), 2
        while frame is not None and not notices._outside(frame.f_code.co_filename):
            frame, level = frame.f_back, level + 1
        return level
    monkeypatch.setattr(notices, "stacklevel", innermost)
    assert noted().filename.endswith("users_code.py")

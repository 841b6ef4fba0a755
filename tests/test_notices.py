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
    """The tracker's alert and the planner's tip, each once, as MemoryAlert (a ColabkitWarning, a UserWarning),
    attributed to this file's train() call. Controls: warnings.warn's own stacklevel names colabkit's source, and
    the old ResourceWarning category is not shown at all."""
    shown = _shown()
    assert len(shown) == 2, [str(w.message) for w in shown]
    assert all(w.category is colabkit.MemoryAlert and w.filename == __file__ for w in shown)
    assert issubclass(colabkit.MemoryAlert, UserWarning)
    monkeypatch.setattr(notices, "stacklevel", lambda: 2)
    assert {os.path.basename(w.filename) for w in _shown()} == {"memory.py", "alerts.py"}
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

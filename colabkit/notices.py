"""colabkit's warnings: one category of its own, shown by default, pointed at the line of *your* code.

Python hides ``ResourceWarning`` unless asked (its default filters), which is where colabkit's memory alerts
used to go: a run past 90% of its budget said nothing in a notebook or a script. Every colabkit warning is a
:class:`ColabkitWarning` (a ``UserWarning``: shown once per place by default); memory and host-RAM alerts are
its subclass :class:`MemoryAlert`, and a checkpoint that could not be read is a :class:`CheckpointSkipped`
(also a ``RuntimeWarning``). :func:`warn` attributes the warning to the first frame outside colabkit and the
libraries it runs under (torch, transformers, the standard library): the line Python prints under the
message is your ``train(...)`` or ``trainer.train()`` call, not a line of colabkit's source.

Silence them as any warning: ``warnings.filterwarnings("ignore", category=colabkit.MemoryAlert)``.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("default")
...     warn("colabkit: a note", MemoryAlert)
>>> w[0].category.__name__, w[0].filename.startswith("<doctest")  # the caller's line, not this module's
('MemoryAlert', True)
"""
from __future__ import annotations

import os
import sys
import sysconfig
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# installed libraries and the standard library: a warning raised under torch's dispatch or transformers'
# Trainer belongs to the user's line that called them
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(k))}))


class ColabkitWarning(UserWarning):
    """A warning of colabkit's own (shown by default, once per place)."""


class MemoryAlert(ColabkitWarning):
    """Device memory or host RAM past its alert threshold during a run (not a ``ResourceWarning``, which Python
    hides by default)."""


class CheckpointSkipped(ColabkitWarning, RuntimeWarning):
    """A checkpoint that could not be read; the previous one is tried."""


def _outside(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not path.startswith(_PACKAGE) and not path.startswith(_LIBRARIES) and not filename.startswith("<frozen")


def stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn`, called from :func:`warn`, that names the user's line that
    called colabkit: outside the outermost colabkit frame, the first frame that is not an installed library's
    (transformers' Trainer calling colabkit's callback: the ``trainer.train()`` line). A model's own ``forward``,
    which colabkit calls, is inside it and is not named. Without such a frame (the CLI, a library calling
    colabkit) colabkit's warning site itself."""
    frames = []  # the caller of warn() first, then outwards
    frame = sys._getframe(2)
    while frame is not None:
        frames.append(frame.f_code.co_filename)
        frame = frame.f_back
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f).startswith(_PACKAGE)]
    for i in range(ours[-1] + 1 if ours else 0, len(frames)):
        if _outside(frames[i]):
            return i + 2  # frames[0] is what warnings.warn(stacklevel=2) in warn() names
    return 2


def warn(message: str, category: type[Warning] = ColabkitWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line (:func:`stacklevel`)."""
    if not issubclass(category, ColabkitWarning):
        raise TypeError(f"colabkit warnings are ColabkitWarning subclasses, got {category.__name__}")
    warnings.warn(message, category, stacklevel=stacklevel())

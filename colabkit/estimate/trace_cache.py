"""Traces kept on disk between processes: a question asked again (``plan`` twice, a notebook re-run, the
same model at another plan whose model-side tokens were traced before) traces nothing.

A fake trace costs 0.1-0.2 s of CPU per plan and depth, and the first one in a process imports
``torch._dynamo`` (FakeTensorMode needs its config: about 1 s) -- most of a ``plan`` run after torch's
own import. :mod:`.trace` keeps each distinct trace once per process; this module keeps the same entries,
under the same keys, in a folder: ``$COLABKIT_TRACE_CACHE``, or ``~/.cache/colabkit/traces``; set it to
``off`` to trace every time (the test suite does; ``full_trace()`` never reads it).

Only GPT-family models are stored (a preset or ``gpt:LxD`` name, a :func:`~.trace.gpt_builder`: the key
names the whole model); ``hf:`` ids and folders, whose config files can change under the same name, are
cached per process only. Every entry lives under a *stamp*: a hash of what could change a trace without
changing its key -- colabkit's own source files and shipped configs, the versions of torch, transformers and Python, and the CPU capability torch
dispatches to. Edit colabkit, upgrade torch, and the old entries are simply not found (the oldest stamps
beyond :data:`KEEP_STAMPS` are removed). Entries are pickles written atomically by this user's own runs,
read back only from this user's cache folder (the trust model of torch's own compile caches); an entry
that cannot be read is removed and traced again.

>>> import tempfile, os
>>> was = os.environ.get(ENV); os.environ[ENV] = tempfile.mkdtemp()
>>> store(("gpt-tiny", "baseline", 2), ({"peak_bytes": 123}, ["a note"]))
>>> load(("gpt-tiny", "baseline", 2))
({'peak_bytes': 123}, ['a note'])
>>> load(("gpt-tiny", "baseline", 4)) is None
True
>>> os.environ[ENV] = "off"; load(("gpt-tiny", "baseline", 2)) is None
True
>>> os.environ[ENV] = was or ""
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

ENV = "COLABKIT_TRACE_CACHE"
OFF = ("off", "0", "false", "no")
KEEP_STAMPS = 4  # versions of colabkit/torch kept side by side (a few MiB at most: entries are a few KiB)
_PACKAGE = Path(__file__).resolve().parents[1]  # colabkit/


def directory() -> Path | None:
    """The cache folder (created on the first store), or None when ``$COLABKIT_TRACE_CACHE`` is ``off``."""
    where = os.environ.get(ENV, "")
    if where.lower() in OFF:
        return None
    return Path(where) if where else Path.home() / ".cache" / "colabkit" / "traces"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def stamp() -> str:
    """What a trace depends on beyond its key, hashed: colabkit's source, torch/transformers/Python versions,
    the CPU capability (a few ms, once per process)."""
    h = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in (".py", ".json")):  # code, shipped configs
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    h.update(f"{torch.__version__}|{_version('transformers')}|{platform.python_version()}|"
             f"{torch.backends.cpu.get_cpu_capability()}".encode())
    return h.hexdigest()[:20]


def _path(key: tuple) -> Path | None:
    root = directory()
    if root is None:
        return None
    return root / stamp() / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".pkl")


def load(key: tuple) -> Any | None:
    """The entry stored under ``key`` by an earlier process of the same stamp, or None."""
    path = _path(key)
    if path is None or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            stored_key, value = pickle.load(f)
    except Exception:  # noqa: BLE001  (a truncated or foreign file: traced again, and the file dropped)
        path.unlink(missing_ok=True)
        return None
    return value if stored_key == repr(key) else None  # a hash collision reads as a miss


def store(key: tuple, value: Any) -> None:
    """Keep ``value`` under ``key`` for later processes; a folder that cannot be written is skipped silently
    (the cache only saves time)."""
    path = _path(key)
    if path is None:
        return
    try:
        fresh = not path.parent.is_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as f:
            pickle.dump((repr(key), value), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(f.name, path)
        if fresh:
            _prune(path.parent.parent)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        return


def _prune(root: Path) -> None:
    """Keep the :data:`KEEP_STAMPS` most recently made stamp folders (other colabkit or torch versions)."""
    stamps = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in stamps[KEEP_STAMPS:]:
        shutil.rmtree(old, ignore_errors=True)


def clear() -> int:
    """Remove every stored trace; the number of entries removed.

    >>> clear() >= 0
    True
    """
    root = directory()
    if root is None or not root.is_dir():
        return 0
    n = sum(1 for _ in root.rglob("*.pkl"))
    shutil.rmtree(root, ignore_errors=True)
    return n

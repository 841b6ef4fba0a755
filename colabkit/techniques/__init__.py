"""Technique modules: each registers its plan tokens (see ``colabkit.plan.register``) on import.

Every module in this folder is imported here, so a new technique needs no edit elsewhere.
"""
from __future__ import annotations

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

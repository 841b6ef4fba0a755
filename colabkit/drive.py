"""A folder that outlives the runtime: Google Drive in Colab, a local folder elsewhere.

>>> import tempfile
>>> d = drive_dir("runs/demo", local_root=tempfile.mkdtemp(), verbose=False)
>>> os.path.isdir(d), d.endswith(os.path.join("runs", "demo"))
(True, True)
"""
from __future__ import annotations

import os
import sys

MOUNT_POINT = "/content/drive"


def drive_dir(name: str = "colabkit", local_root: str | None = None, verbose: bool = True) -> str:
    """Return ``<My Drive>/<name>`` in Colab (mounting Drive with ``google.colab.drive.mount`` if it is
    not mounted yet; Colab asks for permission once), else ``<local_root or cwd>/<name>``, created."""
    colab = "google.colab" in sys.modules
    if not colab:
        try:
            import google.colab  # noqa: F401
            colab = True
        except ImportError:
            pass
    if colab:
        from google.colab import drive  # type: ignore[import-not-found]

        root = os.path.join(MOUNT_POINT, "MyDrive")
        if not os.path.isdir(root):
            drive.mount(MOUNT_POINT)
        where = "on Google Drive (survives a disconnect)"
    else:
        root = local_root or os.getcwd()
        where = "in a local folder: not in Colab, so no Google Drive to mount"
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    if verbose:
        print(f"colabkit: checkpoints go to {path} ({where})")
    return path

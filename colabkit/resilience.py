"""Kill a training run and resume it: what notebook 13 demonstrates, as plain functions.

:func:`kill_and_resume` starts ``python -m colabkit train ... --checkpoint-dir D --checkpoint-every K`` as a
separate process, waits until it has written ``kill_after`` checkpoints, kills it with SIGKILL (no clean-up
runs, as when a Colab runtime disconnects) and runs the same command again with ``--resume``.
:func:`describe_resume` says in one line what happened. The subprocess imports the same colabkit as this
process (its folder goes first on ``PYTHONPATH``).

>>> train_command("gpt-tiny", "baseline", steps=4, batch=2, seq=16, seed=0, device="cpu", every=2, directory="d")[3:6]
['train', '--model', 'gpt-tiny']
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from .checkpoints import list_checkpoints

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding this colabkit package


def train_command(model: str, plan: str, steps: int, batch: int, seq: int, seed: int, device: str, every: int,
                  directory: str, *extra: str) -> list[str]:
    """The ``python -m colabkit train`` command line of a checkpointed, untracked run (JSON on stdout)."""
    return [sys.executable, "-m", "colabkit", "train", "--model", model, "--plan", plan, "--steps", str(steps),
            "--batch", str(batch), "--seq", str(seq), "--seed", str(seed), "--device", device, "--no-track",
            "--checkpoint-dir", directory, "--checkpoint-every", str(every), "--json", "-", *extra]


def kill_and_resume(model: str, plan: str, steps: int, batch: int, seq: int, seed: int, device: str, every: int,
                    directory: str, kill_after: int = 2, timeout_s: float = 300,
                    deterministic: bool = False) -> dict[str, Any]:
    """Train in a subprocess, SIGKILL it once ``kill_after`` checkpoints exist, resume it to the end.
    ``deterministic=True`` runs both with ``--deterministic``: on a GPU, attention's backward and embedding
    gradients add in a varying order otherwise, so a resumed run is bit-identical to another run only then.

    Returns ``killed`` (the process died of SIGKILL), ``killed_at`` (the newest checkpoint's step then),
    ``resumed_from`` (the checkpoint file the resumed run started from), its ``losses`` and
    ``weights_sha256``, the ``dir`` and the files ``left`` in it."""
    if not 1 <= kill_after < steps // every:
        raise ValueError(f"kill_after={kill_after}: the run writes {steps // every} checkpoints; kill after 1 to "
                         f"{steps // every - 1} of them so that there is something left to resume")
    shutil.rmtree(directory, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = train_command(model, plan, steps, batch, seq, seed, device, every, directory,
                        *(["--deterministic"] if deterministic else []))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and len(list_checkpoints(directory)) < kill_after and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    killed = proc.wait() == -signal.SIGKILL
    if not list_checkpoints(directory):
        raise RuntimeError(f"the training process wrote no checkpoint in {directory} before it ended: run "
                           f"{' '.join(cmd)} by hand to see why")
    killed_at = list_checkpoints(directory)[-1][0]
    out = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, check=True, timeout=timeout_s).stdout
    res = json.loads(out[out.index("{"):])
    return {"dir": directory, "killed": killed, "killed_at": killed_at,
            "resumed_from": os.path.basename(res["resumed_from"]), "losses": res["losses"],
            "weights_sha256": res["weights_sha256"], "left": sorted(os.listdir(directory))}


def describe_resume(result: dict[str, Any], reference_sha256: str | None = None) -> str:
    """One line: killed or not and its newest checkpoint's step then, where the run resumed, the files left, and
    (given the uninterrupted run's hash) whether the final weights are identical to it.

    >>> describe_resume({"killed": True, "killed_at": 10, "resumed_from": "ckpt-00000010.ckpt",
    ...                  "weights_sha256": "ab", "left": ["ckpt-00000020.ckpt"]}, "ab").split("; ")[2]
    'weights identical to the uninterrupted run: True'
    """
    same = "" if reference_sha256 is None else \
        f"; weights identical to the uninterrupted run: {result['weights_sha256'] == reference_sha256}"
    return (f"killed (SIGKILL): {result['killed']}, its newest checkpoint then at step {result['killed_at']}; "
            f"resumed from {result['resumed_from']}"
            f"{same}; files left: {', '.join(result['left'])}")

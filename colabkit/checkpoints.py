"""Streaming, validated checkpoints that survive a dying runtime.

A checkpoint is one file ``ckpt-<step>.ckpt``: the raw bytes of every tensor of the state, one after
another, then a JSON manifest (each tensor's offset, size, dtype, shape and sha256, and a skeleton of
the nested state with the non-tensor values), then the manifest's length (8 bytes) and a magic tag.
Tensors are written one at a time from their own memory (a CUDA tensor is copied to the host one at a
time), so the extra host memory while saving is the largest tensor plus the manifest — never the whole
checkpoint, which ``torch.save`` of the state dict would build in memory first.

The file is written as ``.ckpt-<step>.tmp`` in the same folder, flushed, fsynced, renamed, and the folder
fsynced; the last ``keep`` checkpoints stay. Loading validates the newest one (size, manifest, every
checksum) and falls back to the previous one, saying which was skipped and why.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> p = write_checkpoint({"w": torch.arange(6.0).reshape(2, 3), "meta": {"step": 3, "betas": (0.9, 0.99)}}, d, 3)
>>> os.path.basename(p)
'ckpt-00000003.ckpt'
>>> state, path, skipped = read_latest(d)
>>> state["w"].sum().item(), state["meta"]["betas"], skipped
(15.0, (0.9, 0.99), [])
"""
from __future__ import annotations

import base64
import hashlib
import json
import mmap
import os
import pickle
import random
import re
import struct
import warnings
from typing import Any

import torch

from .plan import PlanError

__all__ = ["CheckpointError", "write_checkpoint", "read_checkpoint", "read_latest", "list_checkpoints",
           "save_trainer", "load_trainer", "trainer_state", "rng_state", "set_rng_state", "check_compatible"]

MAGIC = b"CKCKPT01"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)\.ckpt$")
_TMP = re.compile(r"^\.ckpt-\d+\.tmp(-\d+)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, missing, or from another model/plan)."""


# ----- the container: flatten nested state into tensors + a JSON skeleton ---------------------------
def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able skeleton of ``obj``; each tensor is replaced by {"__t__": index into ``tensors``}."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, dict):  # keys may be ints (optimizer state) -> keep them as [key, value] pairs
        return {"__d__": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else {"__float__": repr(obj)}
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return {"__np__": _flatten(torch.from_numpy(obj.copy()), tensors)}
    except ImportError:
        pass
    # anything else (a dtype, a small object of a library's state): pickled, it is small
    return {"__pickle__": base64.b64encode(pickle.dumps(obj)).decode()}


def _unflatten(sk: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(sk, list):
        return [_unflatten(v, tensors) for v in sk]
    if not isinstance(sk, dict):
        return sk
    if "__t__" in sk:
        return tensors[sk["__t__"]]
    if "__d__" in sk:
        return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in sk["__d__"]}
    if "__tuple__" in sk:
        return tuple(_unflatten(v, tensors) for v in sk["__tuple__"])
    if "__float__" in sk:
        return float(sk["__float__"])
    if "__np__" in sk:
        return _unflatten(sk["__np__"], tensors).numpy()
    if "__pickle__" in sk:
        return pickle.loads(base64.b64decode(sk["__pickle__"]))
    raise CheckpointError(f"unknown entry in the manifest: {sorted(sk)}")


def _bytes_of(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(host tensor, a uint8 buffer over its bytes) without copying a contiguous host tensor."""
    t = t.detach()
    if type(t) is not torch.Tensor:  # parameter / quantized subclasses: their plain storage
        t = t.as_subclass(torch.Tensor)
    t = t.cpu().contiguous()  # a CUDA tensor: one host copy of this tensor only
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return t, flat.numpy()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the finished checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = [(int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory) if (m := _NAME.match(n))]
    return sorted(out)


def remove_temp_files(directory: str) -> list[str]:
    """Delete half-written checkpoints (a run killed while saving leaves one)."""
    gone = []
    for n in os.listdir(directory) if os.path.isdir(directory) else []:
        if _TMP.match(n):
            os.remove(os.path.join(directory, n))
            gone.append(n)
    return gone


def write_checkpoint(state: dict[str, Any], directory: str, step: int, keep: int = 3) -> str:
    """Stream ``state`` (nested dicts/lists of tensors and plain values) to ``directory/ckpt-<step>.ckpt``
    tensor by tensor, atomically; keep the newest ``keep`` checkpoints. Returns the path."""
    os.makedirs(directory, exist_ok=True)
    remove_temp_files(directory)
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(state, tensors)
    final = os.path.join(directory, f"ckpt-{step:08d}.ckpt")
    tmp = os.path.join(directory, f".ckpt-{step:08d}.tmp-{os.getpid()}")
    entries = []
    try:
        with open(tmp, "wb") as f:
            offset = 0
            for i in range(len(tensors)):
                t, buf = _bytes_of(tensors[i])
                f.write(buf)  # from the tensor's own memory
                entries.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "offset": offset, "nbytes": int(buf.nbytes), "sha256": hashlib.sha256(buf).hexdigest()})
                offset += int(buf.nbytes)
                del t, buf
            manifest = json.dumps({"format": FORMAT, "step": step, "tensors": entries, "state": skeleton,
                                   "data_bytes": offset}).encode()
            f.write(manifest)
            f.write(struct.pack("<Q", len(manifest)) + MAGIC)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    for _, old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        os.remove(old)
    return final


def read_checkpoint(path: str) -> dict[str, Any]:
    """Read and validate one checkpoint (size, manifest, every tensor's checksum); raise
    :class:`CheckpointError` naming what is wrong."""
    size = os.path.getsize(path)
    tail = 8 + len(MAGIC)
    if size < tail:
        raise CheckpointError(f"{size} bytes, too short to be a checkpoint")
    with open(path, "rb") as f:
        f.seek(size - tail)
        n, magic = struct.unpack("<Q", f.read(8))[0], f.read(len(MAGIC))
        if magic != MAGIC:
            raise CheckpointError("no end marker (truncated or not a colabkit checkpoint)")
        if n > size - tail:
            raise CheckpointError("manifest length larger than the file (truncated)")
        f.seek(size - tail - n)
        try:
            man = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"manifest is not valid JSON ({e})") from None
        if man.get("format") != FORMAT or man["data_bytes"] != size - tail - n:
            raise CheckpointError(f"size mismatch: manifest says {man['data_bytes']} tensor bytes, "
                                  f"file holds {size - tail - n}")
        tensors = []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for i, e in enumerate(man["tensors"]):
                view = memoryview(mm)[e["offset"]:e["offset"] + e["nbytes"]]
                try:
                    if hashlib.sha256(view).hexdigest() != e["sha256"]:
                        raise CheckpointError(f"checksum mismatch in tensor {i} ({e['nbytes']} bytes at offset {e['offset']})")
                    raw = torch.frombuffer(bytearray(view), dtype=torch.uint8) if e["nbytes"] else torch.empty(0, dtype=torch.uint8)
                finally:
                    view.release()
                tensors.append(raw.view(getattr(torch, e["dtype"])).reshape(e["shape"]))
    return _unflatten(man["state"], tensors)


def read_latest(directory: str) -> tuple[dict[str, Any] | None, str | None, list[tuple[str, str]]]:
    """The newest valid checkpoint in ``directory``: (state, path, skipped [(name, why)]); a skipped
    one is also warned about. (None, None, skipped) if none is valid."""
    skipped = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            state = read_checkpoint(path)
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
            skipped.append((os.path.basename(path), why))
            warnings.warn(f"colabkit: skipped checkpoint {os.path.basename(path)}: {why}; trying the previous one",
                          RuntimeWarning, stacklevel=2)
            continue
        return state, path, skipped
    return None, None, skipped


# ----- trainer state ----------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and every CUDA device's generator state."""
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"][:torch.cuda.device_count()])


def _model_config(model: torch.nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return type(model).__name__
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    elif hasattr(cfg, "__dataclass_fields__"):
        import dataclasses

        cfg = dataclasses.asdict(cfg)
    return {k: v for k, v in sorted(vars(cfg).items() if not isinstance(cfg, dict) else cfg.items())
            if isinstance(v, (int, float, str, bool, type(None)))}


def identity(trainer: Any, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint: model, plan, data settings."""
    return {"model": trainer.ctx.model_name or type(trainer.model).__name__, "config": _model_config(trainer.model),
            "plan": str(trainer.plan), **(run or {})}


def check_compatible(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a checkpoint from another model, plan or data setting, naming the difference."""
    diffs = []
    for k in current:
        if k in saved and saved[k] != current[k]:
            if isinstance(current[k], dict) and isinstance(saved[k], dict):
                sub = [f"{kk}={saved[k].get(kk)!r} vs {current[k].get(kk)!r}" for kk in sorted(set(saved[k]) | set(current[k]))
                       if saved[k].get(kk) != current[k].get(kk)]
                diffs.append(f"{k} ({', '.join(sub)})")
            else:
                diffs.append(f"{k}: checkpoint {saved[k]!r}, this run {current[k]!r}")
    if diffs:
        raise PlanError("the checkpoint was written by a different run — " + "; ".join(diffs)
                        + ". Resume with the same plan, model and data settings (batch, seq, seed), or use a fresh checkpoint folder")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("colabkit")
    except PackageNotFoundError:
        return "unknown"


def trainer_state(trainer: Any, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every piece of state for an exact resume; each optimizer's own ``state_dict`` (8-/4-bit,
    offloaded, fused-step wrappers all provide one)."""
    sched = getattr(trainer, "scheduler", None)
    return {"step": trainer.step_count, "accum": trainer.accum, "identity": identity(trainer, run),
            "versions": {"colabkit": _version(), "torch": torch.__version__},
            "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scaler": trainer.scaler.state_dict(), "scheduler": sched.state_dict() if sched is not None else None,
            "rng": rng_state(), "data": {"step": trainer.step_count, **(run or {})}}


def save_trainer(trainer: Any, directory: str, keep: int = 3, run: dict[str, Any] | None = None) -> str:
    """Write the trainer's full state as ``directory/ckpt-<step>.ckpt`` (streamed, atomic, keep last ``keep``)."""
    return write_checkpoint(trainer_state(trainer, run), directory, trainer.step_count, keep=keep)


def require_folder(directory: str) -> None:
    """Raise :class:`CheckpointError` when the resume folder does not exist."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"resume folder {directory!r} does not exist: check the path (on Colab, is "
                              "Drive mounted? colabkit.drive_dir) or start without resume")


def load_trainer(trainer: Any, directory: str, run: dict[str, Any] | None = None, required: bool = True) -> str | None:
    """Restore the newest valid checkpoint of ``directory`` into ``trainer``; returns its path.

    ``required``: a missing folder or no valid checkpoint raises :class:`CheckpointError` (else None)."""
    if not os.path.isdir(directory):
        if required:
            require_folder(directory)
        return None
    remove_temp_files(directory)
    state, path, skipped = read_latest(directory)
    if state is None:
        if required:
            why = "; ".join(f"{n}: {w}" for n, w in skipped) or "no ckpt-*.ckpt files"
            raise CheckpointError(f"no valid checkpoint in {directory!r} ({why}): start without resume")
        return None
    check_compatible(state["identity"], identity(trainer, run))
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    if state.get("scheduler") is not None and getattr(trainer, "scheduler", None) is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    trainer.step_count = state["step"]
    trainer.accum = state.get("accum", trainer.accum)  # runtime micro-batching (an OOM shrink) carries over
    return path


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

The manifest holds data only (tensors, numbers, strings, bools, None, lists, tuples, dicts, dtypes, NumPy
arrays and a few named library state objects, each encoded explicitly): a value of any other kind is
refused when saving, naming where it sits in the state, and loading never un-pickles anything, so a
checkpoint from someone else cannot run code. A manifest that asks for code is skipped like a damaged file.

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

import hashlib
import json
import mmap
import os
import random
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .callbacks import Callback, Run
from .determinism import restore_threads
from .plan import PlanError
from .trainer import weights_sha256
from .notices import CheckpointSkipped, warn

__all__ = ["CheckpointError", "write_checkpoint", "read_checkpoint", "read_latest", "list_checkpoints",
           "save_trainer", "load_trainer", "trainer_state", "rng_state", "set_rng_state", "check_compatible",
           "Checkpointing", "CHECKPOINT_MINUTES"]

MAGIC = b"CKCKPT01"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)\.ckpt$")
_TMP = re.compile(r"^\.ckpt-\d+\.tmp(-\d+)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, missing, or from another model/plan)."""


# ----- the container: flatten nested state into tensors + a JSON skeleton ---------------------------
# The manifest holds data only: a closed set of value kinds, each with its own explicit encoding, so
# reading a checkpoint parses bytes and never runs code from the file (no pickle anywhere on this path).
# Library state objects colabkit writes (by qualified class name): rebuilt without calling __init__, their
# attributes restored from data. GaLore's projector: rank, scale, gap, type and its matrix (a tensor).
STATE_CLASSES = frozenset({"galore_torch.galore_projector.GaLoreProjector"})


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _flatten(obj: Any, tensors: list[torch.Tensor], path: str = "state") -> Any:
    """A JSON-able skeleton of ``obj``; each tensor is replaced by {"__t__": index into ``tensors``}.
    A value of any other kind raises :class:`CheckpointError` naming its ``path`` and type."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, dict):  # keys may be ints (optimizer state) -> keep them as [key, value] pairs
        return {"__d__": [[_flatten(k, tensors, f"{path} key {k!r}"), _flatten(v, tensors, f"{path}[{k!r}]")]
                          for k, v in obj.items()]}
    if isinstance(obj, list):
        return [_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):  # torch.Size too (read back as a tuple, which it equals)
        return {"__tuple__": [_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj if type(obj) in (bool, int, str, type(None)) else _flatten(_plain(obj), tensors, path)
    if isinstance(obj, float):
        obj = float(obj)  # a NumPy float64 is a float: stored as the plain number
        return obj if obj == obj and abs(obj) != float("inf") else {"__float__": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    try:
        import numpy as np

        if isinstance(obj, (np.ndarray, np.generic)):  # a NumPy scalar: a 0-d array, read back with [()]
            arr = np.asarray(obj)
            if arr.dtype.hasobject:
                raise CheckpointError(f"cannot save {path}: a NumPy array of Python objects is not data; "
                                      "store it as numbers, or keep it out of the saved state")
            return {"__np__": _flatten(torch.from_numpy(arr.copy()), tensors, path), "scalar": arr is not obj}
    except ImportError:
        pass
    if _qualname(obj) in STATE_CLASSES:
        return {"__obj__": _qualname(obj), "attrs": _flatten(dict(vars(obj)), tensors, path)}
    raise CheckpointError(
        f"cannot save {path}: a {_qualname(obj)} is not data. A checkpoint holds only tensors, numbers, strings, "
        "bools, None, lists, tuples, dicts, dtypes and NumPy arrays (so loading one never runs code); give this "
        "object a state_dict() of plain values, or keep it out of the saved state")


def _plain(v: Any) -> Any:
    """An int/str/bool subclass (an IntEnum, a str Enum) as the plain value it stands for."""
    return bool(v) if isinstance(v, bool) else int(v) if isinstance(v, int) else str(v)


_MARKERS = ("__t__", "__d__", "__tuple__", "__float__", "__dtype__", "__device__", "__np__", "__obj__")


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dt


def _unflatten(sk: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(sk, list):
        return [_unflatten(v, tensors) for v in sk]
    if not isinstance(sk, dict):
        return sk
    kind = next((k for k in _MARKERS if k in sk), None)
    if kind == "__t__":
        return tensors[int(sk["__t__"])]
    if kind == "__d__":
        return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in sk["__d__"]}
    if kind == "__tuple__":
        return tuple(_unflatten(v, tensors) for v in sk["__tuple__"])
    if kind == "__float__":
        return float(sk["__float__"])
    if kind == "__dtype__":
        return _dtype(sk["__dtype__"])
    if kind == "__device__":
        return torch.device(str(sk["__device__"]))
    if kind == "__np__":
        arr = _unflatten(sk["__np__"], tensors).numpy()
        return arr[()] if sk.get("scalar") else arr
    if kind == "__obj__":
        name = sk["__obj__"]
        if name not in STATE_CLASSES:
            raise CheckpointError(f"refused for safety: the manifest asks for an object of class {name!r}, which "
                                  "colabkit never writes")
        import importlib

        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        obj = cls.__new__(cls)  # no __init__: the attributes below are the whole state, all data
        obj.__dict__.update(_unflatten(sk["attrs"], tensors))
        return obj
    if "__pickle__" in sk:
        raise CheckpointError("refused for safety: the manifest holds a pickled Python object, which could run "
                              "code when loaded; colabkit checkpoints hold data only, so this file was altered or "
                              "written by another tool")
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
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(state, tensors)  # first: a value that is not data is refused before any file exists
    os.makedirs(directory, exist_ok=True)
    remove_temp_files(directory)
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
                tensors.append(raw.view(_dtype(e["dtype"])).reshape(e["shape"]))
    return _unflatten(man["state"], tensors)


def read_latest(directory: str) -> tuple[dict[str, Any] | None, str | None, list[tuple[str, str]]]:
    """The newest valid checkpoint in ``directory``: (state, path, skipped [(name, why)]); a skipped
    one is also warned about. (None, None, skipped) if none is valid."""
    skipped = []
    newest_first = list(reversed(list_checkpoints(directory)))
    for i, (_, path) in enumerate(newest_first):
        try:
            state = read_checkpoint(path)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError, IndexError) as e:
            why = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
            skipped.append((os.path.basename(path), why))
            then = "trying the previous one" if i + 1 < len(newest_first) else "it was the oldest: none is left"
            warn(f"colabkit: skipped checkpoint {os.path.basename(path)}: {why}; {then}", CheckpointSkipped)
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


def saved_plan(directory: str) -> str | None:
    """The plan of the newest checkpoint in ``directory`` whose manifest reads, from the manifest alone (no
    tensor is read); ``None`` when there is none. ``plan="auto"`` resumes with it: a run keeps its plan."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            with open(path, "rb") as f:
                f.seek(-(8 + len(MAGIC)), os.SEEK_END)
                n = struct.unpack("<Q", f.read(8))[0]
                f.seek(-(8 + len(MAGIC) + n), os.SEEK_END)
                state = dict(json.loads(f.read(n))["state"]["__d__"])
            ident = _unflatten(state["identity"], [])  # plain values only: model, config, plan, data settings
            return ident["plan"]
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, CheckpointError):
            continue  # damaged: the previous one (as resuming does)
    return None


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


def trainer_state(trainer: Any, run: dict[str, Any] | None = None, loss: float | None = None) -> dict[str, Any]:
    """Every piece of state for an exact resume; each optimizer's own ``state_dict`` (8-/4-bit,
    offloaded, fused-step wrappers all provide one). ``loss``: the last step's, reported when a finished
    run is run again."""
    sched = getattr(trainer, "scheduler", None)
    return {"step": trainer.step_count, "accum": trainer.accum, "identity": identity(trainer, run),
            "versions": {"colabkit": _version(), "torch": torch.__version__},
            "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scaler": trainer.scaler.state_dict(), "scheduler": sched.state_dict() if sched is not None else None,
            "rng": rng_state(), "data": {"step": trainer.step_count, **(run or {})}, "loss": loss,
            "threads": torch.get_num_threads()}  # CPU results depend on it: a resume runs with the same number


def save_trainer(trainer: Any, directory: str, keep: int = 3, run: dict[str, Any] | None = None,
                 loss: float | None = None) -> str:
    """Write the trainer's full state as ``directory/ckpt-<step>.ckpt`` (streamed, atomic, keep last ``keep``)."""
    return write_checkpoint(trainer_state(trainer, run, loss), directory, trainer.step_count, keep=keep)


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
    _load_model_state(trainer.model, state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    if state.get("scheduler") is not None and getattr(trainer, "scheduler", None) is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    restore_threads(state.get("threads"))
    trainer.step_count = state["step"]
    trainer.accum = state.get("accum", trainer.accum)  # runtime micro-batching (an OOM shrink) carries over
    trainer.checkpoint_loss = state.get("loss")  # the loss at that step (None in checkpoints before it was kept)
    return path


def _load_model_state(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """``load_state_dict``, plus the entries a module writes but does not read back: a 4-bit base's
    quantization state (absmax, quant_map, ... of bitsandbytes' Params4bit, loaded with its packed weight).
    Those must equal what the rebuilt model holds already, or the checkpoint is of another base."""
    missing, unexpected = model.load_state_dict(saved, strict=False)
    current = model.state_dict() if unexpected else {}
    differ = [k for k in unexpected if k not in current or not torch.equal(current[k].cpu(), saved[k].cpu())]
    if missing or differ:
        raise CheckpointError(f"the checkpoint's model state does not match this model: missing {missing[:3]}, "
                              f"unexpected or different {differ[:3]}; resume with the same model")



# ----- the train loop's checkpointing: cadence, keep-N, resume --------------------------------------------
CHECKPOINT_MINUTES = 10.0  # with only a checkpoint folder: a checkpoint every 10 min of wall time (Colab disconnects)


@dataclass
class Checkpointing(Callback):
    """Crash-safe checkpoints of a ``train()`` run, as settings and as the object receiving its events.

    A checkpoint is written to ``dir`` every ``every`` steps and/or every ``minutes`` of wall time (with
    neither: every 10 minutes), at the end, and (the state before the step) when a step runs out of memory;
    the newest ``keep`` stay. ``resume=True`` (or ``"auto"``) continues from the newest valid checkpoint when
    there is one and starts fresh otherwise, saying which; ``resume="must"`` raises when there is none.
    ``clock``: the wall clock the cadence reads (seconds).

    >>> Checkpointing("ckpt", every=50, resume=True).keep
    3
    """

    dir: str | None = None
    every: int = 0
    minutes: float | None = None
    keep: int = 3
    resume: bool | str = False
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self):
        self._saved_time = 0.0
        self._minutes = self.minutes if self.minutes is not None or self.every else CHECKPOINT_MINUTES

    def on_init_end(self, run: Run) -> None:
        """Restore the newest checkpoint (``resume``) and say the cadence."""
        if self.resume and self.dir:
            run.resumed_from = load_trainer(run.trainer, self.dir, run=run.identity, required=self.resume == "must")
            run.complete = _say_resumed(run.trainer, run.resumed_from, self.dir, run.steps)
        if self.dir and not run.complete:
            when = ([f"every {self.every} steps"] if self.every else []) + \
                ([f"every {self._minutes:g} min of wall time"] if self._minutes else []) + \
                [f"at the end (the newest {self.keep} kept)"]
            print(f"colabkit: checkpoints to {self.dir}: {' and '.join(when)}")
        self._saved_time = self.clock()

    def on_step_end(self, run: Run, event: dict[str, Any]) -> None:
        """Save by the cadence, and after the run's last step (before ``on_train_end``)."""
        n = event["step"]
        if self.dir and ((self.every and n % self.every == 0)
                         or (self._minutes and self.clock() - self._saved_time >= 60 * self._minutes)
                         or n == run.steps):
            self.save(run, event["loss"])

    def on_oom(self, run: Run, event: dict[str, Any]) -> None:
        """An out-of-memory the step could not recover from: the state before the step is saved."""
        if self.dir and not event["recovered"]:
            path = self.save(run, run.losses[-1] if run.losses else None)
            print(f"colabkit: out of memory; state before step {event['step']} saved to {path}")

    def save(self, run: Run, loss: float | None) -> str:
        path = save_trainer(run.trainer, self.dir, keep=self.keep, run=run.identity, loss=loss)
        self._saved_time = self.clock()
        run.fire("on_save", path)
        return path


def _say_resumed(trainer: Any, path: str | None, directory: str, steps: int) -> bool:
    """Say what ``resume`` found: a checkpoint to continue, a finished run (True), or nothing (a fresh
    start); a checkpoint past ``steps`` is an error."""
    if path is None:
        print(f"colabkit: nothing to resume in {directory} ("
              + ("no valid checkpoint" if os.path.isdir(directory) else "the folder does not exist yet")
              + "): starting a fresh run")
        return False
    n, name = trainer.step_count, os.path.basename(path)
    if n > steps:
        raise ValueError(f"steps={steps} is below the newest checkpoint in {directory} ({name}, step {n}): to continue "
                         f"that run ask for more than {n} steps; for a new run use another checkpoint folder")
    if n < steps:
        print(f"colabkit: resumed from step {n} ({name} in {directory})")
        return False
    loss = getattr(trainer, "checkpoint_loss", None)
    print(f"colabkit: the run in {directory} is complete: step {n} of {steps}, final loss "
          f"{'(not recorded)' if loss is None else f'{loss:.4f}'}, weights sha256 {weights_sha256(trainer.model)[:16]}; "
          "nothing to train (ask for more steps to continue it)")
    return True

"""Run colabkit on N processes (one per rank) for the sharded plans ``zero:1|2|3``.

:func:`launch` spawns ``world_size`` processes on a free loopback port (``MASTER_ADDR=127.0.0.1``),
starts the process group (gloo on the CPU, nccl with one GPU per rank), runs ``fn(*args)`` in each
and returns every rank's result. It works from a notebook: the processes are *spawned*, so ``fn``
must be importable (a colabkit function such as :func:`bench_ranks`, not one defined in a cell).
The ranks die with the launching process (``PR_SET_PDEATHSIG`` SIGKILL plus a parent-pid watchdog):
a killed notebook kernel or CLI leaves no rank running. Under ``torchrun`` (env:// variables set)
:func:`train_sharded` runs this process's rank instead of spawning (:func:`run_here`); rank 0 prints.
Every collective colabkit issues goes through :func:`colabkit.collectives.collective`, on the rank's
compute device (NCCL takes CUDA tensors only).

:func:`bench_sharded` is ``bench --world-size N``: each rank measures its 1/N of the effective batch
under its own tracker; one record per plan carries the largest rank's breakdown and ``per_rank``.
Checkpoints of a sharded run go through ``torch.distributed.checkpoint`` (one file per rank, resumed
exactly: RNG states and the fp16 loss scaler included) and :func:`consolidate` turns them into one
``torch.save`` file a single process loads.

>>> RankData(rank=1, world_size=2).batch(2, 8, step=0)[0].shape  # rows 2:4 of the global batch of 4
torch.Size([2, 8])
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import pickle
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from .collectives import collective, compute_device, install_strict, rank_tensor
from .checkpoints import CheckpointError
from .data import TextData
from .plan import Plan, PlanError, check_batch
from .train import measure
from .trainer import Trainer, load_model, weights_sha256


def backend_for(device: str | None, world_size: int) -> str:
    """gloo for CPU ranks, nccl for one GPU per rank; a clear error when there are fewer GPUs than ranks.

    >>> backend_for("cpu", 2)
    'gloo'
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        return "gloo"
    n = torch.cuda.device_count()
    if world_size > n:
        raise PlanError(f"world size {world_size} on nccl needs {world_size} GPUs, this machine has {n}: "
                        f"use --world-size {max(n, 1)} (Kaggle offers 2xT4), or --device cpu to simulate ranks "
                        "as CPU processes")
    return "nccl"


def rank_device(device: str | None) -> str:
    """This rank's device: ``cuda:<local rank>`` on nccl (the collectives' compute device), else ``cpu``."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return str(compute_device("nccl"))


def die_with_parent(parent_pid: int) -> None:
    """Make this rank process end when its parent does (a SIGKILL of ``train --world-size 2`` must not
    leave ranks running): on Linux the kernel sends SIGKILL at the parent's death (``prctl
    PR_SET_PDEATHSIG``); a daemon thread watching the parent pid is the fallback everywhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="colabkit-parent-watch", daemon=True).start()


def _share_cores(ranks_here: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))  # CPU ranks share the cores


def _run_rank(fn: Callable, args: tuple) -> Any:
    """``fn(*args)`` inside the started process group, then a barrier and the group's end."""
    install_strict()  # tests: NCCL's device rule on gloo too (colabkit.collectives)
    try:
        result = fn(*args)
        collective("barrier")
    finally:
        # The run's model and optimizer sit in reference cycles (module hooks) that hold tensors gloo's worker
        # threads may still reference and the process group itself: collected now, in this thread, while the
        # interpreter is alive. Left to interpreter shutdown, a worker thread that drops the last reference to
        # such a tensor needs the GIL of a finalizing interpreter and aborts the rank (pytorch/pytorch#179291; a
        # rank's SIGABRT at the end of a torchrun run, seen once in CI, fits it: not reproduced in 23 runs here).
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    return result


def _stderr_into(path: str) -> int:
    """This process's standard error (fd 2: Python's and C++'s, e.g. a ``terminate called ...`` before an abort)
    written to ``path`` until :func:`_stderr_back`; returns the saved fd. A rank killed by a signal leaves its
    last words there for :func:`launch` to report."""
    saved = os.dup(2)
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def _stderr_back(saved: int, path: str) -> None:
    """Standard error restored, and what the rank wrote meanwhile passed on to it (warnings arrive at the end)."""
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    with open(path, "rb") as f:
        written = f.read()
    if written:
        os.write(2, written)


def _last_words(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return ""
    return text[-limit:]


def _entry(rank: int, world_size: int, backend: str, out_dir: str, parent: int, fn: Callable, args: tuple) -> None:
    die_with_parent(parent)
    err = os.path.join(out_dir, f"rank{rank}.err")
    saved = _stderr_into(err)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        _share_cores(world_size)
    # the ranks meet through a file in this launch's own folder, not a TCP port picked beforehand: two launches
    # at once (test workers, two notebooks) could pick the same port, and a rank that joined the other
    # launch's store died with SIGABRT ("terminate called without an active exception")
    dist.init_process_group(backend, init_method="file://" + os.path.join(out_dir, "store"), rank=rank,
                            world_size=world_size)
    try:
        result = _run_rank(fn, args)
    finally:
        _stderr_back(saved, err)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


# How launch starts its ranks. "spawn" (a fresh interpreter per rank) is the safe default: a forked child
# cannot use CUDA once the parent has, and it inherits whatever state the parent is in. "fork" skips each
# rank's imports (2-3 s of CPU): for a CPU-only process that already imported what the ranks run (the test
# suite's gloo launches), called from its main thread (ranks forked from a pool thread were seen to exit with
# status 1, cause not found).
START_METHOD = "spawn"


def launch(fn: Callable, world_size: int, *args: Any, device: str | None = None,
           start_method: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` new processes (``start_method``, default :data:`START_METHOD`)
    inside one process group; returns each rank's result (rank 0 first). Spawned ranks import ``fn``
    again, so it must be importable (not notebook-defined). The ranks die with this process."""
    backend = backend_for(device, world_size)
    start_method = start_method or START_METHOD
    # nccl: backend_for has already asked the driver (torch.cuda.is_available / device_count), so a forked rank
    # dies at set_device even though torch.cuda.is_initialized() is still False here
    if start_method == "fork" and (backend == "nccl" or torch.cuda.is_initialized()):
        why = ("NCCL ranks use CUDA, which this process has already queried (a forked rank dies at set_device)"
               if backend == "nccl" else "CUDA was initialised in this process: a forked rank cannot use CUDA")
        raise PlanError(f"launch(start_method='fork'): {why}; use start_method='spawn'")
    with tempfile.TemporaryDirectory(prefix="colabkit-ranks-") as out:
        try:
            mp.start_processes(_entry, args=(world_size, backend, out, os.getpid(), fn, args),
                               nprocs=world_size, join=True, start_method=start_method)
        except mp.ProcessExitedException as e:  # killed by a signal or os._exit: no Python traceback to show
            words = {r: _last_words(os.path.join(out, f"rank{r}.err")) for r in range(world_size)}
            said = "".join(f"\n--- rank {r}'s last output ---\n{w}" for r, w in words.items() if w)
            raise RuntimeError(f"launch: {e}" + (said or " (no output on its standard error)")) from e
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_world() -> int | None:
    """The world size when this process is one rank started by ``torchrun`` (env:// rendezvous
    variables set, no process group yet), else None.

    >>> torchrun_world() is None
    True
    """
    if dist.is_initialized() or not all(k in os.environ for k in TORCHRUN_VARS):
        return None
    return int(os.environ["WORLD_SIZE"])


def run_here(fn: Callable, *args: Any, device: str | None = None) -> Any:
    """This rank's part of a ``torchrun`` launch: start the process group from the environment
    (env://), run ``fn(*args)``, end the group; every rank returns its own result."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = backend_for(device, local)  # GPUs needed on this node: one per local rank
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        _share_cores(local)
    dist.init_process_group(backend, init_method="env://")
    return _run_rank(fn, args)


def _launch_or_here(fn: Callable, world_size: int, *args: Any, device: str | None = None) -> list[Any] | Any:
    """Every rank's result from a spawn of ``world_size`` processes, or, under torchrun, this rank's."""
    if torchrun_world() is not None:
        return run_here(fn, *args, device=device)
    return launch(fn, world_size, *args, device=device)


class RankData:
    """This rank's rows of the effective batch: ``batch(b, ...)`` draws the global batch of
    ``b * world_size`` sequences (the same one a single process sees) and keeps rows rank*b:(rank+1)*b."""

    def __init__(self, data: TextData | None = None, rank: int | None = None, world_size: int | None = None,
                 on_first: Callable[[], None] | None = None):
        self.data = data or TextData()
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.on_first = on_first  # called once, when the first step asks for its rows (the setup is over)

    def batch(self, batch: int, seq: int, step: int, seed: int = 0, device: str | torch.device = "cpu"):
        if self.on_first is not None:
            self.on_first, first = None, self.on_first
            first()
        x, y = self.data.batch(batch * self.world_size, seq, step=step, seed=seed, device=device)
        rows = slice(self.rank * batch, (self.rank + 1) * batch)
        return x[rows], y[rows]


def per_rank_batch(batch: int, world_size: int) -> int:
    """The micro-batch of each rank; a clear error when the batch does not split evenly.

    >>> per_rank_batch(8, 2)
    4
    """
    if batch % world_size:
        raise PlanError(f"batch {batch} does not split over {world_size} ranks: use a batch divisible by "
                        f"{world_size} (e.g. {max(world_size, batch - batch % world_size)})")
    return batch // world_size


def global_mean(x: float) -> float:
    """The mean of ``x`` over the ranks (all-reduce): equal token counts per rank make it the global loss."""
    t = rank_tensor([float(x)], dtype=torch.float64)  # on cuda:<rank> under nccl (NCCL's rule)
    collective("all_reduce", t)
    return float(t) / dist.get_world_size()


class CommCounter(TorchDispatchMode):
    """Counts the bytes each collective moves through this rank (c10d ops seen by the dispatcher): the
    full buffer of an all-gather (output), reduce-scatter (input), broadcast; an all-reduce counts twice
    (a reduce-scatter then an all-gather, as the ZeRO paper counts it). ``bytes`` maps op -> bytes."""

    WEIGHT = {"allreduce_": 2}

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.setup: dict[str, int] = {}  # what moved before the first step (DDP's broadcast of the weights)

    def end_setup(self) -> None:
        """What was counted so far was the setup's; the steps' counts start now."""
        self.setup, self.bytes = self.bytes, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if "reduce_scatter" in name or "allreduce" in name or "broadcast" in name:
                n = tensors[0].nbytes if "_base" in name or "tensor" in name else sum(t.nbytes for t in tensors[:1])
                if "reduce_scatter" in name and "_base" in name:
                    n = tensors[1].nbytes  # (output shard, input full)
            else:  # all-gathers: the gathered output buffer
                n = tensors[0].nbytes if "_base" in name or "into_tensor" in name else sum(t.nbytes for t in tensors[:-1])
            self.bytes[name] = self.bytes.get(name, 0) + self.WEIGHT.get(name, 1) * n
        return out


def bench_ranks(model: str, plans: Sequence[str], batch: int, seq: int, steps: int, device: str | None,
                seed: int = 0) -> list[dict[str, Any]]:
    """Run inside each rank: ``measure`` every plan on this rank's rows (several plans per spawn)."""
    records = []
    for plan in plans:
        with CommCounter() as comm:
            r = measure(model, plan, batch=batch // dist.get_world_size(), seq=seq, steps=steps,
                        device=rank_device(device), seed=seed, data=RankData(on_first=comm.end_setup))
        ran = steps + (r.get("timing_steps") or 0)  # the tracked steps and the untracked ones timing them (CUDA)
        r["comm_bytes"] = {k: v // ran for k, v in comm.bytes.items()}  # per optimizer step
        r["comm_setup_bytes"] = comm.setup  # once, before the first step
        ok = rank_tensor([int(bool(r["ok"]))])
        collective("all_reduce", ok, reduce="min")  # every rank reaches the collective; failed ranks vote 0
        if ok.item():
            r["loss"] = global_mean(r["loss"])
        r.update(batch=batch, rank=dist.get_rank(), world_size=dist.get_world_size())
        records.append(r)
    return records


def _merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One bench record for a plan: the largest rank's figures, every rank's in ``per_rank``."""
    ok = [r for r in ranks if r["ok"]]
    top = dict(max(ok, key=lambda r: r["peak_bytes"]) if len(ok) == len(ranks) else
               next(r for r in ranks if not r["ok"]))
    top["ok"] = len(ok) == len(ranks)
    top["per_rank"] = [{k: r.get(k) for k in ("rank", "peak_bytes", "breakdown", "comm_bytes", "comm_setup_bytes", "loss",
                                              "step_time_s", "ok", "error")}
                       for r in ranks]
    return top


def _sharded_only(plans: Sequence[str]) -> None:
    for p in plans:
        check_batch(Plan.parse(p), 0, world_size=2)  # (0: every accum divides it) a zero:N token, or refused


def bench_sharded(model: str, plans: Sequence[str], world_size: int = 2, batch: int = 8, seq: int = 128,
                  steps: int = 2, device: str | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """``bench --world-size N``: one record per plan, measured on N processes in one spawn.

    ``loss`` is the all-reduced mean over the ranks (the single-process loss of the same batch);
    ``breakdown``/``peak_bytes`` are the largest rank's, ``per_rank`` lists every rank's."""
    plans = [str(Plan.parse(p)) for p in plans]
    _sharded_only(plans)
    per_rank_batch(batch, world_size)
    ranks = launch(bench_ranks, world_size, model, plans, batch, seq, steps, device, seed, device=device)
    return [_merge([ranks[r][i] for r in range(world_size)]) for i in range(len(plans))]


# ----- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------
def _zero1(trainer: Trainer) -> bool:
    return trainer.plan.get("zero") == 1


# What the ``.metadata`` pickle of a DCP checkpoint names (torch.distributed.checkpoint writes it with
# pickle and reads it with pickle.load): its own metadata classes, torch sizes/dtypes/layouts, paths.
_DCP_GLOBALS = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refused for safety: the sharded checkpoint's metadata asks to load {module}.{name}, "
                              "which a torch.distributed.checkpoint never holds (loading it could run code)")


def check_metadata(dcp_dir: str) -> None:
    """Read a DCP checkpoint's ``.metadata`` as data before torch does (torch un-pickles it): a file that
    names anything but DCP's own metadata types is refused with a :class:`CheckpointError`."""
    path = os.path.join(dcp_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata file "
                              f"({type(e).__name__}: {e})") from None


def save_sharded(trainer: Trainer, directory: str) -> str:
    """Write a sharded run's state: model (and FSDP2 optimizer) shards through DCP into
    ``directory/dcp`` (each rank writes its own shards), plus each rank's step, CPU and CUDA RNG, the
    GradScaler's state (fp16's loss scale) and, for zero:1,
    its ZeroRedundancyOptimizer shard in ``directory/rank<r>.pt``. Call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(trainer.model)}
    if not _zero1(trainer):
        state["optim"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))
    cuda = trainer.ctx.device.type == "cuda"
    local = {"step": trainer.step_count, "plan": str(trainer.plan), "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state(trainer.ctx.device) if cuda else None,
             "scaler": trainer.scaler.state_dict(),  # fp16: the loss scale and its growth tracker
             "world_size": dist.get_world_size(),
             "optim": trainer.optimizer.optim.state_dict() if _zero1(trainer) else None}
    path = os.path.join(directory, f"rank{dist.get_rank()}.pt")
    torch.save(local, path + ".tmp")
    os.replace(path + ".tmp", path)
    collective("barrier")
    return directory


def load_sharded(trainer: Trainer, directory: str) -> bool:
    """Resume a sharded run written by :func:`save_sharded` (same plan and world size); False if none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    path = os.path.join(directory, f"rank{dist.get_rank()}.pt")
    if not os.path.exists(path):
        return False
    check_metadata(os.path.join(directory, "dcp"))
    local = torch.load(path, weights_only=True)
    if local["plan"] != str(trainer.plan) or local["world_size"] != dist.get_world_size():
        raise PlanError(f"checkpoint in {directory} was written by plan {local['plan']!r} on {local['world_size']} "
                        f"ranks; this run is {str(trainer.plan)!r} on {dist.get_world_size()}: resume with the same "
                        "plan and world size, or consolidate() it and start from the weights")
    state: dict[str, Any] = {"model": get_model_state_dict(trainer.model)}
    if not _zero1(trainer):
        state["optim"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))  # in place, into this rank's shards
    set_model_state_dict(trainer.model, state["model"])
    if _zero1(trainer):
        trainer.optimizer.optim.load_state_dict(local["optim"])
    else:
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optim"])
    torch.set_rng_state(local["rng_cpu"])
    if local.get("rng_cuda") is not None and trainer.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(local["rng_cuda"], trainer.ctx.device)
    if local.get("scaler"):
        trainer.scaler.load_state_dict(local["scaler"])
    trainer.step_count = local["step"]
    return True


def consolidate(directory: str, out_path: str | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, in one process (no process group needed),
    via ``dcp_to_torch_save``; ``model.load_state_dict(consolidate(d))`` gives the trained model for
    inference on one GPU or the CPU."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out_path = out_path or os.path.join(directory, "consolidated.pt")
    check_metadata(os.path.join(directory, "dcp"))
    dcp_to_torch_save(os.path.join(directory, "dcp"), out_path)
    return torch.load(out_path, weights_only=True)["model"]


def train_ranks(model: str, plan: str, steps: int, batch: int, seq: int, seed: int, device: str | None,
                lr: float, checkpoint_dir: str | None, checkpoint_every: int, resume: bool) -> dict[str, Any]:
    """Run inside each rank: a training run on this rank's rows, global-mean losses, sharded checkpoints."""
    dev = rank_device(device)
    torch.manual_seed(seed)
    trainer = Trainer(load_model(model, plan, seq=seq, device=dev), plan, device=dev, lr=lr, model_name=model)
    if resume and checkpoint_dir:
        load_sharded(trainer, checkpoint_dir)
    data, losses = RankData(), []
    for step in range(trainer.step_count, steps):
        x, y = data.batch(batch // dist.get_world_size(), seq, step=step, seed=seed, device=dev)
        losses.append(global_mean(trainer.step(x, y)))
        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:
            save_sharded(trainer, checkpoint_dir)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"step": trainer.step_count, "loss": losses[-1] if losses else None, "losses": losses,
            "rank": dist.get_rank(), "scale": trainer.scaler.get_scale(),
            "weights_sha256": _state_sha256(full) if dist.get_rank() == 0 else None}


def _state_sha256(state: dict[str, torch.Tensor]) -> str:
    holder = torch.nn.Module()  # weights_sha256 hashes a module's state dict: give it one
    holder.state_dict = lambda: state  # type: ignore[method-assign]
    return weights_sha256(holder)


def train_sharded(model: str, plan: str, world_size: int = 2, steps: int = 10, batch: int = 8, seq: int = 128,
                  seed: int = 0, device: str | None = None, lr: float = 3e-4, checkpoint_dir: str | None = None,
                  checkpoint_every: int = 0, resume: bool = False) -> dict[str, Any]:
    """``train --world-size N``: rank 0's result (losses are global means; ``weights_sha256`` hashes the
    consolidated full weights, so it compares with a single-process run's). Under ``torchrun`` the
    world size is torchrun's and every rank returns its own result (``rank`` says whose)."""
    world_size = torchrun_world() or world_size
    _sharded_only([plan])
    per_rank_batch(batch, world_size)
    out = _launch_or_here(train_ranks, world_size, model, str(Plan.parse(plan)), steps, batch, seq, seed, device,
                          lr, checkpoint_dir, checkpoint_every, resume, device=device)
    return out[0] if isinstance(out, list) else out

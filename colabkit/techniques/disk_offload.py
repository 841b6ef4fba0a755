"""``offload:disk``: AdamW's state lives in a memory-mapped file, streamed chunk by chunk.

The two Adam moments (8 B per parameter) sit in one file in ``COLABKIT_OFFLOAD_DIR`` (default: a
temporary folder; on Colab use the VM's local SSD, not Drive). A step walks the parameters in chunks of
``chunk_elems`` elements: while chunk i is updated, a background thread reads chunk i+1 into the other
of two buffers, and writes chunk i back after it (double buffering, as DeepSpeed's ZeRO-Infinity
pipelines NVMe reads and writes). Neither device memory nor host RAM ever holds the whole state: RAM
holds the two chunk buffers; pages of the file the step touched are handed back to the kernel
(``MADV_DONTNEED``) as soon as their chunk is written and again after the step, so the process's
resident memory stays flat (the kernel's page cache may keep recently written pages: reclaimable).

The update itself is torch's own AdamW kernel (``torch.optim.adamw.adamw``, single-tensor path) on
flat slices of each parameter, so the weights equal ``torch.optim.AdamW``'s (tested over many steps).

>>> import tempfile
>>> m = torch.nn.Linear(8, 4)
>>> opt = DiskAdamW(m.parameters(), lr=0.1, directory=tempfile.mkdtemp(), chunk_elems=16)
>>> m(torch.ones(2, 8)).sum().backward(); opt.step()
>>> opt.file_bytes == 8 * sum(p.numel() for p in m.parameters()), opt.n_chunks
(True, 3)
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch
from torch.optim.adamw import adamw as _adamw  # torch's own AdamW math (functional form)

from ..plan import Context, Plan, PlanError, Technique, register, flag
from .optimizers import state_bytes_per_param

PAGE = mmap.PAGESIZE
CHUNK_ELEMS = 1 << 16  # 64 Ki elements: 512 KiB of state per chunk (two fp32 moments)


def offload_dir(directory: str | None = None) -> str:
    """Where offloaded state goes (created if missing): ``directory``, else ``$COLABKIT_OFFLOAD_DIR``,
    else a fresh temporary folder (removed again when the optimizer that asked for it is closed)."""
    d = directory or os.environ.get("COLABKIT_OFFLOAD_DIR")
    if not d:
        return tempfile.mkdtemp(prefix="colabkit-offload-")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise PlanError(_unusable(d, e)) from None
    return d


def _unusable(directory: str, e: OSError) -> str:
    return (f"'offload:disk' cannot keep its state file in {directory!r} ({e.strerror or e}): set "
            "COLABKIT_OFFLOAD_DIR to a writable folder on a local disk with room for 8 B per parameter "
            "(on Colab e.g. /content/offload, not Drive), or unset it for a temporary folder")


class DiskAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in a memory-mapped file; see the module docstring.

    ``chunks`` lists ``(param, start, stop, file_offset)``: flat element ranges of each parameter,
    at most ``chunk_elems`` long, each starting on a page boundary of the file (exp_avg, then exp_avg_sq).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, directory: str | None = None,
                 chunk_elems: int = CHUNK_ELEMS, prefetch: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        own_dir = directory is None and not os.environ.get("COLABKIT_OFFLOAD_DIR")
        self.directory = offload_dir(directory)
        self.prefetch = prefetch
        self.chunks: list[tuple[torch.Tensor, int, int, int]] = []
        offset = 0
        for p in (p for g in self.param_groups for p in g["params"]):
            for a in range(0, p.numel(), chunk_elems):
                b = min(p.numel(), a + chunk_elems)
                self.chunks.append((p, a, b, offset))
                offset += -(-(8 * (b - a)) // PAGE) * PAGE  # page-aligned: each chunk can be dropped alone
        self.n_chunks = len(self.chunks)
        self.file_bytes = 8 * sum(b - a for _, a, b, _ in self.chunks)  # payload; the file adds page padding
        self.path = os.path.join(self.directory, f"adamw-state-{os.getpid()}-{id(self):x}.bin")
        try:
            with open(self.path, "wb") as f:
                # reserve the blocks now: a sparse file on a full disk would only fail when a chunk is
                # written through the mapping, and that kills the process (SIGBUS) instead of raising
                _reserve(f.fileno(), max(offset, PAGE))
            self._file = open(self.path, "r+b")
        except OSError as e:
            _release(None, None, None, self.path, self.directory if own_dir else None)
            raise PlanError(_unusable(self.directory, e)) from None
        self._mm = mmap.mmap(self._file.fileno(), 0)
        # host buffers for two chunks (current + prefetched): the only RAM the state ever takes
        biggest = max((b - a for _, a, b, _ in self.chunks), default=0)
        pin = any(p.is_cuda for p, *_ in self.chunks) and torch.cuda.is_available()
        self._buffers = [torch.zeros(2, biggest, pin_memory=pin) for _ in range(2)]
        self._steps: dict[int, int] = {}  # id(param) -> Adam step count
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colabkit-disk") if prefetch else None
        self._finalizer = weakref.finalize(self, _release, self._pool, self._mm, self._file, self.path,
                                           self.directory if own_dir else None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "chunks"):  # after __init__ the file layout is fixed: a new group would never be updated
            raise NotImplementedError("DiskAdamW lays out its state file when it is created: pass every parameter "
                                      "group to the constructor (e.g. unfreeze layers, then build the optimizer)")
        super().add_param_group(param_group)

    # ----- file IO: the only code that touches the file ---------------------------------------
    def _view(self, k: int) -> torch.Tensor:
        """Chunk k's (2, n) moments, as a tensor over the mapped file (no copy)."""
        _, a, b, off = self.chunks[k]
        return torch.frombuffer(self._mm, dtype=torch.float32, count=2 * (b - a), offset=off).view(2, b - a)

    def _read(self, k: int, buf: torch.Tensor) -> torch.Tensor:
        n = self.chunks[k][2] - self.chunks[k][1]
        out = buf[:, :n]
        out.copy_(self._view(k))
        return out

    def _write(self, k: int, buf: torch.Tensor) -> None:
        _, a, b, off = self.chunks[k]
        self._view(k).copy_(buf[:, : b - a])
        length = -(-(8 * (b - a)) // PAGE) * PAGE
        self._mm.madvise(mmap.MADV_DONTNEED, off, length)  # written to the page cache; out of this process

    # ----- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        todo = [k for k, (p, *_) in enumerate(self.chunks) if p.grad is not None]
        stepped: set[int] = set()
        run = self._pool.submit if self._pool is not None else (lambda f, *a: _Done(f(*a)))
        pending = run(self._read, todo[0], self._buffers[0]) if todo else None
        for i, k in enumerate(todo):
            state = pending.result()
            if i + 1 < len(todo):  # FIFO worker: this read runs after the previous chunk's write
                pending = run(self._read, todo[i + 1], self._buffers[(i + 1) % 2])
            p, a, b, _ = self.chunks[k]
            g = group_of[id(p)]
            step = self._steps.get(id(p), 0)
            flat = p.view(-1)[a:b]
            m, v = state[0].to(p.device, non_blocking=True), state[1].to(p.device, non_blocking=True)
            _adamw([flat], [p.grad.view(-1)[a:b]], [m], [v], [],
                                    [torch.tensor(float(step))], foreach=False, capturable=False,
                                    differentiable=False, fused=None, grad_scale=None, found_inf=None,
                                    amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1], lr=g["lr"],
                                    weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)
            if m.device != state.device:
                state[0].copy_(m)
                state[1].copy_(v)
            stepped.add(id(p))
            run(self._write, k, state)
        if self._pool is not None and todo:
            self._pool.submit(lambda: None).result()  # every write of this step is in the file
        # a read fault also maps up to 64 KiB of neighbouring cached pages (the kernel's fault-around):
        # drop what is left so that between steps no page of the state stays in this process
        self._mm.madvise(mmap.MADV_DONTNEED)
        for pid in stepped:
            self._steps[pid] = self._steps.get(pid, 0) + 1
        return loss

    # ----- what the tracker, the checkpoints and the estimator see -----------------------------
    def state_tensors(self):
        """The RAM the state takes: the two chunk buffers (the file is on disk)."""
        return iter(self._buffers)

    def state_dict(self) -> dict[str, Any]:
        """Like AdamW's (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter index), read from the file
        one parameter at a time, so a checkpoint of a plan with ``offload:disk`` resumes exactly."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, (p, a, b, _) in enumerate(self.chunks):
            if id(p) not in self._steps:
                continue
            s = state.setdefault(index[id(p)], {"step": torch.tensor(float(self._steps[id(p)])),
                                                "exp_avg": torch.empty(p.numel()), "exp_avg_sq": torch.empty(p.numel())})
            mv = self._view(k)
            s["exp_avg"][a:b].copy_(mv[0])
            s["exp_avg_sq"][a:b].copy_(mv[1])
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            if i in state:
                state[i]["exp_avg"] = state[i]["exp_avg"].view_as(p)
                state[i]["exp_avg_sq"] = state[i]["exp_avg_sq"].view_as(p)
        self._mm.madvise(mmap.MADV_DONTNEED)  # the pages just read leave this process again
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for g, sg in zip(self.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in sg.items() if k != "params"})
        state = {int(i): s for i, s in sd["state"].items()}  # int keys, or str after a JSON round trip
        self._steps = {}
        for k, (p, a, b, _) in enumerate(self.chunks):
            s, view = state.get(index[id(p)]), self._view(k)
            if s is None:
                view.zero_()
                continue
            view[0].copy_(s["exp_avg"].reshape(-1)[a:b])
            view[1].copy_(s["exp_avg_sq"].reshape(-1)[a:b])
            self._steps[id(p)] = int(s["step"])
        self._mm.flush()
        self._mm.madvise(mmap.MADV_DONTNEED)  # written back; out of this process's resident memory

    def close(self) -> None:
        """Unmap and delete the state file (also done when the optimizer is collected, or at exit)."""
        self._finalizer()


def _reserve(fd: int, size: int) -> None:
    """Give the file ``size`` bytes of real disk blocks (ENOSPC now, not SIGBUS later)."""
    os.ftruncate(fd, size)
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows: the sparse file it is
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        # EOPNOTSUPP/EINVAL (a file system without fallocate): keep the sparse file


def _release(pool: ThreadPoolExecutor | None, mm: mmap.mmap | None, f: Any, path: str,
             own_dir: str | None = None) -> None:
    """Stop the IO thread, unmap, delete the state file and the temporary folder colabkit made for it."""
    if pool is not None:
        pool.shutdown(wait=True)
    for handle in (mm, f):
        if handle is not None:
            handle.close()
    if os.path.exists(path):
        os.remove(path)
    if own_dir is not None and os.path.isdir(own_dir) and not os.listdir(own_dir):
        os.rmdir(own_dir)


class _Done:
    """A finished future, for the path without a prefetch thread."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def disk_state_bytes(n_params: int) -> int:
    """Bytes of the state file for ``n_params`` trainable parameters: two fp32 moments, 8 B each."""
    return int(state_bytes_per_param("adamw") * n_params)


# ----- the plan token ------------------------------------------------------------------------------
def _check(plan: Plan, ctx: Context) -> None:
    if plan.optimizer != "adamw":
        raise PlanError(f"'offload:disk' keeps AdamW's two moments on disk; {plan.optimizer!r} has its own state "
                        "format: drop the optimizer token (offload:disk is AdamW) or drop offload:disk")
    if "optimizer" in (plan.get("offload") or ()):
        raise PlanError("'offload:disk' and 'offload:optimizer' both own the optimizer state: keep one "
                        "(offload:optimizer for host RAM, offload:disk when host RAM is too small)")
    if "fused-step" in plan:
        raise PlanError("'offload:disk' with 'fused-step' would read and write the state file once per parameter "
                        "inside backward, stalling it on the disk: keep one")
    if "lora" in plan or "qlora" in plan:
        raise PlanError("'offload:disk' with lora/qlora: adapter state is already tiny; drop offload:disk")


def _wrap(optimizer: Any, model: torch.nn.Module, plan: Plan, ctx: Context) -> DiskAdamW:
    """Take over the plan's AdamW (it has allocated no state yet): same groups, lr, betas, decay."""
    return DiskAdamW([dict(g) for g in optimizer.param_groups], **{k: optimizer.defaults[k] for k in
                                                                  ("lr", "betas", "eps", "weight_decay")})


register(Technique(
    name="offload:disk",
    help="AdamW state in a memory-mapped file, streamed chunk by chunk with prefetch (host RAM and GPU keep 2 chunks)",
    parse=flag,
    check=_check,
    wrap_optimizer=_wrap,
    order=46,
))


def disk_bandwidth(directory: str | None = None, nbytes: int = 64 * 2**20) -> tuple[float, float]:
    """``(write, read)`` bytes per second of the disk behind ``directory`` (default: :func:`offload_dir`):
    ``nbytes`` written and fsynced, then read back, timed by the wall clock (waiting for a disk is not
    CPU time). The read may come from the page cache, faster than the disk: the write is the honest figure.

    >>> w, r = disk_bandwidth(tempfile.mkdtemp(), nbytes=1 << 16)
    >>> w > 0 and r > 0
    True
    """
    import time

    path, data = os.path.join(offload_dir(directory), "colabkit-bandwidth.bin"), os.urandom(nbytes)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        f.read()
    t2 = time.perf_counter()
    os.remove(path)
    return nbytes / (t1 - t0), nbytes / (t2 - t1)

"""``offload:disk``: AdamW's state lives in a memory-mapped file, updated in place or streamed chunk by chunk.

The two Adam moments (8 B per parameter) sit in one file in ``COLABKIT_OFFLOAD_DIR`` (default: a
temporary folder; on Colab use the VM's local SSD, not Drive), mapped once for the optimizer's life.
The state is never an anonymous copy in RAM: on a CPU the update runs on the file's own pages (page
cache, which the kernel writes back to the file and can reclaim), on a GPU two chunk buffers stage it.

* Parameters in host RAM (a CPU run), state at most a quarter of the available RAM (``MemAvailable``,
  checked every step; ``resident=True``/``False`` forces it): the file's pages **stay mapped** between
  steps and one fused AdamW call per parameter group updates them in place — no copy, no page mapped in or
  out per step (that costs 10-15 ms per 240 MB of state: per 4 KiB block, ext4's write fault and its
  undo). Those pages are page cache of the file, shown in the process's RSS as file pages (``RssFile``),
  not ``RssAnon``: the kernel would cache the file in that RAM anyway, writes the dirty ones back, and
  reclaims them under memory pressure.
* Parameters in host RAM, RAM tighter than that: the step walks the parameters in chunks of
  ``chunk_elems`` elements (1 Mi: 8 MiB of state), each starting on a page of the file; a background
  thread maps chunk i+1 writable in one call (``MADV_POPULATE_WRITE``, reading it from disk if needed;
  double buffering, as DeepSpeed's ZeRO-Infinity pipelines NVMe reads and writes) while chunk i is
  updated in place, and hands chunk i's pages back after it (``MADV_DONTNEED``): at most two chunks of the
  state are in this process at a time and none between steps.
* Parameters on a GPU: chunk i+1 is copied into a pinned buffer by the background thread, goes to the
  GPU with a non-blocking copy, is updated there, and comes back on the :class:`DevicePair`'s side
  stream; the background thread waits for that copy's event before it writes the chunk back. Host RAM
  and the GPU hold two chunks of state. The main thread never blocks on the GPU inside a step (the old
  code synchronised twice per 64 Ki-element chunk); it waits once, at the end of the step, for the last
  write.

The update itself is torch's own fused AdamW kernel (``torch._fused_adamw_``, what
``torch.optim.AdamW(fused=True)`` calls; the single-tensor path where torch has no fused kernel) on
flat slices of each parameter, so the weights equal ``torch.optim.AdamW``'s (tested over many steps).
When streaming, chunks under 128 Ki elements (norms, biases) skip the IO thread: their few pages fault
in, and are dropped together.

>>> import tempfile
>>> m = torch.nn.Linear(16, 8)
>>> opt = DiskAdamW(m.parameters(), lr=0.1, directory=tempfile.mkdtemp(), chunk_elems=64)
>>> m(torch.ones(2, 16)).sum().backward(); opt.step()
>>> opt.file_bytes == 8 * sum(p.numel() for p in m.parameters()), opt.n_chunks
(True, 3)
>>> opt.close()
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch
from torch.optim.adamw import adamw as _adamw  # torch's own AdamW math (functional form)
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from ..plan import Context, Plan, PlanError, Technique, register, flag
from ..device import DevicePair
from .optimizers import state_bytes_per_param

PAGE = mmap.PAGESIZE
CHUNK_ELEMS = 1 << 20  # 1 Mi elements: 8 MiB of state per chunk (two fp32 moments)
LANES = 64  # chunk lengths are rounded up to a multiple of this (any CPU's SIMD width, in floats)
SMALL_ELEMS = 1 << 17  # chunks under 128 Ki elements (1 MiB of state) skip the prefetch thread
RESIDENT_SHARE = 4  # a CPU run keeps the file's pages mapped while the state is <= 1/4 of the available RAM
# Linux >= 5.14: populate the page tables of a range, writable, in one call (Python's mmap module
# names it from 3.13 on); elsewhere the pages are faulted in on first touch.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def ram_window_bytes(shapes: Iterable[Any], chunk_elems: int = CHUNK_ELEMS) -> int:
    """RAM the state takes during a streamed step: two chunks of (exp_avg, exp_avg_sq), fp32 — mapped pages
    of the file on a CPU run short of RAM (with RAM to spare the whole file stays mapped: page cache, see
    :data:`RESIDENT_SHARE`), pinned buffers (and per chunk the same on the GPU) on a GPU run.

    >>> ram_window_bytes([(4096, 1024), (10,)]) == 2 * 8 * (1 << 20)
    True
    """
    biggest = max((math.prod(s) for s in shapes), default=0)
    return 2 * 8 * min(chunk_elems, biggest)


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
    at most ``chunk_elems`` long (rounded up to a multiple of ``LANES``), each starting on a page boundary
    of the file (exp_avg, then exp_avg_sq).
    ``pair``: the :class:`DevicePair` of the staged path (made for GPU parameters; pass
    ``DevicePair("cpu")`` to run that path on a CPU against the CUDA twin).
    ``resident`` (CPU parameters): keep the file's pages mapped between steps (``True``), stream them chunk
    by chunk (``False``), or decide each step by the available RAM (``None``: :data:`RESIDENT_SHARE`).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, directory: str | None = None,
                 chunk_elems: int = CHUNK_ELEMS, prefetch: bool = True, pair: DevicePair | None = None,
                 resident: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        own_dir = directory is None and not os.environ.get("COLABKIT_OFFLOAD_DIR")
        self.directory = offload_dir(directory)
        self.prefetch = prefetch
        self.resident = resident
        self.chunks: list[tuple[torch.Tensor, int, int, int]] = []
        offset = 0
        # whole multiples of LANES: the fused kernel's vector lanes then cover the same elements as for the
        # whole tensor (its scalar tail only at the tensor's end), so the result is bitwise torch's
        chunk_elems = -(-chunk_elems // LANES) * LANES
        for p in (p for g in self.param_groups for p in g["params"]):
            for a in range(0, p.numel(), chunk_elems):
                b = min(p.numel(), a + chunk_elems)
                self.chunks.append((p, a, b, offset))
                offset += _pages(b - a)  # page-aligned: each chunk can be mapped and dropped alone
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
        self._mm = mmap.mmap(self._file.fileno(), 0)  # mapped once, for the optimizer's life
        # each chunk's (2, n) moments as a tensor over the mapping, made once (no copy, no page touched)
        self._views = [torch.frombuffer(self._mm, dtype=torch.float32, count=2 * (b - a), offset=off).view(2, b - a)
                       for _, a, b, off in self.chunks]
        self._mapped = False  # in-place path: every page of the file is mapped (no drop since)
        self._populate = MADV_POPULATE_WRITE
        gpu = next((p.device for p, *_ in self.chunks if p.device.type == "cuda"), None)
        self.pair = pair if pair is not None else DevicePair(gpu) if gpu is not None else None
        # staged path: pinned buffers for two chunks (current + prefetched), the only RAM the state takes
        biggest = max((b - a for _, a, b, _ in self.chunks), default=0)
        self._buffers = [self.pair.host_empty((2, biggest), torch.float32) for _ in range(2)] if self.pair else []
        self.window_bytes = 2 * 8 * biggest  # RAM that two chunks of state take during a step
        self._steps: dict[int, int] = {}  # id(param) -> Adam step count
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colabkit-disk") if prefetch else None
        self._finalizer = weakref.finalize(self, _release, self._pool, self._mm, self._file, self.path,
                                           self.directory if own_dir else None, self._views)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "chunks"):  # after __init__ the file layout is fixed: a new group would never be updated
            raise NotImplementedError("DiskAdamW lays out its state file when it is created: pass every parameter "
                                      "group to the constructor (e.g. unfreeze layers, then build the optimizer)")
        super().add_param_group(param_group)

    # ----- file IO: the only code that touches the file (the background thread runs it) --------
    def _view(self, k: int) -> torch.Tensor:
        """Chunk k's (2, n) moments, as a tensor over the mapped file (no copy)."""
        return self._views[k]

    def _keep_mapped(self) -> bool:
        """CPU path: keep the file's pages mapped between steps? ``resident`` if given, else while the file
        takes at most 1/:data:`RESIDENT_SHARE` of the available RAM (unknown: stream, the safe side)."""
        if self.resident is not None:
            return self.resident
        avail = _mem_available()
        return avail is not None and RESIDENT_SHARE * len(self._mm) <= avail

    def _drop_all(self) -> None:
        """Every page of the state leaves this process (the page cache keeps them, bound for the file)."""
        self._mm.madvise(mmap.MADV_DONTNEED)
        self._mapped = False

    def _map_in(self, k: int) -> None:
        """Map chunk k's pages writable now (reading them from disk if needed): one call, not a page
        fault per 4 KiB when the update touches them."""
        if self._populate is not None:
            _, a, b, off = self.chunks[k]
            try:
                self._mm.madvise(self._populate, off, _pages(b - a))
            except OSError:  # a kernel before 5.14: fault the pages in on first touch
                self._populate = None

    def _small(self, k: int) -> bool:
        """Chunk k is small (under 1 MiB of state): no prefetch and no drop of its own; handing it to the
        IO thread costs more than the few page faults it saves."""
        return self.chunks[k][2] - self.chunks[k][1] < SMALL_ELEMS

    def _drop(self, k: int) -> None:
        """Chunk k's pages leave this process (written ones stay in the page cache, bound for the file)."""
        _, a, b, off = self.chunks[k]
        self._mm.madvise(mmap.MADV_DONTNEED, off, _pages(b - a))

    def _read(self, k: int, buf: torch.Tensor) -> torch.Tensor:
        """Staged path: chunk k into a pinned buffer."""
        self._map_in(k)
        n = self.chunks[k][2] - self.chunks[k][1]
        out = buf.view(-1)[:2 * n].view(2, n)  # contiguous (buf[:, :n] is not: its copy would block on CUDA)
        out.copy_(self._view(k))
        return out

    def _write_back(self, k: int, buf: torch.Tensor, event: Any) -> None:
        """Staged path: once the copy back from the GPU has landed (``event``), chunk k to the file."""
        self.pair.wait_host(event)
        self._view(k).copy_(buf)
        self._drop(k)

    # ----- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        todo = [k for k, (p, *_) in enumerate(self.chunks) if p.grad is not None]
        stepped = {id(self.chunks[k][0]) for k in todo}
        if self.pair is None and self._keep_mapped():  # CPU, RAM to spare: in place on the kept-mapped pages
            self._step_in_place(todo)
            for pid in stepped:
                self._steps[pid] = self._steps.get(pid, 0) + 1
            return loss
        # chunk by chunk with prefetch: the staged (GPU) path, and the CPU path when RAM is tight
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        run = self._pool.submit if self._pool is not None else (lambda f, *a: _Done(f(*a)))
        staged = self.pair is not None
        if staged:  # chunk i into pinned buffer i % 2
            bring = lambda i: run(self._read, todo[i], self._buffers[i % 2])  # noqa: E731
        else:  # chunk i's pages mapped, writable; a small chunk (a norm, a bias) faults its few pages in
            bring = lambda i: _Done(None) if self._small(todo[i]) else run(self._map_in, todo[i])  # noqa: E731
        lazy = [0, 0]  # file range of small chunks not dropped yet: dropped together, not one call each
        step_t: dict[tuple, torch.Tensor] = {}  # (device, step) -> the fused kernel's step tensor
        pending = bring(0) if todo else None
        for i, k in enumerate(todo):
            state = pending.result()
            if i + 1 < len(todo):  # FIFO worker: this read runs after the previous chunk's write
                pending = bring(i + 1)
            p, a, b, _ = self.chunks[k]
            g = group_of[id(p)]
            mv = self.pair.to_compute(state) if staged else self._view(k)  # staged: (2, n) on the GPU
            n_step = self._steps.get(id(p), 0) + 1
            if (p.device, n_step) not in step_t:  # one fill per step, not a blocking host-to-device copy per chunk
                step_t[(p.device, n_step)] = torch.full((), float(n_step), device=p.device)
            _update(p.view(-1)[a:b], p.grad.view(-1)[a:b], mv, n_step, g, step_t[(p.device, n_step)])
            if staged:
                with self.pair.side():  # back to the pinned buffer, after the update
                    self.pair.copy_(state, mv)
                self.pair.lend(mv)
                landed = self.pair.done()
                del mv  # freed now, while the copy may still be queued: record_stream keeps its memory
                run(self._write_back, k, state, landed)
            elif self._small(k):
                off = self.chunks[k][3]
                lazy = [off, off] if lazy[0] == lazy[1] else lazy
                lazy[1] = off + _pages(b - a)
                if lazy[1] - lazy[0] >= 8 * CHUNK_ELEMS:  # at most 8 MiB of them in this process
                    self._mm.madvise(mmap.MADV_DONTNEED, lazy[0], lazy[1] - lazy[0])
                    lazy = [0, 0]
            else:
                run(self._drop, k)
        if self._pool is not None and todo:
            self._pool.submit(lambda: None).result()  # every write of this step is in the file
        # a read fault also maps up to 64 KiB of neighbouring cached pages (the kernel's fault-around):
        # drop what is left so that between steps no page of the state stays in this process
        self._drop_all()
        for pid in stepped:
            self._steps[pid] = self._steps.get(pid, 0) + 1
        return loss

    def _step_in_place(self, todo: list[int]) -> None:
        """CPU, pages kept mapped: map the whole file once (one call; again only after a drop), then one
        fused AdamW call per parameter group over every chunk's slice and mapped moments, as
        ``torch.optim.AdamW(fused=True)`` makes one call for all its tensors."""
        if not self._mapped:
            if self._populate is not None:
                try:
                    self._mm.madvise(self._populate)
                except OSError:  # a kernel before 5.14: the pages fault in on first touch
                    self._populate = None
            self._mapped = True
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        batches: dict[int, tuple[list, ...]] = {}
        steps: dict[int, torch.Tensor] = {}
        for k in todo:
            p, a, b, _ = self.chunks[k]
            mv, n = self._view(k), self._steps.get(id(p), 0) + 1
            if not _fusable(p, p.grad, mv):
                _update(p.view(-1)[a:b], p.grad.view(-1)[a:b], mv, n, self.param_groups[group_of[id(p)]])
                continue
            if n not in steps:
                steps[n] = torch.tensor(float(n))
            batch = batches.setdefault(group_of[id(p)], ([], [], [], [], []))
            for lst, t in zip(batch, (p.view(-1)[a:b], p.grad.view(-1)[a:b], mv[0], mv[1], steps[n])):
                lst.append(t)
        for i, (ps, gs, m1, m2, st) in batches.items():
            g = self.param_groups[i]
            torch._fused_adamw_(ps, gs, m1, m2, [], st, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                                weight_decay=g["weight_decay"], eps=g["eps"], amsgrad=False, maximize=False)

    # ----- what the tracker, the checkpoints and the estimator see -----------------------------
    def state_tensors(self):
        """Tensors the state takes in memory: the two pinned chunk buffers of the staged path; none when
        the update runs in place on the file's pages (those are page cache of the file: all of it while
        they stay mapped, ``window_bytes`` at most while streamed)."""
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
        if not self._mapped:
            self._drop_all()  # streamed: the pages just read leave this process again
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
        if not self._mapped:
            self._drop_all()  # streamed: written back; out of this process's resident memory

    def close(self) -> None:
        """Unmap and delete the state file (also done when the optimizer is collected, or at exit)."""
        self._finalizer()


def _update(p: torch.Tensor, grad: torch.Tensor, mv: torch.Tensor, step: int, g: dict[str, Any],
            step_t: torch.Tensor | None = None) -> None:
    """One AdamW step of a flat slice ``p`` from its (2, n) moments ``mv``, in place: torch's fused kernel
    where torch has it for the device and dtypes (``torch.optim.AdamW(fused=True)``'s own call), else its
    single-tensor path (``torch.optim.AdamW(foreach=False)``). ``step_t``: ``step`` as a tensor on ``p``'s
    device, made once per step by the caller (the kernel reads it, never writes it)."""
    b1, b2 = g["betas"]
    if _fusable(p, grad, mv):
        if step_t is None:
            step_t = torch.full((), float(step), device=p.device)  # a fill on the device: no host-to-device copy
        torch._fused_adamw_([p], [grad], [mv[0]], [mv[1]], [], [step_t],
                            lr=g["lr"], beta1=b1, beta2=b2, weight_decay=g["weight_decay"], eps=g["eps"],
                            amsgrad=False, maximize=False)
        return
    _adamw([p], [grad], [mv[0]], [mv[1]], [], [torch.tensor(float(step - 1))], foreach=False, capturable=False,
           differentiable=False, fused=None, grad_scale=None, found_inf=None, amsgrad=False, beta1=b1, beta2=b2,
           lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)


def _fusable(p: torch.Tensor, grad: torch.Tensor, mv: torch.Tensor) -> bool:
    """torch has a fused AdamW kernel for these dtypes on this device."""
    return p.dtype == grad.dtype == mv.dtype and p.device.type in _get_fused_kernels_supported_devices()


def _mem_available() -> int | None:
    """Bytes of RAM the kernel can hand out without swapping (``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _pages(n_elems: int) -> int:
    """File bytes of a chunk of ``n_elems`` elements: two fp32 moments, rounded up to whole pages."""
    return -(-(8 * n_elems) // PAGE) * PAGE


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
             own_dir: str | None = None, views: list | None = None) -> None:
    """Stop the IO thread, unmap, delete the state file and the temporary folder colabkit made for it."""
    if pool is not None:
        pool.shutdown(wait=True)
    if views:
        views.clear()  # the tensors over the mapping: the mapping cannot close while they hold it
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

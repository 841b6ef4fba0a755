"""What one step runs, counted while it runs on fake tensors (:class:`Traffic`): FLOPs (by the formulas of
torch's ``torch.utils.flop_counter``), kernels launched and the bytes the kernels that are not matmuls move.

The memory trace (:mod:`.trace`) counts its own traced step this way, so an estimate runs each fake step
once for memory and speed together; the optimizer step it replays from profiles (:mod:`.replay`) adds the
kernels the profiled real step ran (:func:`add_replayed`). :func:`affine` extrapolates counts in depth.

>>> import torch
>>> with counting() as c:
...     _ = torch.randn(4, 8) @ torch.randn(8, 2) + 1
>>> flops, kernels, nbytes, _, sizes = c.result(0)
>>> flops, kernels >= 3, nbytes > 0    # 2 x 4 x 8 x 2 FLOPs; randn, randn, mm, add
(128, True, True)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..memory import _tensors_of
from ..plan import REGISTRY, Plan
from ..techniques.optimizers import register_chunk_counter

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul,
            _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_efficient_attention,
            _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_flash_attention_for_cpu_backward,
            _aten._scaled_dot_product_efficient_attention_backward, _aten._scaled_dot_product_flash_attention_backward}
# The FLOPs of matmuls that run in 16 bits ride in the bytes-by-size pairs under these negative keys, so every
# path that carries, adds and extrapolates counts carries them too (:func:`split_flops` takes them out)
HALF_FLOPS_KEY = {torch.float16: -16, torch.bfloat16: -17}
# A matmul with a side of at most NARROW (a LoRA adapter's rank, a GaLore projection) runs far below a CPU's
# square-matmul rate (512x256 @ 256x8: ~14 GFLOP/s against ~95 at 256^3 on a 2-core EPYC): its FLOPs ride in the
# same pairs under a negative key that encodes (M, K, N, dtype) -- :func:`narrow_key` -- and are timed at their
# own shape on the CPU that predicts (speed.cpu_narrow_rate); a GPU's prediction keeps them in ``flops``.
NARROW = 64
_NARROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SIDE = 1 << 21  # each side clamped below 2^21 in the key (a side that long is not narrow's concern)
_NARROW_BASE = -1000


def narrow_key(m: int, k: int, n: int, dtype: torch.dtype) -> int:
    """The negative key of a narrow ``(m, k) @ (k, n)`` matmul in ``dtype``; :func:`narrow_shape` reverses it.

    >>> narrow_shape(narrow_key(512, 256, 8, torch.float32))
    (512, 256, 8, torch.float32)
    """
    code = _NARROW_DTYPES.index(dtype)
    return _NARROW_BASE - (((code * _SIDE + min(m, _SIDE - 1)) * _SIDE + min(k, _SIDE - 1)) * _SIDE + min(n, _SIDE - 1))


def narrow_shape(key: int) -> tuple[int, int, int, torch.dtype]:
    v = _NARROW_BASE - key
    v, n = divmod(v, _SIDE)
    v, k = divmod(v, _SIDE)
    code, m = divmod(v, _SIDE)
    return m, k, n, _NARROW_DTYPES[code]


def _narrow(func, args) -> int | None:
    """The key of a 2-D matmul (``mm``, ``addmm``: what ``nn.Linear`` runs) with a side <= :data:`NARROW`."""
    packet = func.overloadpacket
    a, b = (args[0], args[1]) if packet is _aten.mm else (args[1], args[2]) if packet is _aten.addmm else (None, None)
    if a is None or a.dim() != 2 or b.dim() != 2 or a.dtype not in _NARROW_DTYPES:
        return None
    (m, k), n = a.shape, b.shape[1]
    return narrow_key(m, k, n, a.dtype) if min(m, k, n) <= NARROW else None
_DEVICE = torch.ops.prim.device.default
_FREE = {_aten.detach.default, _aten.empty.memory_format, _aten.empty_like.default, _aten._local_scalar_dense.default}
# Tokens that do not change the kernels of one step on one device: applied as bytes moved instead
_NOT_COMPUTE = ("offload", "zero")


def compute_plan(plan: Plan) -> str:
    """The tokens that change the kernels of a step (qlora runs as lora: its 4-bit kernels cannot run on fake
    tensors; a paged optimizer as the unpaged one).

    >>> compute_plan(Plan.parse("fp16+paged-adamw8bit+offload:optimizer"))
    'fp16+adamw8bit'
    """
    keep = [t.replace("qlora", "lora", 1).replace("paged-", "", 1) for t in plan.tokens
            if t.partition(":")[0] not in _NOT_COMPUTE and t not in ("attention:efficient", "attention:flash")]
    return "+".join(keep) or "baseline"


def sgd_plan(compute: str, optimizer_token: str) -> str:
    """``compute`` with its optimizer replaced by SGD: what is counted for an optimizer whose kernels cannot
    run on fake tensors (its state is then added as bytes read and written).

    >>> sgd_plan("fp16+adamw8bit", "adamw8bit"), sgd_plan("checkpoint", "adamw")
    ('fp16+sgd', 'checkpoint+sgd')
    >>> sgd_plan("fp16+adamw8bit", "paged-adamw8bit")
    'fp16+sgd'
    """
    toks = Plan.parse(compute).tokens
    opt = [REGISTRY[t.partition(":")[0]].group == "optimizer" for t in toks]
    # (compute_plan names paged-adamw8bit's compute "adamw8bit": the optimizer is found by its group, not its name)
    return str(Plan.parse([("sgd" if o else t) for t, o in zip(toks, opt)] + ([] if any(opt) else ["sgd"])))


class Traffic(TorchDispatchMode):
    """Counts a step's kernels: ``flops`` of the matmuls and attention (torch's FLOP formulas, the registry of
    ``FlopCounterMode``, read directly: that mode also decomposes the ops it has no formula for, which would
    change the storages a memory trace sees), every kernel launched (``ops``) and the bytes the kernels that
    are not matmuls read and write (``bytes``: elementwise, norms, softmax, the optimizer's update), also
    by the kernel's size (``by_size``: power of two -> bytes; a CPU moves them at its cache's speed)."""

    def __init__(self):
        super().__init__()
        self.flops, self.ops, self.bytes = 0, 0, 0
        self.by_size: dict[int, int] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # only in traces and replays, where nothing is compiled: no guard
        return False                       # frame (~5 µs) around each op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and hasattr(args[0], "fake_device"):
            # a fake tensor's .device (autograd asks for every gradient: more calls than all kernels together):
            # no kernel, answered here rather than by every mode below (as trace._HostScalars does)
            return args[0].fake_device
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        counted, formula, matmul = kind
        if not counted:
            return out
        self.ops += 1
        if formula is not None:
            fl = formula(*args, **(kwargs or {}), out_val=out)
            self.flops += fl
            first = out if isinstance(out, torch.Tensor) else next(
                (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
            key = _narrow(func, args) if matmul else None
            if key is None:
                key = HALF_FLOPS_KEY.get(first.dtype) if first is not None else None
            if key is not None:  # narrow or 16-bit: a CPU runs it at another rate than fp32 (speed.step_time)
                self.by_size[key] = self.by_size.get(key, 0) + fl
        if not matmul:
            outs = (out,) if isinstance(out, torch.Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in (*_tensors_of(args, kwargs), *outs))
            self.bytes += nbytes
            # sized by all it reads and writes, as the copy's source: a step's tensors come fresh from the
            # allocator and from other kernels, colder than the warm buffers of a repeated copy of half the size
            size = 1 << max(12, nbytes.bit_length())
            self.by_size[size] = self.by_size.get(size, 0) + nbytes
        return out

    def __enter__(self):
        _OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _OPEN.remove(self)
        return super().__exit__(*exc)

    def snapshot(self) -> tuple[int, int, tuple[tuple[int, int], ...], int]:
        """(kernels, bytes, bytes by size, FLOPs) so far: what a replay adds back (:func:`add_replayed`)."""
        return self.ops, self.bytes, tuple(sorted(self.by_size.items())), self.flops

    def result(self, trainable: int) -> tuple[int, int, int, int, tuple[tuple[int, int], ...]]:
        """(FLOPs, kernels, non-matmul bytes, ``trainable`` parameters, bytes by kernel size)."""
        return int(self.flops), self.ops, self.bytes, trainable, tuple(sorted(self.by_size.items()))

    def add(self, counted: tuple[int, int, tuple[tuple[int, int], ...], int]) -> None:
        ops, nbytes, sizes, flops = counted
        self.ops += ops
        self.bytes += nbytes
        self.flops += flops
        for k, v in sizes:
            self.by_size[k] = self.by_size.get(k, 0) + v


def split_flops(sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], dict[str, int],
                                                              tuple[tuple[tuple, int], ...]]:
    """(the bytes-by-size pairs alone, {"fp16": FLOPs, "bf16": FLOPs} of the 16-bit matmuls that are not narrow,
    ((M, K, N, dtype), FLOPs) of each narrow matmul shape) of a count.

    >>> split_flops(((-17, 100), (narrow_key(512, 256, 8, torch.float32), 64), (4096, 8)))
    (((4096, 8),), {'fp16': 0, 'bf16': 100}, (((512, 256, 8, torch.float32), 64),))
    """
    d = dict(sizes)
    half = {name: d.pop(HALF_FLOPS_KEY[dt], 0) for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16))}
    narrow = tuple((narrow_shape(k), d.pop(k)) for k in sorted(d) if k <= _NARROW_BASE)
    return tuple(sorted(d.items())), half, narrow


def _cpu_sdpa(*args, out_val=None, **kwargs) -> int:  # torch has no formula for the CPU flash kernel
    return sdpa_flop_count(*(a.shape for a in args[:3]))


def _cpu_sdpa_backward(*args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(*(a.shape for a in args[:4]))


def _kind(func) -> tuple[bool, object, bool]:
    """(a kernel at all, its FLOP formula or None, a matmul): views, ``prim.device`` & co are metadata."""
    if func.is_view or func in _FREE or func.namespace == "prim":
        return False, None, False
    packet = func.overloadpacket
    formula = {_aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
               _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}.get(packet)
    return True, flop_registry.get(packet, formula), packet in _MATMULS


_KINDS: dict = {}  # op overload -> _kind(op), decided once
_OPEN: list[Traffic] = []  # every Traffic entered and not yet left (counting() blocks, replay's recordings)


@contextlib.contextmanager
def counted_as(times: int) -> Iterator[None]:
    """What runs in the block is counted ``times`` times by every open :class:`Traffic`: a kernel that runs one
    of ``times`` identical pieces on fake tensors (the blockwise AdamWs' chunks: ``register_chunk_counter``)."""
    before = [(t, t.snapshot()) for t in _OPEN]
    yield
    for t, (ops, nbytes, sizes, flops) in before:
        ops2, nbytes2, sizes2, flops2 = t.snapshot()
        grown = dict(sizes2)
        for k, v in sizes:
            grown[k] -= v
        more = times - 1
        t.add(((ops2 - ops) * more, (nbytes2 - nbytes) * more, tuple((k, v * more) for k, v in grown.items() if v),
               (flops2 - flops) * more))


register_chunk_counter(counted_as)
_ACTIVE: list[Traffic] = []  # the Traffic of the counting() blocks open now, innermost last


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Count FLOPs, kernels and bytes of what runs in the block (``.result(trainable)`` after it)."""
    with Traffic() as traffic:
        _ACTIVE.append(traffic)
        try:
            yield traffic
        finally:
            _ACTIVE.pop()


def add_replayed(counted: tuple[int, int, tuple[tuple[int, int], ...], int] | None) -> None:
    """Add the kernels of a step replayed rather than run (:mod:`.replay`) to the open :func:`counting` block."""
    if _ACTIVE and counted is not None:
        _ACTIVE[-1].add(counted)


def affine(c2: tuple, c3: tuple, depth: int, depths: tuple[int, int]) -> tuple:
    """Counts at ``depth`` from counts at ``depths`` (every block runs the same kernels: affine in depth) --
    exactly for FLOPs, kernels, bytes and parameters; the bytes by kernel size approximately (a kernel over
    all parameters, the fused optimizer's, moves to a larger size bucket with depth).

    >>> affine((10, 2, 4, 1, ((4096, 4),)), (15, 3, 6, 2, ((4096, 6),)), 5, (2, 3))
    (25, 5, 10, 4, ((4096, 10),))
    """
    lo, hi = depths

    def at(a: int, b: int) -> int:
        return a + (depth - lo) * (b - a) // (hi - lo)

    s2, s3 = dict(c2[4]), dict(c3[4])
    sizes = tuple((k, at(s2.get(k, 0), s3.get(k, 0))) for k in sorted(s2.keys() | s3.keys()))
    return (*(at(a, b) for a, b in zip(c2[:4], c3[:4])), tuple((k, v) for k, v in sizes if v))

"""CPU offload: keep a kind of training state in host RAM and move it to the GPU only around its use.

* ``offload:optimizer`` — optimizer state and fp32 master weights live in (pinned) host RAM; each
  gradient is copied to the host inside backward as soon as it is complete (a side stream overlaps
  the copy with the rest of backward), the update runs on the CPU, new weights are copied back.
* ``offload:activations`` — tensors saved for backward go to pinned host memory during forward and
  come back for backward (the same pack/unpack as ``torch.autograd.graph.save_on_cpu``).
* ``offload:params`` — layer streaming: block parameters live in host RAM; a block's weights are
  copied in just before it runs (the next block's copy prefetched on a side stream), in forward
  and again in backward, where the block is recomputed (RNG state replayed, as in
  ``torch.utils.checkpoint``); its gradients go straight to the host.
* :func:`offloaded` — phase-aware offload for evaluation / generation: optimizer state (and any
  gradients) leave the GPU for the block and come back before the next step.

Every move goes through a :class:`DevicePair` (compute side, host side). On CUDA it uses pinned
memory, a side stream, events and non-blocking copies. On a CPU run the tokens are refused (there is
nothing to offload to) unless offload is **simulated** (``offload_sim=True``, ``--offload-sim``):
both sides are then the CPU, the pair's few low-level calls fall back to plain CPU ones, and every
other line — copies, prefetch, recompute, master weights — is the code a GPU runs. Host-side
storages are tagged, so the tracker reports them apart (``host_bytes``, ``host_breakdown``).
A host-RAM guard (:func:`host_ram_guard`) refuses any offload that would not fit in host RAM — a
Colab VM is killed, not warned, when it runs out (~12.7 GB).

>>> from colabkit.plan import Plan, Context, PlanError
>>> try:
...     Plan.parse("offload:optimizer").check(Context(device=torch.device("cpu")))
... except PlanError as e:
...     print(str(e)[:55])
'offload:optimizer' on a CPU run: there is nothing to o
>>> Plan.parse("offload:optimizer").check(Context(device=torch.device("cpu"), offload_sim=True))
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..env import host_ram
from ..memory import fmt_bytes, host_side, mark_host, optimizer_tensors
from ..models import blocks_of
from ..plan import REGISTRY, Context, Plan, PlanError, Technique, register
from ._wrapper import WrappedOptimizer
from .optimizers import state_bytes_per_param

KINDS = ("optimizer", "activations", "params")
PREFETCH = True  # offload:params copies the next block on a side stream; set False to measure without
HOST_RESERVE = 1 << 30  # leave 1 GiB of host RAM for Python, the data loader and the notebook


# ----- the host-RAM guard ------------------------------------------------------------------------
def pinned_bytes(nbytes: int) -> int:
    """Host RAM one pinned tensor of ``nbytes`` takes: CUDA's caching host allocator rounds each
    block up to the next power of two (``PowerOf2Ceil`` in CachingHostAllocator), so a 33 MB
    gradient buffer takes 64 MiB of page-locked RAM.

    >>> pinned_bytes(1000), pinned_bytes(1024), pinned_bytes(0)
    (1024, 1024, 0)
    """
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def host_ram_guard(nbytes: int, what: str, available: int | None = None, reserve: int = HOST_RESERVE,
                   pinned: Iterable[int] = ()) -> int:
    """Refuse (PlanError) to move ``nbytes`` (plus the ``pinned`` blocks, each rounded up by
    :func:`pinned_bytes`) to host RAM when that would leave less than ``reserve`` free; returns the
    bytes that stay free. A Colab VM is killed without warning when RAM runs out.

    >>> host_ram_guard(2 << 30, "optimizer state", available=8 << 30)
    6442450944
    >>> host_ram_guard(10 << 30, "optimizer state", available=8 << 30)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: offloading optimizer state needs 10.0 GiB of host RAM but only 8.0 GiB is available (1.0 GiB kept in reserve): offload less (e.g. only offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM
    """
    nbytes += sum(pinned_bytes(b) for b in pinned)
    if available is None:
        available = host_ram().get("available") or 0
    left = available - nbytes - reserve
    if left < 0:
        raise PlanError(f"offloading {what} needs {fmt_bytes(nbytes)} of host RAM but only {fmt_bytes(available)} "
                        f"is available ({fmt_bytes(reserve)} kept in reserve): offload less (e.g. only "
                        "offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM")
    return available - nbytes


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    with host_side():
        h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        h.copy_(t.detach())
    return mark_host(h)


# ----- the device pair: the only lines that differ between CUDA and the CPU simulation ----------
class DevicePair:
    """The two sides offload moves tensors between: ``compute`` (the GPU) and ``host`` (CPU RAM).

    On CUDA: pinned host buffers, one side stream, events and non-blocking copies. On a CPU
    (simulated offload) both sides are the CPU; host buffers are ordinary memory tagged as host
    side, the side stream is the current thread, events are ``None``.

    >>> pair = DevicePair("cpu")
    >>> h = pair.to_host(torch.ones(3)); d = pair.to_compute(h)
    >>> pair, d.data_ptr() != h.data_ptr(), pinned_bytes(12), pair.host_nbytes([12])
    (DevicePair(cpu <-> host (simulated)), True, 16, 12)
    """

    def __init__(self, compute: str | torch.device):
        self.compute, self.host = torch.device(compute), torch.device("cpu")
        self.cuda = self.compute.type == "cuda"
        self.simulated = not self.cuda
        self.stream = torch.cuda.Stream(self.compute) if self.cuda else None

    def __repr__(self) -> str:
        return f"DevicePair({self.compute} <-> host{' (simulated)' if self.simulated else ', pinned'})"

    def host_nbytes(self, sizes: Iterable[int]) -> int:
        """Host RAM that host buffers of these sizes take (pinned blocks round up on CUDA)."""
        return sum(pinned_bytes(n) if self.cuda else n for n in sizes)

    def host_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host-side buffer (pinned on CUDA: asynchronous copies)."""
        with host_side():
            return mark_host(torch.empty(shape, dtype=dtype, device=self.host, pin_memory=self.cuda))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host-side copy of ``t`` (complete on return)."""
        return _host_copy(t, self.cuda)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """A compute-side copy of ``t`` (asynchronous from pinned memory on CUDA)."""
        return t.detach().to(self.compute, non_blocking=self.cuda, copy=True)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the block on the side stream after the work queued so far (inline on a CPU)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.compute))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            yield

    def done(self) -> Any:
        """An event marking the side stream's work so far (None on a CPU: already done)."""
        ev = torch.cuda.Event() if self.stream is not None else None
        if ev is not None:
            ev.record(self.stream)
        return ev

    def use(self, event: Any, tensors: Iterable[torch.Tensor]) -> None:
        """The compute stream waits for ``event`` and owns ``tensors`` (made on the side stream)."""
        if event is not None:
            cur = torch.cuda.current_stream(self.compute)
            cur.wait_event(event)
            for t in tensors:
                t.record_stream(cur)

    def lend(self, t: torch.Tensor) -> None:
        """``t`` (compute side) is read by the side stream: not reused before that work is done."""
        if self.stream is not None:
            t.record_stream(self.stream)

    def sync(self) -> None:
        """Wait for every copy queued on the side stream."""
        if self.stream is not None:
            self.stream.synchronize()

    def rng_state(self) -> tuple:
        """The RNG states a recompute must replay (CPU, and the GPU's on CUDA)."""
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.compute) if self.cuda else None

    @contextlib.contextmanager
    def replay_rng(self, state: tuple) -> Iterator[None]:
        """Run the block with the RNG as it was at ``state``; the outer RNG is left untouched."""
        devices = [self.compute.index or 0] if self.cuda else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.compute)
            yield


# ----- offload:optimizer -------------------------------------------------------------------------
class HostOptimizer(WrappedOptimizer):
    """An optimizer whose fp32 master weights, gradients and state live in host RAM.

    ``make(host_param_groups)`` builds the real optimizer on the host copies. Inside backward each
    finished gradient is copied to its host buffer on the pair's side stream and freed on the
    compute side; ``step()`` waits for the copies, updates on the CPU, and copies the new weights
    back. Schedulers attach to ``.optimizer`` (it owns ``param_groups``); a gradient that arrives
    twice before a step (``accum:K``) is added on the host. ``state_dict()`` carries the master
    weights, so a resumed run continues from them, not from stale copies.

    >>> m = torch.nn.Linear(4, 2)
    >>> opt = HostOptimizer([{"params": list(m.parameters())}], lambda g: torch.optim.SGD(g, lr=0.1))
    >>> m(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> m.weight.grad is None, opt.host_bytes()
    (True, 80)
    """

    def __init__(self, param_groups: list[dict], make: Any, pair: DevicePair | None = None):
        params = [p for g in param_groups for p in g["params"]]
        self.pair = pair or DevicePair(params[0].device if params else "cpu")
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device param, host master)
        self._fresh: dict[int, bool] = {}
        host_groups = []
        for g in param_groups:
            hs = []
            for p in g["params"]:
                if getattr(p, "_colabkit_host", False):  # streamed by offload:params: update in place
                    h = p
                else:
                    h = nn.Parameter(self.pair.to_host(p))
                    h.grad = self.pair.host_empty(p.shape, p.dtype).zero_()
                    self._fresh[id(p)] = True
                    p.register_post_accumulate_grad_hook(self._grad_to_host)
                self._pairs.append((p, h))
                hs.append(h)
            host_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hs})
        self._host_of = {id(p): h for p, h in self._pairs}
        with host_side():
            self.optimizer = make(host_groups)

    def _grad_to_host(self, p: torch.Tensor) -> None:
        h = self._host_of[id(p)]
        if self._fresh[id(p)]:
            with self.pair.side():  # overlap the copy with the rest of backward
                self.pair.copy_(h.grad, p.grad)
            self.pair.lend(p.grad)
            self._fresh[id(p)] = False
        else:  # accumulation: a second gradient before the step is added on the host
            self.pair.sync()
            h.grad.add_(self.pair.to_host(p.grad))
        p.grad = None

    def step(self, closure=None):
        self.pair.sync()
        with host_side():  # the update (and any state it creates) runs on the host
            loss = self.optimizer.step(closure)
        self._copy_back()
        return loss

    def _copy_back(self) -> None:
        for p, h in self._pairs:
            if h is not p:
                self.pair.copy_(p.data, h.data)  # pinned -> asynchronous host-to-device
                self._fresh[id(p)] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        # device gradients are already gone (moved in backward); host buffers are overwritten by
        # the next step's first gradient (also after a step the GradScaler skipped), so only
        # host-resident parameters have a .grad to clear
        for p, h in self._pairs:
            if h is p and p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
            self._fresh[id(p)] = True

    @property
    def param_groups(self) -> list[dict]:
        # The GradScaler unscales and inf-checks the gradients it finds here — the host copies —
        # so the copies still in flight on the side stream must land first.
        self.pair.sync()
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        """The inner optimizer's state plus the host master weights (in parameter order)."""
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [h.detach().clone() for p, h in self._pairs if h is not p]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore state and master weights; a plain optimizer state dict (no masters) takes the
        masters from the model's current weights (exact when they are fp32)."""
        with host_side():
            self.optimizer.load_state_dict(sd["optimizer"] if "masters" in sd else sd)
        own = [(p, h) for p, h in self._pairs if h is not p]
        masters = sd["masters"] if "masters" in sd else [p.detach() for p, _ in own]
        if len(masters) != len(own):
            raise ValueError(f"checkpoint has {len(masters)} master weights, this optimizer {len(own)}: "
                             "resume with the same model and plan")
        for (p, h), m in zip(own, masters):
            h.data.copy_(m)
        self._copy_back()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Master weights, host gradient buffers and the inner optimizer's state (host side)."""
        for p, h in self._pairs:
            if h is not p:
                yield h
                yield h.grad
        yield from optimizer_tensors(self.optimizer)

    def host_bytes(self) -> int:
        """Host RAM held: master weights, gradient buffers and optimizer state."""
        seen, n = set(), 0
        for t in self.state_tensors():
            st = t.untyped_storage()
            if t.device.type == "cpu" and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
        return n


def optimizer_host_bytes(params: Iterable[torch.Tensor], state_per_param: float, pair_cuda: bool) -> int:
    """Host RAM ``offload:optimizer`` takes for ``params``: a master copy and a gradient buffer per
    parameter (pinned on CUDA, so each rounded up by :func:`pinned_bytes`) plus the optimizer state.

    >>> optimizer_host_bytes([torch.empty(3, device="meta")], 8, pair_cuda=True)
    56
    """
    n, blocks = 0, []
    for p in params:
        blocks += [p.numel() * p.element_size()] * 2
        n += int(p.numel() * state_per_param)
    return n + sum(pinned_bytes(b) if pair_cuda else b for b in blocks)


def _offload_optimizer(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> HostOptimizer:
    groups = optimizer.param_groups
    pair = DevicePair(ctx.device)
    own = [p for g in groups for p in g["params"] if not getattr(p, "_colabkit_host", False)]
    host_ram_guard(optimizer_host_bytes(own, state_bytes_per_param(plan.optimizer_token), pair.cuda),
                   "optimizer state + fp32 master weights")
    cpu_ctx = Context(device=torch.device("cpu"), env=ctx.env, model_name=ctx.model_name, lr=ctx.lr,
                      weight_decay=ctx.weight_decay)
    make = lambda hg: REGISTRY[plan.optimizer].make_optimizer(hg, plan, cpu_ctx)  # noqa: E731
    plain_groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups]
    return HostOptimizer(plain_groups, make, pair)


class HostStateOptimizer(WrappedOptimizer):
    """``offload:params`` without ``offload:optimizer``: the plain optimizer updates the host-side
    block parameters in place, so their state lives on the host too (CPU tensors on a GPU run);
    this tags it host side for the tracker after each step."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        for p, s in self.optimizer.state.items():
            if getattr(p, "_colabkit_host", False):
                for v in s.values():
                    if isinstance(v, torch.Tensor):
                        mark_host(v)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


# ----- offload:activations -----------------------------------------------------------------------
def activation_offload(pair: DevicePair | None = None) -> contextlib.AbstractContextManager:
    """Saved-for-backward tensors go to the host side (pinned on CUDA: asynchronous copies back)
    and return to the compute side for backward — ``save_on_cpu``'s pack/unpack, through the pair.

    >>> with activation_offload(): pass
    """
    pair = pair or DevicePair("cpu")

    def pack(t: torch.Tensor) -> tuple:
        return t.device, pair.to_host(t)

    def unpack(packed: tuple) -> torch.Tensor:
        device, h = packed
        return h.to(device, non_blocking=pair.cuda, copy=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# ----- offload:params (layer streaming) ----------------------------------------------------------
class BlockStreamer:
    """Copies one block's host-resident parameters to the compute side on demand, and
    (``prefetch``) the next block's on the side stream while the current one computes."""

    def __init__(self, blocks: nn.ModuleList, pair: DevicePair, prefetch: bool = True):
        self.blocks, self.pair, self.prefetch = blocks, pair, prefetch
        self._pending: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self.copies = 0

    def _start(self, i: int) -> None:
        if i in self._pending or not 0 <= i < len(self.blocks):
            return
        named = dict(self.blocks[i].named_parameters()) | dict(self.blocks[i].named_buffers())
        with self.pair.side():
            dev = {n: self.pair.to_compute(t) for n, t in named.items()}
        self.copies += 1
        self._pending[i] = (dev, self.pair.done())

    def get(self, i: int, next_i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors on the compute side; starts copying block ``next_i`` when prefetching."""
        self._start(i)
        dev, ev = self._pending.pop(i)
        self.pair.use(ev, dev.values())
        if self.prefetch:
            self._start(next_i)
        return dev


class _Call:
    """One call of a streamed block: its arguments split into tensors (autograd inputs) and the
    rest (None, flags, cache objects), so any ``block(*args, **kwargs)`` — transformers passes
    ``attention_mask=``, ``position_ids=``, ``position_embeddings=(cos, sin)``, … — can be replayed."""

    def __init__(self, streamed: "_Streamed", args: tuple, kwargs: dict):
        self.block, self.i, self.streamer = streamed.block, streamed.i, streamed.streamer
        flat, self.spec = tree_flatten((args, kwargs))
        self.is_t = [isinstance(a, torch.Tensor) for a in flat]
        self.rest = [None if t else a for a, t in zip(flat, self.is_t)]
        self.tensors = [a for a, t in zip(flat, self.is_t) if t]
        self.out_spec: Any = None
        self.out_rest: list | None = None

    def __call__(self, w: dict[str, torch.Tensor], tensors: Iterable[torch.Tensor]) -> list:
        """Run the block with weights ``w``; returns the output's leaves (spec kept)."""
        it = iter(tensors)
        args, kwargs = tree_unflatten([next(it) if t else a for a, t in zip(self.rest, self.is_t)], self.spec)
        flat, self.out_spec = tree_flatten(torch.func.functional_call(self.block, w, tuple(args), kwargs))
        return flat


class _StreamedBlockFn(torch.autograd.Function):
    """Forward without keeping the block's weights; backward fetches them again, recomputes the
    block with the forward's RNG state and autocast, and adds the parameter gradients to the host
    parameters' ``.grad``."""

    @staticmethod
    def forward(ctx, call, *tensors):
        pair = call.streamer.pair
        ctx.rng = pair.rng_state()  # dropout in the recompute must draw the same masks
        w = call.streamer.get(call.i, call.i + 1)
        with torch.no_grad():
            flat = call(w, tensors)
        call.out_rest = [None if isinstance(o, torch.Tensor) else o for o in flat]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        dev = pair.compute.type  # the recompute in backward must see the same autocast as this forward
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        return tuple(o for o in flat if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grad_outs):
        call, needs = ctx.call, ctx.needs_input_grad[1:]
        w = call.streamer.get(call.i, call.i - 1)  # backward walks the blocks in reverse: prefetch the previous
        names = [n for n, p in call.block.named_parameters() if p.requires_grad]
        for n in names:
            w[n].requires_grad_(True)
        dev, dtype, enabled = ctx.autocast
        with torch.enable_grad(), call.streamer.pair.replay_rng(ctx.rng), torch.autocast(dev, dtype=dtype, enabled=enabled):
            xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
            outs = [o for o in call(w, xs) if isinstance(o, torch.Tensor)]
        used = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad and g is not None]
        inputs = [x for x, need in zip(xs, needs) if need] + [w[n] for n in names]
        grads = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True)
        gx = iter(grads)
        result = [next(gx) if need else None for need in needs]
        params = dict(call.block.named_parameters())
        for n, g in zip(names, gx):
            if g is not None:
                p = params[n]
                g = call.streamer.pair.to_host(g)  # the gradient goes straight to the host side
                p.grad = g if p.grad is None else p.grad.add_(g)
        return (None, *result)


class _Streamed(nn.Module):
    """A block whose weights stay on the host side; called like the block itself."""

    def __init__(self, block: nn.Module, i: int, streamer: BlockStreamer):
        super().__init__()
        self.block, self.i = block, i
        object.__setattr__(self, "streamer", streamer)  # not a submodule

    def __getattr__(self, name: str) -> Any:  # model code may read block attributes (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, *args, **kwargs):
        call = _Call(self, args, kwargs)
        outs = iter(_StreamedBlockFn.apply(call, *call.tensors))
        rest, call.out_rest = call.out_rest, None  # no reference from the graph to the outputs
        return tree_unflatten([next(outs) if r is None else r for r in rest], call.out_spec)


def stream_blocks(model: nn.Module, device: str | torch.device, prefetch: bool = True) -> nn.Module:
    """Keep the transformer blocks' parameters on the host side (pinned on CUDA) and move everything
    else to ``device``; each block's weights visit the device only while it runs (forward, then
    recomputed in backward). Block gradients land on the host parameters. Returns the model.

    >>> from colabkit.models import build_model
    >>> m = stream_blocks(build_model("gpt:2x32"), "cpu")
    >>> m.blocks[0].streamer.prefetch, m._colabkit_placed
    (True, True)
    """
    pair = DevicePair(device)
    blocks = blocks_of(model)
    host_ram_guard(pair.host_nbytes(t.numel() * t.element_size() for t in list(blocks.parameters()) + list(blocks.buffers())),
                   "block parameters")
    streamer = BlockStreamer(nn.ModuleList(list(blocks)), pair, prefetch)
    for i, b in enumerate(list(blocks)):
        for t in list(b.parameters()) + list(b.buffers()):
            t.data = pair.to_host(t.data)
            t._colabkit_host = True  # HostOptimizer updates these in place, no second copy
        blocks[i] = _Streamed(b, i, streamer)
    streamed = set(id(p) for p in blocks.parameters()) | set(id(b) for b in blocks.buffers())
    for m in model.modules():  # the rest (embeddings, final norm, head) goes to the device
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in streamed:
                p.data = p.data.to(pair.compute)
        for name, b in list(m.named_buffers(recurse=False)):
            if id(b) not in streamed:
                setattr(m, name, b.to(pair.compute))
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # training: no KV cache (a streamed block's k/v would be kept)
    model._colabkit_placed = True
    return model


# ----- phase-aware offload (evaluation, generation) ----------------------------------------------
STRATEGIES = ("cpu", "pinned", "int8", "drop")


def _q8(t: torch.Tensor, block: int = 256) -> tuple:
    flat = t.reshape(-1).float()
    pad = (-flat.numel()) % block
    b = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    absmax = b.abs().amax(1).clamp(min=1e-30)
    return (torch.round(b / absmax[:, None] * 127).to(torch.int8), absmax, t.shape, t.dtype)


def _dq8(q: tuple) -> torch.Tensor:
    codes, absmax, shape, dtype = q
    return (codes.float() / 127 * absmax[:, None]).reshape(-1)[: math.prod(shape)].view(shape).to(dtype)


@contextlib.contextmanager
def offloaded(optimizer: Any, model: nn.Module | None = None, strategy: str = "pinned") -> Iterator[dict]:
    """During a phase with no backward (evaluation, generation), take optimizer state and gradients
    off the device; put them back, bit-exact for cpu/pinned, when the block ends.

    Strategies: ``cpu`` / ``pinned`` (copy to host RAM, guarded by :func:`host_ram_guard`), ``int8``
    (blockwise 8-bit in place: 1/4 of fp32, lossy), ``drop`` (free it; moments restart at zero
    after the block — changes training, use only when nothing else fits). Yields a dict with
    ``moved_bytes``.

    >>> m = torch.nn.Linear(64, 64); opt = torch.optim.AdamW(m.parameters())
    >>> m(torch.ones(1, 64)).sum().backward(); opt.step()
    >>> with offloaded(opt, m, "int8") as info:
    ...     info["moved_bytes"]
    49152
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown offload strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    inner = getattr(optimizer, "optimizer", optimizer)  # through fused-step / offload wrappers
    state = inner.state

    def worth(v: Any) -> bool:  # per-step scalars stay; int8 compresses only big float tensors
        if not torch.is_tensor(v) or v.numel() <= 1:
            return False
        return v.is_floating_point() and v.numel() >= 4096 if strategy == "int8" else True

    keys = [(p, k) for p, s in state.items() for k, v in s.items() if worth(v)]
    grads = [p for p in (model.parameters() if model is not None else ()) if p.grad is not None and worth(p.grad)]
    moved = sum(state[p][k].numel() * state[p][k].element_size() for p, k in keys)
    moved += sum(p.grad.numel() * p.grad.element_size() for p in grads)
    if strategy in ("cpu", "pinned"):
        host_ram_guard(moved, "optimizer state for evaluation")

    def stash(v: torch.Tensor) -> tuple:
        if strategy == "int8":
            return _q8(v), v.device
        if strategy == "drop":
            return None, v.device
        return _host_copy(v, strategy == "pinned" and v.is_cuda), v.device

    def unstash(stored: tuple) -> torch.Tensor:
        data, dev = stored
        return _dq8(data).to(dev) if strategy == "int8" else data.to(dev, non_blocking=strategy == "pinned")

    saved = {(id(p), k): stash(state[p][k]) for p, k in keys}
    for p, k in keys:
        state[p][k] = None  # the device copy is freed here
    grad_saved = {id(p): (p, stash(p.grad)) for p in grads}
    for p in grads:
        p.grad = None
    try:
        yield {"moved_bytes": moved, "strategy": strategy}
    finally:
        for p, k in keys:
            if strategy == "drop":
                state.pop(p, None)  # re-initialised (zeros, step 0) by the next optimizer step
            else:
                state[p][k] = unstash(saved[(id(p), k)])
        if strategy != "drop":
            for p, stored in grad_saved.values():
                p.grad = unstash(stored)


# ----- the plan token --------------------------------------------------------------------------
def _parse(arg: str | None) -> str:
    if arg not in KINDS:
        raise PlanError(f"offload needs what to offload: {', '.join('offload:' + k for k in KINDS)}")
    return arg


def _check(plan: Plan, ctx: Context) -> None:
    kinds = sorted(plan.get("offload", ()))
    if kinds and not ctx.cuda and not ctx.offload_sim:
        names = " + ".join(f"'offload:{k}'" for k in kinds)
        raise PlanError(f"{names} on a CPU run: there is nothing to offload to — the tensors already live in host "
                        "RAM. Drop the offload tokens (on a GPU they move state to host RAM), simulate them with "
                        "offload_sim=True (--offload-sim) to see the bytes move, or see "
                        "`python -m colabkit estimate --gpu t4` for what they would save there")
    if "optimizer" in kinds:
        if ctx.max_grad_norm is not None:
            raise PlanError("'offload:optimizer' moves each gradient to host RAM inside backward, so global-norm "
                            "clipping on the GPU would see no gradients: train without max_grad_norm, or drop offload:optimizer")
        if "fused-step" in plan:
            raise PlanError("'offload:optimizer' and 'fused-step' both take the gradient inside backward: keep one "
                            "(offload:optimizer already frees each gradient on the GPU as it arrives)")
    if "activations" in kinds and "compress" in plan:
        raise PlanError("'offload:activations' and 'compress:int8' both rewrite the tensors saved for backward and "
                        "would not compose (the inner one wins): keep one")
    if "params" in kinds:
        if "checkpoint" in plan:
            raise PlanError("'offload:params' already recomputes each block in backward (its weights are fetched "
                            "again): drop 'checkpoint'")
        if "fused-step" in plan:
            raise PlanError("'offload:params' and 'fused-step' conflict: the streamed blocks' gradients land on the "
                            "host after the block is recomputed, outside fused-step's per-parameter hooks, so their "
                            "parameters would be stepped twice: drop 'fused-step' (offload:params keeps no block "
                            "gradients on the GPU anyway)")
        if "lora" in plan or "qlora" in plan:
            raise PlanError("'offload:params' with lora/qlora is not supported: the frozen base is already small "
                            "in qlora; drop one")


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    if "params" in plan.get("offload", ()) and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy does it
        return stream_blocks(model, ctx.device, prefetch=PREFETCH)
    return model


def _forward_context(plan: Plan, ctx: Context):
    return activation_offload(DevicePair(ctx.device)) if "activations" in plan.get("offload", ()) else contextlib.nullcontext()


def _wrap(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> Any:
    if "optimizer" in plan.get("offload", ()) and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy
        return _offload_optimizer(optimizer, model, plan, ctx)
    if "params" in plan.get("offload", ()):
        return HostStateOptimizer(optimizer)
    return optimizer


register(Technique(
    name="offload",
    help="keep optimizer state / saved activations / block parameters in host RAM (CUDA; simulated on a CPU with offload_sim)",
    parse=_parse,
    multi=True,
    examples=tuple(f"offload:{k}" for k in KINDS),
    check=_check,
    prepare_model=_prepare,
    forward_context=_forward_context,
    wrap_optimizer=_wrap,
    order=45,
))

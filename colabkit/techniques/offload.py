"""CPU offload: keep a kind of training state in host RAM and move it to the GPU only around its use.

* ``offload:optimizer`` — optimizer state and fp32 master weights live in (pinned) host RAM; each
  gradient is copied to the host inside backward as soon as it is complete (a side stream overlaps
  the copy with the rest of backward), the update runs on the CPU, new weights are copied back.
* ``offload:activations`` — tensors saved for backward go to pinned host memory during forward and
  come back for backward (``torch.autograd.graph.save_on_cpu``).
* ``offload:params`` — layer streaming: block parameters live in host RAM; a block's weights are
  copied in just before it runs (the next block's copy prefetched on a side stream), in forward
  and again in backward, where the block is recomputed; its gradients go straight to the host.
* :func:`offloaded` — phase-aware offload for evaluation / generation: optimizer state (and any
  gradients) leave the GPU for the block and come back before the next step.

On a CPU-only run there is nothing to offload to: the tokens are refused with that reason. The
moving parts (:class:`HostOptimizer`, :func:`stream_blocks`, :func:`offloaded`) are device-agnostic,
so their arithmetic is tested on the CPU; the streams and pinned memory switch on with CUDA.
A host-RAM guard (:func:`host_ram_guard`) refuses any offload that would not fit in host RAM — a
Colab VM is killed, not warned, when it runs out (~12.7 GB).

>>> from colabkit.plan import Plan, Context, PlanError
>>> try:
...     Plan.parse("offload:optimizer").check(Context(device=torch.device("cpu")))
... except PlanError as e:
...     print(str(e)[:55])
'offload:optimizer' on a CPU run: there is nothing to o
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import nn

from ..env import host_ram
from ..memory import fmt_bytes
from ..models import blocks_of
from ..plan import REGISTRY, Context, Plan, PlanError, Technique, register
from ._wrapper import WrappedOptimizer
from .optimizers import state_bytes_per_param

KINDS = ("optimizer", "activations", "params")
PREFETCH = True  # offload:params copies the next block on a side stream; set False to measure without
HOST_RESERVE = 1 << 30  # leave 1 GiB of host RAM for Python, the data loader and the notebook


# ----- the host-RAM guard ------------------------------------------------------------------------
def host_ram_guard(nbytes: int, what: str, available: int | None = None, reserve: int = HOST_RESERVE) -> int:
    """Refuse (PlanError) to move ``nbytes`` to host RAM when that would leave less than ``reserve``
    free; returns the bytes that stay free. A Colab VM is killed without warning when RAM runs out.

    >>> host_ram_guard(2 << 30, "optimizer state", available=8 << 30)
    6442450944
    >>> host_ram_guard(10 << 30, "optimizer state", available=8 << 30)
    Traceback (most recent call last):
    ...
    colabkit.plan.PlanError: offloading optimizer state needs 10.0 GiB of host RAM but only 8.0 GiB is available (1.0 GiB kept in reserve): offload less (e.g. only offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM
    """
    if available is None:
        available = host_ram().get("available") or 0
    left = available - nbytes - reserve
    if left < 0:
        raise PlanError(f"offloading {what} needs {fmt_bytes(nbytes)} of host RAM but only {fmt_bytes(available)} "
                        f"is available ({fmt_bytes(reserve)} kept in reserve): offload less (e.g. only "
                        "offload:optimizer), use a smaller model, lora/qlora, or a machine with more RAM")
    return available - nbytes


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    h.copy_(t.detach())
    return h


# ----- offload:optimizer -------------------------------------------------------------------------
class HostOptimizer(WrappedOptimizer):
    """An optimizer whose fp32 master weights, gradients and state live in host RAM.

    ``make(host_param_groups)`` builds the real optimizer on the host copies. Inside backward each
    finished gradient is copied to its pinned host buffer on a side stream (CUDA) and freed on the
    device; ``step()`` waits for the copies, updates on the CPU, and copies the new weights back.
    Schedulers attach to ``.optimizer`` (it owns ``param_groups``); a gradient that arrives twice
    before a step (``accum:K``) is added on the host.

    >>> m = torch.nn.Linear(4, 2)
    >>> opt = HostOptimizer([{"params": list(m.parameters())}], lambda g: torch.optim.SGD(g, lr=0.1))
    >>> m(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> m.weight.grad is None, opt.host_bytes()
    (True, 80)
    """

    def __init__(self, param_groups: list[dict], make: Any, pin: bool | None = None):
        params = [p for g in param_groups for p in g["params"]]
        on_cuda = any(p.is_cuda for p in params)
        self.pin = on_cuda if pin is None else pin
        self.stream = torch.cuda.Stream() if on_cuda else None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device param, host master)
        self._fresh: dict[int, bool] = {}
        host_groups = []
        for g in param_groups:
            hs = []
            for p in g["params"]:
                if getattr(p, "_colabkit_host", False):  # streamed by offload:params: update in place
                    h = p
                else:
                    h = nn.Parameter(_host_copy(p, self.pin))
                    h.grad = torch.zeros(p.shape, dtype=p.dtype, pin_memory=self.pin)
                    self._fresh[id(p)] = True
                    p.register_post_accumulate_grad_hook(self._grad_to_host)
                self._pairs.append((p, h))
                hs.append(h)
            host_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hs})
        self._host_of = {id(p): h for p, h in self._pairs}
        self.optimizer = make(host_groups)

    def _grad_to_host(self, p: torch.Tensor) -> None:
        h = self._host_of[id(p)]
        if self._fresh[id(p)]:
            if self.stream is not None:  # overlap the copy with the rest of backward
                self.stream.wait_stream(torch.cuda.current_stream(p.device))
                with torch.cuda.stream(self.stream):
                    h.grad.copy_(p.grad, non_blocking=True)
                p.grad.record_stream(self.stream)
            else:
                h.grad.copy_(p.grad)
            self._fresh[id(p)] = False
        else:  # accumulation: a second gradient before the step is added on the host
            if self.stream is not None:
                self.stream.synchronize()
            h.grad.add_(p.grad.to("cpu"))
        p.grad = None

    def step(self, closure=None):
        if self.stream is not None:
            self.stream.synchronize()
        loss = self.optimizer.step(closure)
        for p, h in self._pairs:
            if h is not p:
                p.data.copy_(h.data, non_blocking=self.pin)  # pinned -> async host-to-device
                self._fresh[id(p)] = True
        return loss

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
        if self.stream is not None:
            self.stream.synchronize()
        return self.optimizer.param_groups

    def host_bytes(self) -> int:
        """Host RAM held: master weights, gradient buffers and optimizer state."""
        seen, n = set(), 0
        for t in [h for _, h in self._pairs] + [h.grad for _, h in self._pairs if h.grad is not None] + list(self.state_tensors()):
            st = t.untyped_storage()
            if t.device.type == "cpu" and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
        return n


def _offload_optimizer(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> HostOptimizer:
    groups = optimizer.param_groups
    n = sum(p.numel() for g in groups for p in g["params"] if not getattr(p, "_colabkit_host", False))
    host_ram_guard(int(n * (8 + state_bytes_per_param(plan.optimizer_token))), "optimizer state + fp32 master weights")
    cpu_ctx = Context(device=torch.device("cpu"), env=ctx.env, model_name=ctx.model_name, lr=ctx.lr,
                      weight_decay=ctx.weight_decay)
    make = lambda hg: REGISTRY[plan.optimizer].make_optimizer(hg, plan, cpu_ctx)  # noqa: E731
    plain_groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups]
    return HostOptimizer(plain_groups, make)


# ----- offload:activations -----------------------------------------------------------------------
def activation_offload(pin_memory: bool = True) -> contextlib.AbstractContextManager:
    """Saved-for-backward tensors go to host memory (pinned: asynchronous copies) and come back for
    backward. >>> with activation_offload(pin_memory=False): pass"""
    return torch.autograd.graph.save_on_cpu(pin_memory=pin_memory and torch.cuda.is_available())


# ----- offload:params (layer streaming) ----------------------------------------------------------
class BlockStreamer:
    """Copies one block's host-resident parameters to ``device`` on demand, and (``prefetch``) the
    next block's on a side stream while the current one computes."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device, prefetch: bool = True):
        self.blocks, self.device, self.prefetch = blocks, torch.device(device), prefetch
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self.copies = 0

    def _start(self, i: int) -> None:
        if i in self._pending or not 0 <= i < len(self.blocks):
            return
        named = dict(self.blocks[i].named_parameters()) | dict(self.blocks[i].named_buffers())
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dev = {n: t.detach().to(self.device, non_blocking=True) for n, t in named.items()}
                ev = torch.cuda.Event()
                ev.record(self.stream)
        else:
            dev, ev = {n: t.detach().to(self.device, copy=True) for n, t in named.items()}, None
        self.copies += 1
        self._pending[i] = (dev, ev)

    def get(self, i: int, next_i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors on the device; starts copying block ``next_i`` when prefetching."""
        self._start(i)
        dev, ev = self._pending.pop(i)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            for t in dev.values():
                t.record_stream(torch.cuda.current_stream(self.device))
        if self.prefetch:
            self._start(next_i)
        return dev


class _StreamedBlockFn(torch.autograd.Function):
    """Forward without keeping the block's weights; backward fetches them again, recomputes the
    block, and adds the parameter gradients to the host parameters' ``.grad``."""

    @staticmethod
    def forward(ctx, x, i, streamer, block):
        w = streamer.get(i, i + 1)
        with torch.no_grad():
            out = torch.func.functional_call(block, w, (x,))
        ctx.save_for_backward(x)
        ctx.i, ctx.streamer, ctx.block = i, streamer, block
        dev = x.device.type  # the recompute in backward must see the same autocast as this forward
        ctx.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        block, i = ctx.block, ctx.i
        w = ctx.streamer.get(i, i - 1)  # backward walks the blocks in reverse: prefetch the previous
        names = [n for n, p in block.named_parameters() if p.requires_grad]
        for n in names:
            w[n].requires_grad_(True)
        dev, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
            x_ = x.detach().requires_grad_(x.requires_grad)
            out = torch.func.functional_call(block, w, (x_,))
            inputs = ([x_] if x.requires_grad else []) + [w[n] for n in names]
            grads = torch.autograd.grad(out, inputs, grad_out)
        gx = grads[0] if x.requires_grad else None
        params = dict(block.named_parameters())
        for n, g in zip(names, grads[1 if x.requires_grad else 0:]):
            p = params[n]
            g = g.to(p.device)
            p.grad = g if p.grad is None else p.grad.add_(g)
        return gx, None, None, None


class _Streamed(nn.Module):
    def __init__(self, block: nn.Module, i: int, streamer: BlockStreamer):
        super().__init__()
        self.block, self.i = block, i
        object.__setattr__(self, "streamer", streamer)  # not a submodule

    def forward(self, x):
        return _StreamedBlockFn.apply(x, self.i, self.streamer, self.block)


def stream_blocks(model: nn.Module, device: str | torch.device, prefetch: bool = True, pin: bool | None = None) -> nn.Module:
    """Keep the transformer blocks' parameters in host RAM (pinned on CUDA) and move everything else
    to ``device``; each block's weights visit the device only while it runs (forward, then
    recomputed in backward). Block gradients land on the host parameters. Returns the model.

    >>> from colabkit.models import build_model
    >>> m = stream_blocks(build_model("gpt:2x32"), "cpu")
    >>> m.blocks[0].streamer.prefetch, m._colabkit_placed
    (True, True)
    """
    device = torch.device(device)
    pin = device.type == "cuda" if pin is None else pin
    blocks = blocks_of(model)
    host_ram_guard(sum(p.numel() * p.element_size() for p in blocks.parameters()), "block parameters")
    streamer = BlockStreamer(nn.ModuleList(list(blocks)), device, prefetch)
    for i, b in enumerate(list(blocks)):
        b.to("cpu")
        for t in list(b.parameters()) + list(b.buffers()):
            if pin:
                t.data = t.data.pin_memory()
            t._colabkit_host = True  # HostOptimizer updates these in place, no second copy
        blocks[i] = _Streamed(b, i, streamer)
    streamed = set(id(p) for p in blocks.parameters()) | set(id(b) for b in blocks.buffers())
    for m in model.modules():  # the rest (embeddings, final norm, head) goes to the device
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in streamed:
                p.data = p.data.to(device)
        for name, b in list(m.named_buffers(recurse=False)):
            if id(b) not in streamed:
                setattr(m, name, b.to(device))
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
    if not kinds:
        return
    if not ctx.cuda:
        names = " + ".join(f"'offload:{k}'" for k in kinds)
        raise PlanError(f"{names} on a CPU run: there is nothing to offload to — the tensors already live in host "
                        "RAM. Drop the offload tokens (on a GPU they move state to host RAM), or see "
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
        if "lora" in plan or "qlora" in plan:
            raise PlanError("'offload:params' with lora/qlora is not supported: the frozen base is already small "
                            "in qlora; drop one")


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    if "params" in plan.get("offload", ()) and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy does it
        return stream_blocks(model, ctx.device, prefetch=PREFETCH)
    return model


def _forward_context(plan: Plan, ctx: Context):
    return activation_offload() if "activations" in plan.get("offload", ()) else contextlib.nullcontext()


def _wrap(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> Any:
    if "optimizer" in plan.get("offload", ()) and "zero" not in plan:  # zero:3: FSDP2's CPUOffloadPolicy
        return _offload_optimizer(optimizer, model, plan, ctx)
    return optimizer


register(Technique(
    name="offload",
    help="keep optimizer state / saved activations / block parameters in host RAM (CUDA only)",
    parse=_parse,
    multi=True,
    examples=tuple(f"offload:{k}" for k in KINDS),
    check=_check,
    prepare_model=_prepare,
    forward_context=_forward_context,
    wrap_optimizer=_wrap,
    order=45,
))

"""Moves optimizer state to host RAM: while training (``offload:optimizer``) and around evaluation (:func:`offloaded`)."""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Iterator

import torch
from torch import nn

from ..device import DevicePair, host_ram_guard, host_side, mark_host, pair_of
from ..memory import optimizer_tensors
from ..plan import REGISTRY, Context, Plan, PlanError
from ._wrapper import WrappedOptimizer, weak_grad_hooks


# ----- offload:optimizer -------------------------------------------------------------------------
class HostOptimizer(WrappedOptimizer):
    """An optimizer whose fp32 master weights, gradients and state live in host RAM.

    ``make(host_param_groups)`` builds the real optimizer on the host copies. Inside backward each
    finished gradient is copied to its host buffer on the pair's side stream and freed on the
    compute side; ``step()`` waits for the copies, updates on the CPU, and copies the new weights
    back. Schedulers attach to ``.optimizer`` (it owns ``param_groups``); a gradient that arrives
    twice before a step (``accum:K``) is added on the host. ``state_dict()`` carries the master
    weights, so a resumed run continues from them, not from stale copies. With fp16 a loss scaler must
    unscale the host gradients on the host (:func:`~colabkit.device.host_unscaling`; the Trainer's does).

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
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host gradient buffer, accumulated copy in flight)
        host_groups, hooked = [], []
        for g in param_groups:
            hs = []
            for p in g["params"]:
                if getattr(p, "_colabkit_host", False):  # streamed by offload:params: update in place
                    h = p
                else:
                    h = nn.Parameter(self.pair.to_host(p))
                    h.grad = self.pair.host_empty(p.shape, p.dtype).zero_()
                    self._fresh[id(p)] = True
                    hooked.append(p)
                self._pairs.append((p, h))
                hs.append(h)
            host_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": hs})
        self._host_of = {id(p): h for p, h in self._pairs}
        self._handles = weak_grad_hooks(self, "_grad_to_host", hooked)  # a bound method would leak (see there)
        with host_side():
            self.optimizer = make(host_groups)

    def _grad_to_host(self, p: torch.Tensor) -> None:
        h = self._host_of[id(p)]
        if self._fresh[id(p)]:
            with self.pair.side():  # overlap the copy with the rest of backward
                self.pair.copy_(h.grad, p.grad)
            self.pair.lend(p.grad)
            self._fresh[id(p)] = False
        else:  # accumulation: a second gradient goes out on the side stream too, added on the host once landed
            self._land_adds()  # the previous one (at most one accumulated gradient in flight: host RAM)
            self._adds.extend(zip([h.grad], self.pair.to_host_async([p.grad])))
        p.grad = None

    def _land_adds(self) -> None:
        """Add the accumulated gradients in flight to their host buffers, once the side stream has run them."""
        if self._adds:
            self.pair.sync()
            for buf, g in self._adds:
                buf.add_(g)
            self._adds.clear()

    def step(self, closure=None):
        self.pair.sync()
        self._land_adds()
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
        self._land_adds()
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


def _offload_optimizer(optimizer: Any, model: nn.Module, plan: Plan, ctx: Context) -> HostOptimizer:
    groups = optimizer.param_groups  # host RAM was guarded for the whole plan in _prepare
    pair = pair_of(model, ctx.device)
    # the groups as the Trainer made them (param_groups: decay or not), not as the optimizer rewrote them
    # (adafactor rescales weight_decay to its relative lr: rescaled twice, the decay was ~1000x too small)
    plain_groups = [{"params": g["params"], "weight_decay": ctx.weight_decay if g.get("weight_decay") else 0.0}
                    for g in groups]

    def make(host_groups: list[dict]) -> Any:
        # optimizers that read the model (adam-mini: parameter names; galore: its linear layers) see it
        # over the host copies they update
        host_of = {id(p): h for g, hg in zip(plain_groups, host_groups) for p, h in zip(g["params"], hg["params"])}
        cpu_ctx = Context(device=torch.device("cpu"), env=ctx.env, model_name=ctx.model_name, lr=ctx.lr,
                          weight_decay=ctx.weight_decay, model=_host_mirror(model, host_of, {}))
        return REGISTRY[plan.optimizer].make_optimizer(host_groups, plan, cpu_ctx)
    return HostOptimizer(plain_groups, make, pair)


def _host_mirror(m: nn.Module, host_of: dict[int, torch.Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    """``m``'s module tree (names, layers, config: shallow copies) over the host copies of its trainable
    parameters (``host_of``: id of the device parameter -> its host copy); buffers, frozen parameters and
    every other attribute shared, a module used twice mirrored once."""
    if id(m) not in memo:
        c = memo[id(m)] = copy.copy(m)
        c._parameters = {n: host_of.get(id(p), p) if p is not None else None for n, p in m._parameters.items()}
        c._modules = {n: _host_mirror(ch, host_of, memo) if ch is not None else None for n, ch in m._modules.items()}
    return memo[id(m)]


class HostStateOptimizer(WrappedOptimizer):
    """``offload:params`` without ``offload:optimizer``: the plain optimizer updates the host-side
    block parameters in place, so their state lives on the host too (CPU tensors on a GPU run);
    this tags it host side for the tracker after each step. (Their gradients are complete when
    backward returns: the streamer synchronizes its copies at the end of backward.)"""

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

    Strategies: ``cpu`` / ``pinned`` (copy to host RAM, pageable or pinned through a
    :class:`DevicePair`, guarded by :func:`host_ram_guard` with pinned blocks rounded up), ``int8``
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
    sizes = [state[p][k].numel() * state[p][k].element_size() for p, k in keys] + [
        p.grad.numel() * p.grad.element_size() for p in grads]
    if strategy == "cpu":
        host_ram_guard(moved, "optimizer state for evaluation")
    elif strategy == "pinned":
        host_ram_guard(0, "optimizer state for evaluation (pinned)", pinned=sizes)
    pairs: dict[torch.device, DevicePair] = {}

    def stash(v: torch.Tensor) -> tuple:
        if strategy == "int8":
            return _q8(v), v.device
        if strategy == "drop":
            return None, v.device
        if strategy == "pinned":
            pair = pairs.setdefault(v.device, DevicePair(v.device))
            return pair.to_host(v), v.device
        return _host_copy(v), v.device

    def unstash(stored: tuple) -> torch.Tensor:
        data, dev = stored
        if strategy == "int8":
            return _dq8(data).to(dev)
        return pairs[dev].to_compute(data) if strategy == "pinned" else data.to(dev)

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


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A pageable host copy (``offloaded(strategy="cpu")``)."""
    with host_side():
        h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        h.copy_(t.detach())
    return mark_host(h)

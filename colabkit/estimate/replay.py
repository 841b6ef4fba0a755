"""The optimizer step in the estimator's trace without running it op by op: a replay from profiles.

Traced op by op under fake tensors and the tracker, an optimizer step costs Python work per op and per
parameter (AdamW4bit: a loop over chunks of every tensor) -- most of a ``plan`` run. Yet what the
tracker needs from it is only which storages it creates and frees. For optimizers that update each
parameter on its own (:data:`REPLAYABLE`), :func:`install` replaces ``step`` on the optimizer instance by
a replay: the step is profiled once per (optimizer class, hyperparameters, the parameters' shapes,
dtypes and device, allocator rounding) by running the real ``step`` on fresh fake parameters of those shapes
(:func:`profile`), and replayed as the state storages the real step keeps (same bytes, same order) with,
before each new state storage and at the end, one temporary as large as the step's scratch at that local
peak. The peaks the tracker records -- total, each category's own, the categories at the peak -- are
those of the real step, because between two replayed points the real step's live bytes only go down.
Under ``fused-step`` each call steps one parameter, so profiles are per parameter shape and shared by
every model and depth that has it; a plain step is profiled over the whole parameter list (scratch one
parameter leaves alive into the next one's update counts, as it does in the real step).

>>> import torch
>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> with FakeTensorMode():
...     p = torch.nn.Parameter(torch.empty(64, 32)); p.grad = torch.empty(64, 32)
...     opt = torch.optim.AdamW([p], foreach=False)
...     prof = profile(opt)
>>> prof.state_bytes, prof.steps[1]   # two fp32 moments + the step count; scratch: sqrt(v), then v / c
(16388, ((3, 16384),))
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..memory import _storages, tensors_in
from ..techniques.optimizers import AdamW4bit

# Optimizers whose step updates each parameter from its own gradient and state, one after another, with
# nothing shared between parameters (torch's single-tensor paths: the default for CPU tensors).
REPLAYABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adafactor, AdamW4bit)


@dataclass(frozen=True)
class StepProfile:
    """One parameter's optimizer step as the tracker sees it. ``state``: bytes of each state storage in the
    order the first step creates them; ``steps[t]`` (t = 0: the first step, 1: every later one): the
    points ``(state storages created so far, scratch bytes live)`` at the step's local peaks, reduced to
    those no other point exceeds in both."""
    state: tuple[int, ...]
    steps: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]

    @property
    def state_bytes(self) -> int:
        return sum(self.state)


_LIFT = torch.ops.aten.lift_fresh.default
_ITEM = torch.ops.aten._local_scalar_dense.default


class _Recorder(TorchDispatchMode):
    """Logs each storage an op creates (bytes rounded up to ``alloc_round``, as the tracker counts them)
    and its release: ``events`` holds ``(key, bytes)`` when created and ``(key, 0)`` when freed. A host read
    of a tensor's value (``.item()``) reads 1, as in the estimator's trace (step counters start at 1)."""

    def __init__(self, alloc_round: int):
        super().__init__()
        self.round, self.events, self.live, self._n = alloc_round, [], {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ITEM:
            return 1
        out = func(*args, **(kwargs or {}))
        # torch.tensor(...) builds its data without dispatch, then lifts it: a new storage under FakeTensorMode
        inputs = set() if func is _LIFT else None
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                if id(st) in self.live:
                    continue
                if inputs is None:  # views and in-place results share an input's storage
                    inputs = {id(s) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                              for s in _storages(a)}
                n = -(-st.nbytes() // self.round) * self.round
                if id(st) in inputs or n == 0:
                    continue
                self._n += 1
                self.live[id(st)] = self._n
                self.events.append((self._n, n))
                weakref.finalize(st, self._free, self._n, id(st))
        return out

    def _free(self, key: int, sid: int) -> None:
        if self.live.get(sid) == key:
            del self.live[sid]
        self.events.append((key, 0))


def _points(events: list[tuple[int, int]], state_keys: set[int], state: list[int]) -> tuple[tuple[int, int], ...]:
    """The step's local peaks as ``(state storages so far, scratch bytes)``; appends new state sizes to ``state``."""
    size: dict[int, int] = {}
    scratch, points = 0, []
    for i, (key, n) in enumerate(events):
        if n:  # created
            size[key] = n
            if key in state_keys:
                state.append(n)
            else:
                scratch += n
            if i + 1 == len(events) or events[i + 1][1] == 0:  # the live bytes go down next: a local peak
                points.append((len(state), scratch))
        elif key in size and key not in state_keys:
            scratch -= size.pop(key)
    if not points or points[-1][0] != len(state):
        points.append((len(state), 0))
    # keep the points that no other point exceeds in both state and scratch (those set every peak)
    keep = [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]
    return tuple(dict.fromkeys(keep))


_PROFILES: dict[tuple, StepProfile] = {}
PROFILES_KEPT = 1024


def _hyper(group: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))


def _signature(groups: list[dict], assume_grads: bool = False) -> tuple:
    """What a step's storages depend on: each group's hyperparameters and each parameter's shape, dtype,
    device type (the kernels a step picks) and gradient dtype (None: no gradient, skipped by the step; ``assume_grads``: the parameter's dtype for each
    parameter that requires one, as backward will make it)."""
    def grad(p):
        if assume_grads:
            return p.dtype if p.requires_grad else None
        return None if p.grad is None else p.grad.dtype
    return tuple((_hyper(g), tuple((tuple(p.shape), p.dtype, grad(p), p.device.type) for p in g["params"]))
                 for g in groups)


def _key(opt: Any, signature: tuple, alloc_round: int) -> tuple:
    return type(opt), signature, alloc_round


def profile(opt: torch.optim.Optimizer, alloc_round: int = 1, assume_grads: bool = False) -> StepProfile:
    """The profile of ``opt.step()`` on its current parameter groups (all of them, or the one parameter a
    fused-step hook shows it): the real ``step`` run twice on fresh fake parameters of the same shapes,
    dtypes and device, outside the caller's modes; cached per (class, :func:`_signature`,
    ``alloc_round``): :func:`_key`."""
    groups = opt.param_groups
    sig = _signature(groups, assume_grads)
    key = _key(opt, sig, alloc_round)
    if key in _PROFILES:
        return _PROFILES[key]
    # On fake tensors of the parameters' own device, in a fresh FakeTensorMode outside the caller's modes:
    # the recording sees only this step, and the step takes the path it takes in the trace. Not on meta
    # tensors: a step picks its kernels by device (torch's and the blockwise AdamWs' fused AdamW runs on
    # CPU and CUDA tensors, not on meta ones, where the slower path's scratch would be recorded) and by
    # fakeness (a blockwise AdamW runs one chunk of each tensor on fake tensors, all of them on meta ones).
    with _disable_current_modes():
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        twins = []
        with fake:
            for g, (_, params) in zip(groups, sig):
                ps = []
                for shape, dtype, gdtype, dev in params:
                    q = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=dev), requires_grad=True)
                    q.grad = None if gdtype is None else torch.empty(shape, dtype=gdtype, device=dev)
                    ps.append(q)
                twins.append(dict(g, params=ps))  # the caller's hyperparameters, fresh parameters
        opt.param_groups = twins
        state: list[int] = []
        steps = []
        try:
            for _ in range(2):
                rec = _Recorder(alloc_round)
                with fake, rec:
                    type(opt).step(opt)
                keys = {rec.live[id(s)] for g in twins for q in g["params"]
                        for t in tensors_in(opt.state.get(q, {})) for s in _storages(t) if id(s) in rec.live}
                steps.append(_points(rec.events, keys, state))
        finally:
            opt.param_groups = groups
            for g in twins:
                for q in g["params"]:
                    opt.state.pop(q, None)
    if len(_PROFILES) >= PROFILES_KEPT:  # a long session (largest's bisection): start over rather than grow
        _PROFILES.clear()
    _PROFILES[key] = prof = StepProfile(tuple(state), tuple(steps))
    return prof


def prefill(opt: Any, alloc_round: int = 1) -> bool:
    """Create the state storages the first step leaves (same bytes, same order), so a trace can start at the
    second step; False (nothing created) when the first step's scratch peaks above the later steps' (then
    the first step is not dominated by the second and must be traced). The first step's forward and backward
    differ from the second's only by the state the second carries; a fused-step wrapper's parameters are
    filled one by one, as its hooks step them."""
    inner = getattr(opt, "optimizer", opt)
    calls = []  # the parameter lists step() will see: one per parameter under fused-step, else all at once
    for group in inner.param_groups:
        ps = [p for p in group["params"] if p.requires_grad]
        calls += [[(group, [p]) for p in ps]] if inner is not opt else [[(group, ps)]]
    if inner is opt:
        calls = [[c for call in calls for c in call]]
    else:
        calls = [[c] for call in calls for c in call]
    plans = []
    for call in calls:
        groups = inner.param_groups
        inner.param_groups = [dict(g, params=ps) for g, ps in call]
        try:  # with gradients as backward makes them: the parameter's dtype
            prof = profile(inner, alloc_round, assume_grads=True)
        finally:
            inner.param_groups = groups
        if max(x for _, x in prof.steps[0]) > max(x for _, x in prof.steps[1]):
            return False
        plans.append((call, prof))
    for call, prof in plans:
        first = call[0][1][0]
        held = inner.state[first].setdefault("replayed", [])
        for n in prof.state:
            held.append(torch.empty(n, dtype=torch.uint8, device=first.device))
        for _, ps in call:
            for p in ps:
                inner.state[p]["replayed_steps"] = 1
    return True


def install(opt: Any, alloc_round: int = 1) -> bool:
    """Replace ``opt.step`` (the innermost optimizer: a fused-step wrapper's ``.optimizer``) by its replay;
    False (nothing changed) when its class is not in :data:`REPLAYABLE` or it runs a multi-tensor path."""
    inner = getattr(opt, "optimizer", opt)
    if type(inner) not in REPLAYABLE or any(g.get("foreach") or g.get("fused") for g in inner.param_groups):
        return False

    def step(closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in inner.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return loss
        prof = profile(inner, alloc_round)
        st = inner.state[params[0]]  # the replayed state storages, found by the tracker like real state
        held = st.setdefault("replayed", [])
        later = any(inner.state[p].get("replayed_steps") for p in params)
        for p in params:
            inner.state[p]["replayed_steps"] = inner.state[p].get("replayed_steps", 0) + 1
        for n_state, scratch in prof.steps[1 if later else 0]:
            while len(held) < n_state:
                held.append(torch.empty(prof.state[len(held)], dtype=torch.uint8, device=params[0].device))
            if scratch:
                tmp = torch.empty(scratch, dtype=torch.uint8, device=params[0].device)
                del tmp
        return loss

    inner.step = step
    return True

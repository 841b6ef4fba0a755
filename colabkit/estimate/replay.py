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
from ..techniques.optimizers import AdamW4bit, AdamW8bit
from .counting import Traffic, add_replayed
from .quickfake import QuickFakeMode

# Optimizers whose step updates each parameter from its own gradient and state, one after another, with
# nothing shared between parameters (torch's single-tensor paths: the default for CPU tensors).
REPLAYABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adafactor, AdamW4bit, AdamW8bit)


@dataclass(frozen=True)
class StepProfile:
    """One parameter's optimizer step as the tracker sees it. ``state``: bytes of each state storage in the
    order the first step creates them; ``steps[t]`` (t = 0: the first step, 1: every later one): the
    points ``(state storages created so far, scratch bytes live)`` at the step's local peaks, reduced to
    those no other point exceeds in both."""
    state: tuple[int, ...]
    steps: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]
    kernels: tuple = ()  # per step (t = 0, 1): (kernels, bytes, bytes by size) the real step ran (.counting)

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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # only around a profiled step on fake tensors, where nothing is
        return False                       # compiled: no guard frame around each op (as Traffic, QuickFakeMode)

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
    return _frontier(points)


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
        fake = QuickFakeMode(allow_non_fake_inputs=True)
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
        steps, kernels = [], []
        try:
            for _ in range(2):
                rec = _Recorder(alloc_round)
                with fake, rec, Traffic() as traffic:
                    type(opt).step(opt)
                kernels.append(traffic.snapshot())
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
    _PROFILES[key] = prof = StepProfile(tuple(state), tuple(steps), tuple(kernels))
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


def optimizer_for(plan: Any, lr: float, groups: list[tuple[float, list[tuple[tuple[int, ...], torch.dtype]]]]) -> Any:
    """The optimizer ``plan`` makes for parameter groups described as ``(weight decay, [(shape, dtype)])`` (the
    Trainer's ``param_groups``) with learning rate ``lr``, on fake parameters; None when its step cannot be
    replayed (:data:`REPLAYABLE`)."""
    from ..env import env
    from ..plan import REGISTRY, Context, PlanError

    key = (plan.optimizer_token, plan.get("sgd"), lr, tuple((wd, tuple(shapes)) for wd, shapes in groups))
    if key in _MADE:
        return _MADE[key]
    if len(_MADE) >= PROFILES_KEPT:
        _MADE.clear()
    with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=True):
        made = [{"params": [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes],
                 "weight_decay": wd} for wd, shapes in groups]
        try:
            opt = REGISTRY[plan.optimizer].make_optimizer(made, plan, Context(device=torch.device("cpu"), env=env(), lr=lr))
        except PlanError:  # made from the model itself (adam-mini: its parameter names), not from groups
            opt = None
    _MADE[key] = opt if type(opt) in REPLAYABLE else None
    return _MADE[key]


_MADE: dict[tuple, Any] = {}  # optimizer_for's optimizers (of fake parameters), per token, momentum, lr and groups


def call_profile(opt: Any, call: list[tuple[int, list[int]]], alloc_round: int = 1, whole: bool = False) -> StepProfile:
    """The profile of ``opt.step()`` shown the parameters ``call`` names (group index, parameter indices):
    all of them for a plain step, one for a fused-step hook; gradients as backward makes them. A step over
    many parameters is composed from one-parameter profiles (:func:`compose`) where the optimizer's step is
    separable (:func:`_separable`), else (or with ``whole``) profiled whole."""
    groups = opt.param_groups
    multi = any(groups[gi].get("foreach") or groups[gi].get("fused") for gi, _ in call)  # one kernel: cheap whole
    if not whole and not multi and sum(len(pis) for _, pis in call) > 4 and (per_call := _separable(opt, call, alloc_round)) is not None:
        return compose([call_profile(opt, [(gi, [pi])], alloc_round) for gi, pis in call for pi in pis], per_call)
    opt.param_groups = [dict(groups[gi], params=[groups[gi]["params"][pi] for pi in pis]) for gi, pis in call]
    try:
        return profile(opt, alloc_round, assume_grads=True)
    finally:
        opt.param_groups = groups


def compose(profs: list[StepProfile], per_call: int = 0) -> StepProfile:
    """The profile of one step over several parameters from each parameter's own, for an optimizer that steps
    them one after another and keeps nothing of one parameter's update alive into the next one's: the state
    storages in order; at each local peak of the first step, the state of the parameters before plus those
    made so far; in a later step, all of the state. Kernels add up, less ``per_call`` for each parameter but
    the first (what a step launches once whatever its parameters: a step counter, buffers).

    >>> a = StepProfile((8, 8), (((1, 9), (2, 6)), ((2, 6),)), ((3, 10, (), 0), (2, 10, (), 0)))
    >>> c = compose([a, a], per_call=1); c.state, c.steps, c.kernels[1][:2]
    ((8, 8, 8, 8), (((3, 9), (4, 6)), ((4, 6),)), (3, 20))
    """
    state: list[int] = []
    first, later = [], []
    for p in profs:
        first += [(len(state) + k, x) for k, x in p.steps[0]]
        state += p.state
    later = [(len(state), x) for p in profs for _, x in p.steps[1]]
    kernels = []
    for t in range(2):
        sizes: dict[int, int] = {}
        for p in profs:
            for k, v in p.kernels[t][2]:
                sizes[k] = sizes.get(k, 0) + v
        kernels.append((sum(p.kernels[t][0] for p in profs) - per_call * (len(profs) - 1),
                        sum(p.kernels[t][1] for p in profs), tuple(sorted(sizes.items())),
                        sum(p.kernels[t][3] for p in profs)))
    return StepProfile(tuple(state), (_frontier(first), _frontier(later)), tuple(kernels))


def _frontier(points: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The points no other point exceeds in both state and scratch (those set every peak), in order."""
    keep = [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]
    return tuple(dict.fromkeys(keep))


_SEPARABLE: dict[tuple, int | None] = {}


def _separable(opt: Any, call: list[tuple[int, list[int]]], alloc_round: int) -> int | None:
    """Whether ``opt``'s step over the parameters of ``call`` is the composition of its one-parameter steps,
    and the kernels it launches once per step (:func:`compose`'s ``per_call``); None if not. Checked against
    the real step over a few of the parameters and over two -- the state, a later step's peaks, whether the
    first step is dominated, the kernels' bytes, sizes and FLOPs must compose exactly, and the kernel count
    with one ``per_call`` for both; cached per class, rounding, and the samples' hyperparameters and shapes."""
    groups = opt.param_groups
    # the first two of the first group, the first of the next (a change of group) and the largest (state or
    # buffers a step keeps across its parameters show after a smaller one), in the call's order
    numel = {(gi, pi): groups[gi]["params"][pi].numel() for gi, pis in call for pi in pis}
    picked = {(call[0][0], pi) for pi in call[0][1][:2]} | {(gi, pis[0]) for gi, pis in call[1:2]} | {max(numel, key=numel.get)}
    many = [(gi, [pi for pi in pis if (gi, pi) in picked]) for gi, pis in call]
    samples = ([(gi, pis) for gi, pis in many if pis], [(call[0][0], call[0][1][:2])])
    key = (type(opt), alloc_round, tuple((_hyper(groups[gi]), tuple(tuple(groups[gi]["params"][pi].shape) for pi in pis))
                                         for gi, pis in samples[0]))  # what decides: the samples
    if key not in _SEPARABLE:
        if len(_SEPARABLE) >= PROFILES_KEPT:
            _SEPARABLE.clear()
        found = []
        for sample in samples:
            n = sum(len(pis) for _, pis in sample)
            real = call_profile(opt, sample, alloc_round, whole=True)
            parts = compose([call_profile(opt, [(gi, [pi])], alloc_round) for gi, pis in sample for pi in pis])
            dominated = [max(x for _, x in p.steps[0]) <= max(x for _, x in p.steps[1]) for p in (real, parts)]
            per_call, left = divmod(parts.kernels[1][0] - real.kernels[1][0], max(1, n - 1))
            same = (real.state == parts.state and real.steps[1] == parts.steps[1] and dominated[0] == dominated[1]
                    and real.kernels[1][1:] == parts.kernels[1][1:] and not left and n > 1)
            found.append(per_call if same else None)
        _SEPARABLE[key] = found[0] if found[0] is not None and found[0] == found[1] else None
    return _SEPARABLE[key]


def install(opt: Any, alloc_round: int = 1) -> bool:
    """Replace ``opt.step`` (the innermost optimizer: a fused-step wrapper's ``.optimizer``) by its replay;
    False (nothing changed) when its class is not in :data:`REPLAYABLE`, or under a fused-step wrapper when it
    runs a multi-tensor path (foreach, fused). A plain multi-tensor step is profiled over the whole parameter
    list like any plain step: what it creates and frees is recorded as the real kernel makes it."""
    inner = getattr(opt, "optimizer", opt)
    multi = any(g.get("foreach") or g.get("fused") for g in inner.param_groups)
    if type(inner) not in REPLAYABLE or (multi and inner is not opt):  # fused-step steps one tensor per call
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
        add_replayed(prof.kernels[1 if later else 0])  # what the real step's kernels move, for the step time
        for n_state, scratch in prof.steps[1 if later else 0]:
            while len(held) < n_state:
                held.append(torch.empty(prof.state[len(held)], dtype=torch.uint8, device=params[0].device))
            if scratch:
                tmp = torch.empty(scratch, dtype=torch.uint8, device=params[0].device)  # noqa: F841 (seen, then freed)
                del tmp
        return loss

    inner.step = step
    return True

"""The fake-tensor trace: the real Trainer's steps run on shapes only, under a tracker.

:func:`trace` builds the model and runs ``steps`` optimizer steps of :class:`~colabkit.trainer.Trainer`
under ``FakeTensorMode`` (:class:`~.quickfake.QuickFakeMode`: torch's, with short paths for the common ops) with a
:class:`~colabkit.memory.MemoryTracker` inside, so a 20B model is traced on a laptop CPU and every technique
that is plain torch is covered without a special case.
:func:`~.substitutes.trace_with_substitutes` replaces what cannot run on fake tensors (bitsandbytes kernels) by
the technique's own theory and says so in ``notes``.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import MemoryTracker, host_side, is_host
from ..models import GPT, blocks_of, build_model, count_params, gpt_config, hf_from_config, hub_config
from ..plan import REGISTRY, Plan, PlanError, param_groups
from ..techniques import lora as _lora
from ..trainer import Trainer
from . import replay as _replay, trace_cache as _disk, zero as _zero
from .as_gpu import _attention_as, check_as_gpu  # noqa: F401 (check_as_gpu: its old home, re-exported)
from .counting import compute_plan, counting
from .depth import DEPTHS, _affine, _depth_key, _label_segments, _label_step
from .inputs import fake_batch
from .quickfake import QuickFakeMode

# The CUDA caching allocator hands out blocks in multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize), so on a GPU profile every storage is rounded up to 512 B.
CUDA_ALLOC_ROUND = 512
_env = importlib.import_module("..env", __package__)  # the module: the package exports a function named env
# Optimizers whose kernels read tensor data (bitsandbytes): they cannot run on fake tensors, so the trace runs
# a stateless SGD in their place and adds their state from its formula -- without importing bitsandbytes.
# adamw8bit only where bitsandbytes steps it (substitutes.steps_own_8bit_kernel): elsewhere colabkit's AdamW8bit
# is traced.
NO_FAKE_OPTIMIZERS = ("adamw8bit", "paged-adamw8bit", "lion", "lion8bit")


# The reference path (every step traced op by op, the whole model, nothing cached): COLABKIT_ESTIMATE_FULL=1
# or the full_trace() block. The fast path is tested against it.
_FULL = [os.environ.get("COLABKIT_ESTIMATE_FULL", "") == "1"]


@contextlib.contextmanager
def full_trace(on: bool = True):
    """Within the block, estimates take the reference path: the whole model traced, every optimizer step
    run op by op, no cache -- what the fast path's answers are tested against.

    >>> with full_trace():
    ...     trace("gpt-tiny", "baseline", 2, 16)["breakdown"]["optimizer"] > 0
    True
    """
    prev, _FULL[0] = _FULL[0], on
    try:
        yield
    finally:
        _FULL[0] = prev


# offload:params on a GPU (the plan is traced without it): each block gradient leaves the device as soon as it
# is complete, for a pinned host buffer (OffloadedBlock's grads_to_host). Traced so: the backward's peak is
# then where it is in the real run (early in backward, with the logits' gradient, not at its end with every
# gradient), which no split of the plain trace's peak can find.
_STREAM_BLOCK_GRADS = [False]


@contextlib.contextmanager
def block_grads_to_host(on: bool = True):
    """Within the block, traces move each transformer block's gradient to the host side once complete."""
    prev, _STREAM_BLOCK_GRADS[0] = _STREAM_BLOCK_GRADS[0], on
    try:
        yield
    finally:
        _STREAM_BLOCK_GRADS[0] = prev


def _grad_to_host(p: torch.Tensor) -> None:
    """A post-accumulate-grad hook: the device gradient (counted from its creation) replaced by a host one."""
    if p.grad is not None and not is_host(p.grad):
        with host_side():
            h = torch.empty_like(p.grad)
        p.grad = h


def _stream_block_grads(model: torch.nn.Module) -> None:
    try:
        params = [p for p in blocks_of(model).parameters() if p.requires_grad]
    except (ValueError, AttributeError, TypeError):
        return
    for p in params:
        p.register_post_accumulate_grad_hook(_grad_to_host)


_DEVICE = torch.ops.prim.device.default


class _HostScalars(TorchDispatchMode):
    """Answer host reads of tensor values (``.item()``, ``float(loss)``) on fake tensors: only shapes
    matter for memory. The GradScaler's inf flags read 0 (no inf: the step runs, as it does on real
    data); every other scalar reads 1 (step counters start at 1; nothing divides by zero)."""

    def __init__(self):
        super().__init__()
        self.flags: set[int] = set()  # storages written as found_inf by the GradScaler's unscale

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # nothing is compiled in a trace: no guard frame around each op
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and hasattr(args[0], "fake_device"):
            # a fake tensor's .device (autograd asks for every gradient: most ops of a trace): answered here,
            # above the tracker (it allocates nothing) and without FakeTensorMode's dispatch
            return args[0].fake_device
        if func is torch.ops.aten._local_scalar_dense.default:
            return 0 if id(args[0].untyped_storage()) in self.flags else 1
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self.flags.add(id(args[1].untyped_storage()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _valueless_inits():
    """``torch.nn.init.trunc_normal_`` redraws until no value falls outside [a, b] (``while mask.any()``); on fake
    tensors, whose ``.item()`` a trace answers with 1, that loop would never end (a ViT's or any module's
    initialisation calling it). During a trace its sampler leaves a fake tensor as it is -- a trace has no values
    -- and hands a real one to torch's. Patched at the sampler torch's ``trunc_normal_`` calls, which also serves
    the copies of ``trunc_normal_`` that libraries keep (transformers' ``TORCH_INIT_FUNCTIONS``)."""
    init = torch.nn.init
    real = getattr(init, "_no_grad_trunc_normal_", None)
    if real is None:  # another torch: its own
        yield
        return

    def sample(tensor, *args, **kwargs):
        return tensor if isinstance(tensor, FakeTensor) else real(tensor, *args, **kwargs)
    init._no_grad_trunc_normal_ = sample
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = real


@contextlib.contextmanager
def _swap_by_data():
    """``Module.to()`` swaps fake parameters with ``torch.utils.swap_tensors``, which refuses tensors that
    fake mode holds weak references to; during a trace fall back to replacing ``.data`` (the new tensor
    is allocated either way, so the memory is the same)."""
    import torch.utils as tu

    real = tu.swap_tensors

    def swap(t1, t2):
        try:
            real(t1, t2)
        except RuntimeError:
            t1.data = t2

    tu.swap_tensors = swap
    try:
        yield
    finally:
        tu.swap_tensors = real


def _import_first(plan: Plan, model_fn: Any) -> None:
    """Import, before the fake mode, the libraries the plan or the model loads on first use: a module imported
    inside a trace would keep the fake tensors it makes at import for good (peft's LoHa has a ``torch.tensor(1)``
    default argument) and the trace would count them."""
    toks = plan.tokens
    names = (["transformers"] if isinstance(model_fn, str) and model_fn.startswith(("hf:", "llama:")) else []) + \
        (["transformers", "peft"] if any(t.startswith(("lora", "qlora")) for t in toks) else [])
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # (the plan's own check says what to install)
            pass


def _build(model_fn: Callable[[], torch.nn.Module] | str, seq: int) -> torch.nn.Module:
    # (torch.nn.init is left alone: swapping its initialisers for no-ops while a model is built -- ~12% fewer
    # fake ops, no measurable time -- let transformers, first imported inside, keep the no-ops for good)
    return _build_model(model_fn, seq)


def _build_model(model_fn: Callable[[], torch.nn.Module] | str, seq: int) -> torch.nn.Module:
    if isinstance(model_fn, str) and model_fn.startswith("hf:"):
        model = hf_from_config(model_fn[3:], seq)  # shapes only: a shipped or cached config, never weights
    else:
        model = build_model(model_fn, seq=seq) if isinstance(model_fn, str) else model_fn()
    model._colabkit_placed = True  # built where it runs: .to() would try to swap fake parameters
    return model


def trace(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str, batch: int, seq: int, steps: int = 2,
          alloc_round: int = 1, profile: dict | None = None, notes: list[str] | None = None,
          inputs: dict[str, Any] | None = None, base: bool = False) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of the real Trainer on fake tensors under a tracker; its report.
    ``inputs``: a batch description (:func:`fake_batch`) instead of (B, S) token ids. ``base``: the last step
    only, with no optimizer state and a step that only notes what is live when it is called (``at_step``,
    by category) -- what :func:`with_optimizer` completes for any plain optimizer (:func:`_traced`).

    >>> trace("gpt-tiny", "baseline", 2, 16)["breakdown"]["grads"] > 0
    True
    """
    plan = Plan.parse(plan)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom")
    notes = [] if notes is None else notes
    _import_first(plan, model_fn)
    with QuickFakeMode(allow_non_fake_inputs=True), _swap_by_data(), _valueless_inits(), \
            _attention_as(profile, plan, notes):
        tracker = MemoryTracker(device="cpu", alert_at=None, budget_bytes=1 << 62, alloc_round=alloc_round,
                                guard_compile=False)
        with tracker, _HostScalars():  # host reads answered above the tracker: it sees no op for them
            # on a GPU profile, offload:activations runs through the CPU twin (host side tagged, copies back counted)
            trainer = Trainer(_shape_only(_build(model_fn, seq)), plan, device="cpu", model_name=name, tracker=tracker,
                              offload_sim=profile is not None and "activations" in (plan.get("offload") or ()))
            if _STREAM_BLOCK_GRADS[0]:
                _stream_block_grads(trainer.model)
            _label_segments(trainer.model, tracker)
            if not base:
                _label_step(trainer.optimizer, trainer.model, tracker)
            run = range(steps)
            at_step: list[tuple[str, str | None, dict[str, int], list[tuple[int, int]]]] = []
            if base:  # forward, backward and the step's surroundings; the optimizer is added afterwards
                inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # fused-step's: one tensor a call
                # positions in the recipe's groups (_recipe), which any plain optimizer of this cached base is made
                # from -- not in this optimizer's own (GaLore regroups its parameters: other indices)
                recipe = param_groups(trainer.model, trainer.ctx.weight_decay)
                where = {id(p): (gi, pi) for gi, g in enumerate(recipe) for pi, p in enumerate(g["params"])}
                inner.step = lambda closure=None: at_step.append((
                    tracker.current_phase, tracker.current_segment, tracker.current(),
                    [where[id(p)] for g in inner.param_groups for p in g["params"] if p.grad is not None]))
                if trainer.scaler.is_enabled():  # the loss scale and growth tracker the first step creates
                    trainer.scaler.scale(torch.ones(()))
                run = range(steps - 1, steps)
            # the optimizer's step replayed from profiles of the real one (same storages); and where the first
            # step is dominated by the second (it only lacks the state), the state made directly and one traced
            elif not _FULL[0] and _replay.install(trainer.optimizer, alloc_round) and steps > 1 \
                    and _replay.prefill(trainer.optimizer, alloc_round):
                if trainer.scaler.is_enabled():  # the loss scale and growth tracker the first step creates
                    trainer.scaler.scale(torch.ones(()))
                run = range(steps - 1, steps)
            params = count_params(trainer.model)
            trainable = count_params(trainer.model, trainable_only=True)
            shapes = [tuple(p.shape) for p in trainer.model.parameters() if p.requires_grad]
            try:  # what offload:params streams: the transformer blocks' trainable weights
                block_shapes = [tuple(p.shape) for p in blocks_of(trainer.model).parameters() if p.requires_grad]
            except (ValueError, AttributeError, TypeError):
                block_shapes = None
            frozen = _frozen(trainer.model)
            frozen16 = [(n, q) for n, q, es in frozen if es == 2]
            try:  # each block's parameter bytes: FSDP2's all-gather units (estimate.zero)
                block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks_of(trainer.model)]
            except ValueError:
                block_bytes = []
            tracker.reset_peaks()
            for step in run:
                trainer.step_count = step
                tracker.set_step(step)
                # the last step also counted (FLOPs, kernels, bytes: the step-time prediction's input), so an
                # estimate runs each fake step once; a replayed optimizer step adds its profiled kernels
                with counting() if step == run[-1] else contextlib.nullcontext() as counter, _zero.no_cast_copies():
                    trainer.step(fake_batch(inputs, batch, seq))
        r = tracker.report()
    cfg = getattr(trainer.model, "config", None)
    return {"peak_bytes": r["peak_bytes"], "breakdown": r["breakdown"], "at_peak": r["at_peak"],
            "host_bytes": r.get("host_bytes") or 0,
            "peak_phase": r["peak_phase"], "phase_peaks": r["phase_peaks"], "segment_peaks": r.get("segment_peaks", {}),
            "params": params, "trainable_params": trainable,
            "trainable_shapes": shapes, "block_shapes": block_shapes, "frozen16": frozen16, "frozen": frozen, "config": cfg,
            "block_bytes": block_bytes, "counts": counter.result(trainable), "counted_plan": compute_plan(plan),
            **({"at_step": at_step, "recipe": _recipe(trainer)} if base else {})}


_VALUES = ("its step holds a tensor whose size depends on the data's values ({op}), which a trace of shapes does "
           "not have: measure a step of it instead -- colabkit.train(model, data=[batch], plan=..., steps=2)['report'] "
           "holds its measured peak_bytes and breakdown")


def _shape_only(model: torch.nn.Module) -> torch.nn.Module:
    """Refuse, before tracing, a model whose loss sizes its buffers from the labels' values: transformers' CTC heads
    (the alignment table is batch x frames x (2 x the longest target + 1), the targets picked by their values)."""
    if type(model).__name__.endswith("ForCTC"):
        raise PlanError(f"estimate cannot trace {type(model).__name__}: "
                        + _VALUES.format(op="the CTC loss's alignment table, sized by the longest target"))
    return model


@contextlib.contextmanager
def values_needed(name: str, default_batch: bool = False):
    """An op whose output's size depends on tensor values (``nonzero``, ``masked_select``, ...) cannot run on fake
    tensors: said as colabkit's refusal, with what to do, instead of FakeTensorMode's exception (around the whole
    trace, after the substitutes -- an optimizer's stand-in -- have had their try). ``default_batch``: the trace
    fed colabkit's (batch, seq) token ids to your model, so a refusal of its labels says to describe your batch."""
    try:
        yield
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise PlanError(f"estimate cannot trace {name}: " + _VALUES.format(op=e.func)) from None
    except PlanError as e:
        if not default_batch or "labels" not in str(e):
            raise
        raise PlanError(f"{e} -- these are the labels of estimate's default batch ((batch, seq) token ids, labels "
                        "alike), not yours: describe your batch with inputs=, e.g. inputs={'input_ids': ((8, 128), "
                        "torch.long), 'labels': ((8,), torch.long)} (multiple choice: input_ids (8, choices, 128))") from None


def _recipe(trainer: Trainer) -> tuple[float, list[tuple[float, list[tuple[tuple[int, ...], torch.dtype]]]]]:
    """What the plan's optimizer is made from: the learning rate, each group's weight decay and its
    parameters' shapes and dtypes (:func:`~.replay.optimizer_for`)."""
    return trainer.ctx.lr, [(g["weight_decay"], [(tuple(p.shape), p.dtype) for p in g["params"]])
                            for g in param_groups(trainer.model, trainer.ctx.weight_decay)]


_REAL_COMPUTE_DTYPE = _lora.compute_dtype


def _frozen(model: torch.nn.Module) -> list[tuple[int, bool, int]]:
    """``(numel, quantized by qlora, element size)`` of each frozen parameter; what qlora quantizes: linear
    weights used once (untied), not the output head."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if not frozen:  # nothing frozen: no need to look for linear layers (which may import transformers)
        return []
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out_emb = getattr(model, "get_output_embeddings", lambda: None)()
    linear = {id(m.weight) for n, m in model.named_modules() if _lora.quantizable(n, m)
              and uses.get(id(m.weight)) == 1 and m is not out_emb}
    return [(p.numel(), id(p) in linear, p.element_size()) for p in frozen]


# ----- the fast path: each distinct trace once, deep models from 2- and 3-layer traces (.depth) --------------------
_CACHE: "OrderedDict[tuple, tuple[dict, list[str]]]" = OrderedDict()
CACHE_SIZE = 256  # traces kept in this process (a few KiB each)


def _gpt_of(model_fn: Any, seq: int):
    """The GPTConfig a model is built from (a preset or ``gpt:LxD`` name, or a builder carrying
    ``_colabkit_config``), with the position table widened to ``seq`` as :func:`~colabkit.models.build_model`
    does; None for other families."""
    cfg = getattr(model_fn, "_colabkit_config", None)
    if cfg is None and isinstance(model_fn, str) and not model_fn.startswith("hf:"):
        try:
            cfg = gpt_config(model_fn, dropout=0.0)  # build_model's dropout
        except ValueError:
            return None
    if cfg is not None and seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    return cfg


def gpt_builder(cfg) -> Callable[[], torch.nn.Module]:
    """A builder of ``GPT(cfg)`` that the estimator recognises: its traces are cached and extrapolated in depth.

    >>> gpt_builder(gpt_config("gpt:3x64")).__name__
    'gpt:3x64:v256'
    """
    f = lambda: GPT(cfg)  # noqa: E731
    f.__name__ = f"gpt:{cfg.n_layer}x{cfg.n_embd}:v{cfg.vocab_size}"
    f._colabkit_config = cfg
    f._colabkit_key = repr(cfg)  # what its traces are cached under (as _traced keys a GPT)
    return f


# hf:<id> configs deeper than this are traced at DEPTHS and extrapolated, as a GPT deeper than DEPTHS is (a full
# fake trace of 80 blocks takes a minute on a 2-core machine); shallower ones are traced whole
HF_DEEP = 8


def deep_model(model_fn: Any, seq: int) -> tuple[int, Callable[[int], Callable[[], torch.nn.Module]]] | None:
    """``(L, builder_at(depth))`` of a model the estimator extrapolates in depth from traces at :data:`DEPTHS`: a
    GPT deeper than them, an ``hf:<id>`` config deeper than :data:`HF_DEEP` blocks; None otherwise. Each
    builder has a ``_colabkit_key`` (the model at that depth), under which its traces are cached.

    >>> L, at = deep_model("gpt:6x64", 16)
    >>> L, at(2)._colabkit_key == repr(gpt_config("gpt:2x64", dropout=0.0))
    (6, True)
    """
    cfg = _gpt_of(model_fn, seq)
    if cfg is not None:
        return (cfg.n_layer, lambda d: gpt_builder(replace(cfg, n_layer=d))) if cfg.n_layer > DEPTHS[1] else None
    if not (isinstance(model_fn, str) and model_fn.startswith("hf:")):
        return None
    hub = hub_config(model_fn[3:])
    key = _depth_key(hub)
    if key is None or getattr(hub, key) <= HF_DEEP or getattr(hub, "is_encoder_decoder", False):
        return None  # (an encoder-decoder has two stacks, and its own depth keys for each: traced whole)

    def at(depth: int) -> Callable[[], torch.nn.Module]:
        c = copy.deepcopy(hub)
        setattr(c, key, depth)
        f = lambda: hf_from_config(model_fn[3:], config=c)  # noqa: E731
        f.__name__, f._colabkit_key = model_fn, f"{model_fn}@{depth}"
        return f
    return getattr(hub, key), at


def _traced(model_fn, plan: Plan, batch: int, seq: int, steps: int, alloc_round: int, profile: dict | None,
            notes: list[str], inputs: dict | None = None) -> dict[str, Any]:
    """:func:`trace`, each distinct one once per process (a copy from the cache after that), and a GPT deeper
    than :data:`DEPTHS` from traces at those depths (:func:`_affine`); :func:`full_trace` turns both off.
    The key holds everything a trace depends on: the model (name or config), plan, batch, sequence, steps,
    allocator rounding, the GPU profile (attention kernel), T4 rules, and qlora's compute-dtype stand-in.
    A described batch (``inputs``, a user's own model) is traced as it is, uncached."""
    cfg = _gpt_of(model_fn, seq)
    model_key = (model_fn if isinstance(model_fn, str) else repr(cfg) if cfg is not None
                 else getattr(model_fn, "_colabkit_key", None))
    if _FULL[0] or model_key is None or inputs is not None:
        return trace(model_fn, plan, batch, seq, steps, alloc_round, profile, notes, inputs)
    key = (model_key, str(plan), batch, seq, steps, alloc_round, (profile or {}).get("key"), _env._EMULATING_T4,
           _lora.compute_dtype is not _REAL_COMPUTE_DTYPE, _STREAM_BLOCK_GRADS[0], _zero._HALF_GATHER[0])
    # on disk too for GPTs (the key names the whole model); not for hf: ids, whose config files may change
    disk = cfg is not None
    hit = _CACHE.get(key) or (_disk.load(key) if disk else None)
    if hit is None:
        deep = deep_model(model_fn, seq)
        # (offload:params never reaches a trace: it is split analytically; offload:activations' pinned blocks on the
        # host side are affine in depth too, as its device side: one block's saved tensors each)
        extrapolate = deep is not None and plan.get("checkpoint") in (None, True)
        own: list[str] = []
        if extrapolate:
            L, at = deep
            t1, t2 = (_traced(at(d), plan, batch, seq, steps, alloc_round, profile, own if d == DEPTHS[1] else [])
                      for d in DEPTHS)
            t = _affine(t1, t2, L, DEPTHS[0])
            own.append(f"trace: {L} layers extrapolated from {DEPTHS[0]}- and {DEPTHS[1]}-layer traces (each "
                       "segment's peak -- embedding, first and last block, head -- is affine in depth)")
        else:
            t = _from_base(model_fn, plan, key, steps, alloc_round, profile, own)
            if t is None:
                t = trace(model_fn, plan, batch, seq, steps, alloc_round, profile, own)
        hit = (t, own)
        if disk:
            _disk.store(key, hit)
    _CACHE[key] = hit
    _CACHE.move_to_end(key)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    notes.extend(hit[1])
    return copy.deepcopy(hit[0])


def _plain_optimizer(plan: Plan) -> bool:
    """True when the plan's optimizer token only makes the optimizer (no model change, no wrapper, no forward
    context) and no token but fused-step wraps it: then forward and backward do not depend on which optimizer
    it is, and fused-step calls it one tensor at a time at the same moments whatever it is."""
    opt = REGISTRY[plan.optimizer]
    return (all(t.wrap_optimizer is None or t.name == "fused-step" for t in plan.techniques())
            and all(getattr(opt, f) is None for f in ("prepare_model", "forward_context", "load_model", "wrap_optimizer")))


def _shares_base(plan: Plan, recipe: tuple) -> bool:
    """Whether a base traced with ``plan``'s Trainer may serve every plain optimizer: not where its own optimizer
    cannot be replayed (GaLore): that Trainer built it -- its own groups, what its construction makes -- which a
    plain optimizer's trace does not have."""
    return _replay.optimizer_for(plan, *recipe) is not None


def _from_base(model_fn, plan: Plan, key: tuple, steps: int, alloc_round: int, profile: dict | None,
               notes: list[str]) -> dict | None:
    """The trace of ``plan`` from the trace of its step without the optimizer (cached per plan minus its
    optimizer token, shared by every optimizer) completed by the optimizer's replay profiles
    (:func:`with_optimizer`); None where that does not hold: the optimizer is wrapped, not replayable, or its
    first step is not dominated by the later ones (then the trace runs every step)."""
    if steps < 2 or not _plain_optimizer(plan):
        return None
    base_plan = Plan.parse([t for t in plan.tokens if REGISTRY[t.partition(":")[0]].group != "optimizer"] or "baseline")
    bkey = (key[0], "base:" + str(base_plan), *key[2:])
    disk = _gpt_of(model_fn, key[3]) is not None  # as in _traced
    hit = _CACHE.get(bkey) or (_disk.load(bkey) if disk else None)
    made = hit is None
    if made:
        own: list[str] = []
        # traced with this plan's own Trainer (its optimizer is never stepped): the same model and step
        hit = (trace(model_fn, plan, key[2], key[3], steps, alloc_round, profile, own, base=True), own)
    if made and not _shares_base(plan, hit[0]["recipe"]):
        return None
    t = with_optimizer(copy.deepcopy(hit[0]), plan, alloc_round)
    if made and disk:
        _disk.store(bkey, hit)
    _CACHE[bkey] = hit
    _CACHE.move_to_end(bkey)
    if t is not None:
        notes.extend(hit[1])
        t["counted_plan"] = compute_plan(plan)
    return t


def with_optimizer(t: dict[str, Any], plan: Plan, alloc_round: int = 1) -> dict[str, Any] | None:
    """A base trace (``trace(..., base=True)``) completed by ``plan``'s optimizer as the tracker would have
    recorded it with the optimizer's step replayed (:mod:`.replay`): its state (made before the measured step)
    lives through every phase; at each moment the step was called (``at_step``: once, or once per tensor under
    fused-step) each of its local peaks adds its scratch, an allocation of that phase (``other``); its kernels
    join the counts. None when the optimizer cannot be replayed or its first step is not dominated."""
    opt = _replay.optimizer_for(plan, *t.pop("recipe"))
    if opt is None:
        return None
    groups = opt.param_groups
    each = ([[(gi, [pi])] for gi, g in enumerate(groups) for pi in range(len(g["params"]))] if "fused-step" in plan
            else [[(gi, list(range(len(g["params"])))) for gi, g in enumerate(groups)]])
    profs = [_replay.call_profile(opt, call, alloc_round) for call in each]  # what the prefill makes
    if any(max(x for _, x in p.steps[0]) > max(x for _, x in p.steps[1]) for p in profs):
        return None
    phases, state = t["phase_peaks"], sum(p.state_bytes for p in profs)
    _shift(t, "optimizer", state)
    f, ops, nbytes, n, sizes = t["counts"]
    sizes = dict(sizes)
    segments = t.setdefault("segment_peaks", {})
    for phase, segment, now, stepped in t.pop("at_step"):
        call: dict[int, list[int]] = {}
        for gi, pi in stepped:
            call.setdefault(gi, []).append(pi)
        prof = _replay.call_profile(opt, sorted(call.items()), alloc_round)
        f, ops, nbytes = f + prof.kernels[1][3], ops + prof.kernels[1][0], nbytes + prof.kernels[1][1]
        for k, v in prof.kernels[1][2]:
            sizes[k] = sizes.get(k, 0) + v
        for _, scratch in prof.steps[1]:  # a later step: all of its state exists
            if not scratch:
                continue
            cats = dict(now, optimizer=now["optimizer"] + state, other=now["other"] + scratch)
            total = sum(cats.values())
            pp = phases.setdefault(phase, {"peak": 0, "at_peak": dict(cats), "own": dict(cats)})
            if total > pp["peak"]:
                pp["peak"], pp["at_peak"] = total, dict(cats)
            if segment is not None:
                sp = segments.setdefault(phase, {}).setdefault(segment, {"peak": 0, "at_peak": dict(cats)})
                if total > sp["peak"]:
                    sp["peak"], sp["at_peak"] = total, dict(cats)
            if total > t["peak_bytes"]:
                t["peak_bytes"], t["at_peak"], t["peak_phase"] = total, dict(cats), phase
            for k, v in cats.items():
                pp["own"][k] = max(pp["own"][k], v)
                t["breakdown"][k] = max(t["breakdown"][k], v)
    t["counts"] = (f, ops, nbytes, n, tuple(sorted(sizes.items())))
    return t


def _shift(t: dict[str, Any], category: str, delta: int) -> None:
    """Add ``delta`` bytes that live through the whole step (a substituted weight or optimizer state) to
    ``category`` everywhere a trace reports it: own peaks, the peak's composition, every phase's peak."""
    t["breakdown"][category] += delta
    t["at_peak"][category] += delta
    t["peak_bytes"] += delta
    for pp in t["phase_peaks"].values():
        pp["peak"] += delta
        pp["at_peak"][category] += delta
        pp["own"][category] += delta
    for sp in (v for segs in t.get("segment_peaks", {}).values() for v in segs.values()):
        sp["peak"] += delta
        sp["at_peak"][category] += delta

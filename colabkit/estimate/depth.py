"""Depth extrapolation: a deep model's trace from traces of the same model at two small depths.

Every block of a GPT or a transformers decoder is the same, so what is alive at any moment inside a block is
affine in depth. :func:`_label_segments` labels a trace's allocations by where they happen (embedding, first,
middle and last block, head); :func:`_affine` carries each segment's peak out to the asked depth and takes the
largest. :mod:`.trace` decides which models are extrapolated (``deep_model``) and caches the traces.
"""
from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import MemoryTracker, tensors_in
from ..models import GPTConfig, blocks_of
from .counting import affine as counting_affine

DEPTHS = (2, 3)  # a deeper GPT is extrapolated from traces at these depths


def _first_tensor(x: Any) -> torch.Tensor | None:
    """The hidden states among a block's inputs or outputs (a tensor, or the first of a tuple: HF layers)."""
    if isinstance(x, torch.Tensor):
        return x
    return next((t for t in x if isinstance(t, torch.Tensor)), None) if isinstance(x, (tuple, list)) else None


def _label_segments(model: torch.nn.Module, tracker: MemoryTracker) -> None:
    """Label the trace's allocations by where they happen: ``pre`` (embedding; in backward the loss's),
    ``head`` (in backward, from the first gradient of the model's own outputs: where FSDP2's root unit
    gathers its parameters again, :func:`.zero.fsdp_backward`), ``b0``/``bmid``/``bN`` (inside the first, a
    middle, the last block: forward, its backward and checkpointing's recompute there), ``post`` (the head;
    in backward the embedding). Every block is the same,
    so each segment's peak is affine in depth, while a phase's peak is the largest of them and may move from
    one to another as the model deepens (:func:`_affine`). Forward pre-hooks mark a block's start (also its
    recompute in backward); in backward a block's end is the gradient of its input, its start that of its
    output (the last block's) or of the next block's input."""
    try:
        blocks = list(blocks_of(model))
    except (ValueError, AttributeError, TypeError):
        return
    n = len(blocks)
    label = lambda k: "b0" if k == 0 else "bN" if k == n - 1 else "bmid"  # noqa: E731

    def on_grad(to: str) -> Callable[[torch.Tensor], None]:
        return lambda grad: tracker.segment(to)

    def start(k: int) -> Callable:
        def hook(module, args):
            tracker.segment(label(k))
            x = _first_tensor(args) if tracker.current_phase == "forward" else None
            if x is not None and x.requires_grad:  # backward leaves block k when this gradient is complete
                x.register_hook(on_grad(label(k - 1) if k else "post"))
        return hook

    def end(module, args, out):
        if tracker.current_phase != "forward":  # a recompute in backward: still inside the last block
            return
        tracker.segment("post")
        y = _first_tensor(out)
        if y is not None and y.requires_grad:  # backward enters the last block
            y.register_hook(on_grad(label(n - 1)))

    def outputs(module, args, out):
        if tracker.current_phase != "forward":
            return
        head = lambda grad: tracker.segment("head") if tracker.current_segment == "pre" else None  # noqa: E731
        for y in tensors_in(out):  # as FSDP2 hooks the root's outputs for its pre-backward
            if y.requires_grad:
                y.register_hook(head)

    for k, b in enumerate(blocks):
        b.register_forward_pre_hook(start(k))
    if blocks:
        blocks[-1].register_forward_hook(end)
        model.register_forward_hook(outputs)
        tracker.segment("pre")



class _StepSegments(TorchDispatchMode):
    """Inside an optimizer's step: an op on a parameter (or its gradient) labels what follows with that
    parameter's segment, so an optimizer stepping one tensor after another has its peaks per segment too."""

    def __init__(self, labels: dict[int, str], tracker: MemoryTracker):
        super().__init__()
        self.labels, self.tracker = labels, tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in args:
            seg = self.labels.get(id(a))
            if seg is not None:
                if seg != self.tracker.current_segment:
                    self.tracker.segment(seg)
                break
        return func(*args, **(kwargs or {}))


def _label_step(optimizer: Any, model: torch.nn.Module, tracker: MemoryTracker) -> None:
    """Label the optimizer step's allocations by the parameter being stepped: a block's parameters as the block
    (``b0``/``bmid``/``bN``), the others ``pre`` or ``post`` by whether they come before the blocks'. What a
    step keeps is affine in depth, but its scratch is per parameter: GaLore's projection of the embedding tops the
    step at 3 layers and a block's does from 4 on (the max of two lines; 2.2% low at gpt:5x128 until labelled).
    An optimizer whose step takes every tensor at once (foreach, a replayed step) stays in one segment."""
    try:
        blocks = list(blocks_of(model))
    except (ValueError, AttributeError, TypeError):
        return
    n = len(blocks)
    where = {id(p): "b0" if k == 0 else "bN" if k == n - 1 else "bmid" for k, b in enumerate(blocks) for p in b.parameters()}
    after = False
    for p in model.parameters():
        after = after or id(p) in where
        where.setdefault(id(p), "post" if after else "pre")
    params = list(model.parameters())
    step = optimizer.step

    @functools.wraps(step)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        labels = {id(p): where[id(p)] for p in params}
        labels.update({id(p.grad): where[id(p)] for p in params if p.grad is not None})
        with _StepSegments(labels, tracker):
            return step(*args, **kwargs)
    optimizer.step = labelled


_DEPTH_KEYS = ("num_hidden_layers", "n_layer")


def _depth_key(config: Any) -> str | None:
    return next((k for k in _DEPTH_KEYS if isinstance(getattr(config, k, None), int)), None)


def _deeper(config: Any, L: int) -> Any:
    """The model's config at depth ``L`` (a GPTConfig, or a transformers config)."""
    if config is None:
        return None
    if isinstance(config, GPTConfig):  # (transformers' configs are dataclasses too, without n_layer)
        return replace(config, n_layer=L)
    c = copy.deepcopy(config)
    setattr(c, _depth_key(c), L)
    return c


def _middle_lines(s1: dict, s2: dict, L: int, depth: int) -> list[tuple[int, dict[str, int]]]:
    """A phase's middle-block peaks at depth ``L`` (peak, categories) from its segment peaks at ``depth`` (``s1``)
    and ``depth + 1`` (``s2``, whose one middle block is both the second block and the second to last): the
    second grows with depth as the first does (blocks are added after both), the second to last as the last
    does. They can top the ends' moments: the first block's backward makes no input gradient, so an HF model's
    checkpointed recompute peaks 0.44% higher in the second block than in the first.

    >>> s1 = {"b0": {"peak": 10, "at_peak": {"x": 10}}, "bN": {"peak": 12, "at_peak": {"x": 12}}}
    >>> s2 = {"b0": {"peak": 13, "at_peak": {"x": 13}}, "bN": {"peak": 14, "at_peak": {"x": 14}},
    ...       "bmid": {"peak": 15, "at_peak": {"x": 15}}}
    >>> [p for p, _ in _middle_lines(s1, s2, L=6, depth=2)]  # 15 + 3 * 3, 15 + 2 * 3
    [24, 21]
    """
    mid = s2.get("bmid")
    return [(mid["peak"] + (s2[g]["peak"] - s1[g]["peak"]) * (L - depth - 1),
             {c: v + (s2[g]["at_peak"][c] - s1[g]["at_peak"][c]) * (L - depth - 1) for c, v in mid["at_peak"].items()})
            for g in ("b0", "bN") if mid and g in s1 and g in s2]


def _affine(t1: dict[str, Any], t2: dict[str, Any], L: int, depth: int = DEPTHS[0]) -> dict[str, Any]:
    """A trace at depth ``L`` from traces at depths ``depth`` and ``depth + 1``: every block is the
    same, so each segment's peak (:func:`_label_segments`) and its composition, each category's own peak in a
    phase, and the parameter counts and lists are affine in depth; a phase's peak is its largest segment's at
    depth ``L`` (the line through the phase's own peaks misses where the winning moment changes with depth) --
    the middle block's counted as the second block's and as the second to last's --
    and the step's peak the largest phase's (it may sit in backward at a small depth and move to the optimizer
    step at depth 48). Not from depth 1: a single block is first and last at once (no ``bN`` line)."""
    lin = lambda a, b: int(a + (b - a) * (L - depth))  # noqa: E731
    phases: dict[str, Any] = {}
    segments: dict[str, Any] = {}
    for p in t2["phase_peaks"]:
        a, b = t1["phase_peaks"].get(p, t2["phase_peaks"][p]), t2["phase_peaks"][p]
        phases[p] = {"peak": lin(a["peak"], b["peak"]),
                     "at_peak": {c: lin(a["at_peak"][c], b["at_peak"][c]) for c in b["at_peak"]},
                     "own": {c: lin(a["own"][c], b["own"][c]) for c in b["own"]}}
        # the phase's peak is the largest segment's at depth L, not the line through the phase's peaks at the two depths,
        # whose segment may differ from depth L's: at small depth the end of backward (every gradient) can
        # dominate, at depth L its start (every block's activations)
        s1, s2 = t1.get("segment_peaks", {}).get(p, {}), t2.get("segment_peaks", {}).get(p, {})
        segs = {g: (lin(s1[g]["peak"], s2[g]["peak"]), {c: lin(s1[g]["at_peak"][c], v) for c, v in s2[g]["at_peak"].items()})
                for g in s2 if g in s1 and g != "bmid"}
        if middle := _middle_lines(s1, s2, L, depth):
            segs["bmid"] = max(middle, key=lambda x: x[0])
        if segs:
            peak, at = max(segs.values(), key=lambda x: x[0])
            phases[p]["peak"], phases[p]["at_peak"] = peak, dict(at)  # a copy: _shift adds to each dict once
            # kept at depth L too: zero:2/3's backward is modelled segment by segment (estimate.zero.fsdp_backward)
            segments[p] = {g: {"peak": pk, "at_peak": a} for g, (pk, a) in segs.items()}
    top = max(phases, key=lambda p: phases[p]["peak"])

    def more(k):  # the first trace's list plus (L - depth) copies of what one more block adds
        extra = Counter(t2[k]) - Counter(t1[k])
        return list(t1[k]) + [x for x, n in extra.items() for _ in range(n * (L - depth))]

    return {"peak_bytes": phases[top]["peak"], "at_peak": dict(phases[top]["at_peak"]), "peak_phase": top,
            "breakdown": {c: max(v["own"][c] for v in phases.values()) for c in t2["breakdown"]},
            "phase_peaks": phases, "segment_peaks": segments, "params": lin(t1["params"], t2["params"]),
            # the host side (offload:activations' pinned blocks: each block's saved tensors) grows a block a layer
            "host_bytes": lin(t1.get("host_bytes", 0), t2.get("host_bytes", 0)),
            "trainable_params": lin(t1["trainable_params"], t2["trainable_params"]),
            "trainable_shapes": more("trainable_shapes"), "frozen16": more("frozen16"), "frozen": more("frozen"),
            "block_shapes": more("block_shapes") if t2.get("block_shapes") is not None else None,
            "block_bytes": more("block_bytes"),  # FSDP2's all-gather units, one per block (estimate.zero)
            "config": _deeper(t2["config"], L),
            "counts": counting_affine(t1["counts"], t2["counts"], L, (depth, depth + 1)),
            "counted_plan": t2["counted_plan"]}

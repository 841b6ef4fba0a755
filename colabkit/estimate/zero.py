"""Per-rank bytes of the ZeRO stages (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5) applied to a single-process trace.

With Ψ parameters, K bytes of optimizer state per parameter and N_d ranks, each rank holds:

=========  ===========  ===========  =============
stage      parameters   gradients    optimizer
=========  ===========  ===========  =============
none       P            G            K·Ψ
zero:1     P            G            K·Ψ / N_d
zero:2     P            G / N_d      K·Ψ / N_d
zero:3     P / N_d      G / N_d      K·Ψ / N_d
=========  ===========  ===========  =============

(P = 2Ψ and G = 2Ψ in the paper's fp16 setting, 4Ψ each in fp32; here P, G and K·Ψ are the traced
categories, so any precision or optimizer is covered.) Activations are the trace of one rank's
micro-batch (batch / N_d). FSDP2's zero:2 keeps its parameter shard *and* the gathered full copy
from forward to the end of backward, so its parameter peak is P·(1 + 1/N_d); the paper's P assumes
the shard is not kept. Communication per step (the paper's section 7): 2Ψ elements for stages 1
and 2 (reduce-scatter + all-gather, as DDP's all-reduce), 3Ψ for stage 3 (one more all-gather).

>>> zero_per_rank({"params": 400, "grads": 400, "optimizer": 800, "activations": 50, "other": 0}, 3, 2)
{'params': 200, 'grads': 200, 'optimizer': 400, 'activations': 50, 'other': 0}
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch

from ..device import pinned_bytes
from ..plan import Plan, PlanError

SHARDED = {1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


# zero:2/3 with fp16/bf16: FSDP2's MixedPrecisionPolicy gathers 16-bit parameters (techniques/zero.py), so a
# block computes on them directly: autocast casts no fp32 weight (nothing in its cache) and backward keeps no
# cast copy (the gathered parameter, freed and re-gathered, is what is saved). A single-process trace of the
# same plan holds both; within :func:`gathered_in_half` the trace drops them, gives each block its inputs in
# 16 bits as FSDP2 does (:func:`cast_block_inputs`), and shard_trace counts the gathered copies at 16 bits.
_HALF_GATHER = [False]


@contextlib.contextmanager
def gathered_in_half(on: bool = True):
    """Within the block, traces run as FSDP2's 16-bit gathered parameters run: no autocast weight cache,
    no cast copy of a parameter saved for backward, 16-bit block inputs (:data:`_HALF_GATHER`)."""
    prev, _HALF_GATHER[0] = _HALF_GATHER[0], on
    try:
        yield
    finally:
        _HALF_GATHER[0] = prev


def _cast_of_parameter(t: torch.Tensor) -> bool:
    """True for autocast's copy of a leaf parameter (a ``_to_copy`` whose input is an AccumulateGrad leaf), or a
    view of one: ``F.linear`` saves ``weight.t()`` for backward, a view whose own grad_fn is ``TBackward0``."""
    if t._is_view() and t._base is not None:  # the cast copy the view keeps alive
        t = t._base
    fn = t.grad_fn
    if fn is None or not type(fn).__name__.startswith("ToCopyBackward") or not fn.next_functions:
        return False
    nxt = fn.next_functions[0][0]
    return nxt is not None and type(nxt).__name__ == "AccumulateGrad"


def _pack(t: torch.Tensor) -> torch.Tensor:
    # a stand-in of the same shape and dtype on a one-element storage (values never matter in a trace)
    return torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape) if _cast_of_parameter(t) else t


def cast_block_inputs(module: torch.nn.Module, args: tuple, blocks: list[set[int]]) -> tuple | None:
    """A forward pre-hook doing what ``MixedPrecisionPolicy(cast_forward_inputs=True)`` does to each FSDP unit (a
    block): its floating inputs in the 16-bit param_dtype (autocast's), so the residual stream inside the blocks --
    and what they save for backward -- is 16-bit, where single-process autocast keeps it fp32 (gpt:12x128 with
    bf16, batch 4 x 64: 1.5 of 13.8 MiB saved). ``blocks``: empty, then the ids of the blocks of the first module
    called (the model)."""
    if not blocks:
        from ..models import blocks_of

        try:
            blocks.append({id(b) for b in blocks_of(module)})
        except (ValueError, AttributeError, TypeError):
            blocks.append(set())
    if id(module) not in blocks[0] or not torch.is_autocast_enabled("cpu"):
        return None
    half = torch.get_autocast_dtype("cpu")
    return tuple(a.to(half) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@contextlib.contextmanager
def no_cast_copies():
    """While a traced step runs under :func:`gathered_in_half`: autocast's weight cache off, and casts of
    parameters not kept for backward. A no-op otherwise."""
    if not _HALF_GATHER[0]:
        yield
        return
    real = torch.autocast.__enter__

    def enter(self):
        out = real(self)
        torch.set_autocast_cache_enabled(False)  # __exit__ restores what was before
        return out

    blocks: list[set[int]] = []  # ids of the transformer blocks, found from the first (outermost) module called
    torch.autocast.__enter__ = enter
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: cast_block_inputs(module, args, blocks))
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
            yield
    finally:
        hook.remove()
        torch.autocast.__enter__ = real


def zero_per_rank(breakdown: dict[str, int], stage: int | None, world_size: int, half: bool = False) -> dict[str, int]:
    """One rank's categories under ZeRO ``stage`` on ``world_size`` ranks, from a single-process
    breakdown traced at the per-rank micro-batch (stage None: unchanged). ``half``: fp16/bf16, whose
    zero:2/3 gather 16-bit copies of fp32 parameters."""
    out = dict(breakdown)
    if not stage or world_size < 2:
        return out
    for c in SHARDED[stage]:
        out[c] = -(-breakdown[c] // world_size)
    if stage == 2:  # FSDP2: shard kept next to the gathered parameters during forward/backward
        out["params"] = (breakdown["params"] // 2 if half else breakdown["params"]) + -(-breakdown["params"] // world_size)
    return out


def shard_trace(t: dict[str, Any], stage: int | None, world_size: int, half: bool = False) -> None:
    """One rank's share of a single-process trace ``t`` (traced at the per-rank micro-batch), in place:
    every breakdown (own peaks, the peak's composition, each phase) through :func:`zero_per_rank`, plus what
    the engines add per phase, then the step's peak as the largest phase's:

    * zero:1 (DDP, ``gradient_as_bucket_view``): the full gradients exist from the start as all-reduce
      buckets; in backward autograd's fresh gradient sits next to them until it is copied in;
    * zero:2 and zero:3 (FSDP2): in forward, each unit's flat all-gather output is kept until the next
      all-gather (to overlap its copy-out with that collective), and the last block's until the root's
      forward ends: one block's full size beside the activations at forward's end
      (``FSDPParamGroup.wait_for_unshard``, ``comm_ctx.all_gather_state``);
    * zero:3 (``reshard_after_forward=True``, on the root unit too: FSDP2 keeps a root unsharded after forward
      only when the flag is left to its default): besides, the root unit's parameters (embeddings, head,
      final norm) are gathered for the whole forward and again from the head's backward on, a block's are
      gathered while it runs and freed after it, and in backward the next block is prefetched (current +
      next: two blocks). zero:2's gathered copies are its parameters (P above).
      These full-size copies sit beside the shards, filed under activations as the tracker files them.
    * zero:2 and zero:3 in backward: block by block, :func:`fsdp_backward` (what is gathered, the gradient
      shards and the reduce-scatter buffer as the blocks are done, the activations still saved).

    >>> t = {"breakdown": {"params": 40, "grads": 40, "optimizer": 80, "activations": 10, "other": 0},
    ...      "at_peak": {"params": 40, "grads": 40, "optimizer": 80, "activations": 0, "other": 0},
    ...      "phase_peaks": {"backward": {"peak": 130, "at_peak": {"params": 40, "grads": 0, "optimizer": 80,
    ...                                                          "activations": 10, "other": 0}}},
    ...      "block_bytes": [15, 15]}
    >>> t["phase_peaks"]["backward"]["own"] = dict(t["phase_peaks"]["backward"]["at_peak"])
    >>> shard_trace(t, 3, 2); t["peak_bytes"], t["phase_peaks"]["backward"]["at_peak"]["activations"]
    (113, 30)
    >>> t["collective_slack"]  # an all-gather and a reduce-scatter buffer of the largest unit, freed late
    30
    """
    if not stage or world_size < 2:
        return
    full, p32 = dict(t["breakdown"]), t["breakdown"]["params"]  # single-process own peaks: P, G, K*psi
    blocks = t.get("block_bytes") or []
    if half and stage > 1:  # MixedPrecisionPolicy: gathered at 16 bits (fp32 master shards)
        blocks = [b // 2 for b in blocks]
        full["params"] -= (t["breakdown"]["params"] + 1) // 2
    block = max(blocks, default=0)
    root = max(0, full["params"] - sum(blocks))
    kept = blocks[-1] if blocks else 0  # the last all-gather output of forward (see above)
    gathered = {2: {"forward": kept}, 3: {"forward": root + kept, "backward": root + 2 * block}}.get(stage, {})
    # FSDP2 keeps one all-gather and one reduce-scatter in flight; the communication thread may drop its
    # reference to either buffer (a unit's full parameters / gradients) after the step has moved on, so a
    # rank's peak can be that much higher run to run (gloo's worker thread frees them late on CPU)
    t["collective_slack"] = 2 * max(block, root) if stage > 1 else 0
    largest = 4 * max((math.prod(sh) for sh in t.get("trainable_shapes", ())), default=0)  # fp32 gradient
    single_bwd = t["phase_peaks"].get("backward")  # the single-process backward, before sharding
    single_bwd = single_bwd and {k: dict(single_bwd[k]) for k in ("at_peak", "own") if k in single_bwd}
    if single_bwd:  # each part of backward's own peak (loss, head, blocks, embedding), unsharded: see fsdp_backward
        single_bwd["segments"] = copy.deepcopy(t.get("segment_peaks", {}).get("backward") or {})
    for d in [t] + list(t["phase_peaks"].values()):
        for k in ("breakdown", "own"):
            if k in d:
                d[k] = zero_per_rank(d[k], stage, world_size, half)
        d["at_peak"] = zero_per_rank(d["at_peak"], stage, world_size, half)
    for phase, d in t["phase_peaks"].items():
        if stage == 1:  # DDP's buckets are the gradients from the start (+ a fresh one in backward, at most the largest)
            # the single-process trace's backward peak may come late (checkpoint: most gradients done), but DDP
            # copies each fresh gradient into its bucket as it comes: at most one (the largest) is extra
            fresh = ddp_fresh(d["at_peak"]["grads"], largest) if phase == "backward" else 0
            d["at_peak"]["grads"] = max(full["grads"], d["at_peak"]["grads"]) + fresh
            d["own"]["grads"] = max(d["own"]["grads"], d["at_peak"]["grads"], full["grads"] + (largest if fresh else 0))
        for k in ("at_peak", "own"):  # zero:2/3: FSDP2's all-gathered copies in use
            d[k]["activations"] += gathered.get(phase, 0)
        d["peak"] = sum(d["at_peak"].values())
    at_bwd = fsdp_backward(single_bwd, t["phase_peaks"]["backward"]["at_peak"]["optimizer"], t["block_bytes"], p32,
                           stage, world_size, half) if stage > 1 and blocks and single_bwd and "own" in single_bwd else None
    if at_bwd is not None:  # FSDP2's backward, block by block
        d = t["phase_peaks"]["backward"]
        d["at_peak"], d["peak"] = at_bwd, sum(at_bwd.values())
        for c in d["own"]:
            d["own"][c] = max(d["own"][c], d["at_peak"][c]) if c in ("activations", "other") else d["own"][c]
    _settle(t)


def _settle(t: dict[str, Any]) -> None:
    """The step's peak as the largest phase's; each category's own peak at least any phase's."""
    if t["phase_peaks"]:
        top = max(t["phase_peaks"], key=lambda p: t["phase_peaks"][p]["peak"])
        t["peak_phase"], t["at_peak"] = top, dict(t["phase_peaks"][top]["at_peak"])
        for c in t["breakdown"]:
            t["breakdown"][c] = max([t["breakdown"][c]] + [v["own"][c] for v in t["phase_peaks"].values() if "own" in v])
    t["peak_bytes"] = sum(t["at_peak"].values())


def ddp_fresh(grads_at_peak: int, largest: int) -> int:
    """zero:1's gradient beside DDP's buckets in backward: the single-process trace's backward peak may come late
    (checkpoint: most gradients done, all of them in the buckets), but DDP copies each fresh gradient into its
    bucket as it comes, so at most one -- the largest -- is extra.

    >>> ddp_fresh(10_000, 1_000), ddp_fresh(500, 1_000)
    (1000, 500)
    """
    return min(grads_at_peak, largest)


def _block_moments(single: dict[str, Any], order: list[int]) -> list[dict[str, int]]:
    """The single-process trace's categories as backward runs each block (k = 0 .. L-1, the last block first):
    from its backward segment peaks (``single["segments"]``: ``bN`` at k = 0, ``b0`` at k = L-1, a middle
    block's between them -- every block is the same, so they are affine in k), or, without them, from the
    phase's peak, its activations in proportion to the blocks not yet done.

    >>> segs = {"bN": {"at_peak": {"grads": 2, "activations": 30, "other": 5}},
    ...         "b0": {"at_peak": {"grads": 22, "activations": 10, "other": 5}}}
    >>> [m["activations"] for m in _block_moments({"segments": segs}, [10, 10, 10])]
    [30, 20, 10]
    """
    segs, n = single.get("segments") or {}, len(order)
    first, last = (segs.get(g, {}).get("at_peak") for g in ("bN", "b0"))
    if n == 1 and last is not None:  # one block: first and last at once (labelled b0)
        return [dict(last)]
    if first is not None and last is not None:
        mid = segs.get("bmid", {}).get("at_peak")
        moments = [{c: first[c] + (last[c] - first[c]) * k // (n - 1) for c in first} for k in range(n)]
        for m in moments[1:-1]:  # a middle block's own moment can top the line (a recompute's temporaries)
            m["other"] = max(m["other"], mid["other"]) if mid is not None else m["other"]
        return moments
    at, own = single["at_peak"], single["own"]
    done, k_p = 0, 0  # the whole blocks of gradients at the trace's peak
    while k_p < n and done + order[k_p] <= at["grads"]:
        done, k_p = done + order[k_p], k_p + 1
    return [dict(at, grads=at["grads"] - done + sum(order[:k]),
                 # the L - k_p blocks not done at the trace's peak saved these, per block remaining; when it peaks
                 # at backward's end (none left): from their own peak, at its start
                 activations=(at["activations"] * (n - k) // (n - k_p) if k_p < n else own["activations"] * (n - k) // n))
            for k in range(n)]


def fsdp_backward(single: dict[str, Any], optimizer: int, block_bytes: list[int], params: int, stage: int,
                  world_size: int, half: bool) -> dict[str, int]:
    """One rank's categories at the peak of FSDP2's backward (zero:2/3), from the single-process trace's backward
    (``single``: its ``at_peak``, ``own`` and ``segments``, traced at the per-rank micro-batch) and the fp32 bytes of
    each block (``block_bytes``, L of them) and of all parameters (``params``). Backward runs the loss's first
    (segment ``pre``), then the head's (``head``: from the first gradient of the model's outputs, where FSDP2's
    root pre-backward hook fires), the blocks last to first (:func:`_block_moments`: the single trace's
    categories at each), then the embedding (``post``). With k blocks done a rank holds:

    * params: its shards, P/N; zero:2 also every gathered unit not yet done (the root's and blocks 0 .. L-k-1:
      FSDP2's post-backward reshards a block even with reshard_after_forward=False); zero:3 nothing gathered in
      the loss's backward (colabkit gives the root reshard_after_forward=True too, so FSDP2 keeps no root
      unsharded after forward), then the root's and the last block (the head's: gathered by the root's
      pre-backward and prefetched), the root's and the block running with the one prefetched after it, the
      root's alone in the embedding's; filed under activations as the tracker files them. Gathered copies are
      16-bit with fp16/bf16 (MixedPrecisionPolicy's param_dtype).
    * grads: the fp32 gradient shards of the k done blocks (k * g_b / N) -- the reduce-scatter outputs.
    * other: the reduce-scatter input of the last done block (full size, reduce_dtype fp32: FSDP2 keeps it
      until the next reduce-scatter), the unsharded gradients autograd holds (param_dtype: the single trace's
      gradients beyond its k whole blocks -- the root's and the running block's partial ones) and the single
      trace's own ``other`` there (the logits' gradient in the head's backward; with checkpoint the block being
      recomputed).
    * activations: those the single trace still holds there.

    The peak is the largest moment (a deep model's trace is extrapolated in depth before it is sharded, so k
    runs over all of its blocks). zero:3 peaks a block or more into backward: the gradient shards and the
    reduce-scatter buffer grow while the gathered copies stay two blocks; zero:2 peaks early (each done block
    frees its gathered copy, worth N times its gradient shard).

    >>> single = {"at_peak": {"params": 40, "grads": 0, "optimizer": 80, "activations": 8, "other": 2},
    ...           "own": {"params": 40, "grads": 40, "optimizer": 80, "activations": 8, "other": 2}}
    >>> at = fsdp_backward(single, 40, [16, 16, 16], 56, 3, 2, False)
    >>> at["grads"], at["other"], at["activations"]
    (8, 18, 45)
    """
    c = 2 if half else 1  # gathered copies and unsharded gradients: param_dtype's bytes are fp32's / c
    order = list(reversed(block_bytes))  # backward order; a block's fp32 gradient has its parameters' bytes
    n_blocks, root = len(order), max(0, params - sum(block_bytes))
    shards = -(-params // world_size)
    segs = single.get("segments") or {}
    # (k blocks done, the single trace's categories there, what zero:3 holds gathered: the root and the block
    # running with the one prefetched after it)
    moments = [(k, m, root + sum(order[k:k + 2])) for k, m in enumerate(_block_moments(single, order))]
    if "head" in segs:  # the loss's backward ("pre"): the root unit resharded after forward, nothing gathered yet;
        # from the first gradient of the model's outputs the root's pre-backward gathers it and prefetches the last block
        moments += [(0, segs["pre"]["at_peak"], 0)] if "pre" in segs else []
        moments.append((0, segs["head"]["at_peak"], root + order[0]))
    elif "pre" in segs:  # the loss's and the head's backward in one: as the head's
        moments.append((0, segs["pre"]["at_peak"], root + order[0]))
    if "post" in segs:  # the embedding's, every block done
        moments.append((n_blocks, segs["post"]["at_peak"], root))
    best: dict[str, int] = {}
    for k, at, gathered in moments:
        done = sum(order[:k])
        cats = {"params": shards + ((root + sum(order[k:])) // c if stage == 2 else 0),
                "grads": -(-done // world_size),
                "optimizer": optimizer,
                "activations": at["activations"] + (gathered // c if stage == 3 else 0),
                "other": at["other"] + max(0, at["grads"] - done) // c + (order[k - 1] if k else 0)}
        if sum(cats.values()) > sum(best.values()):
            best = cats
    return best


# ----- zero:3 with offload:params / offload:optimizer: FSDP2's CPUOffloadPolicy ------------------------------
def fsdp_offload_plan(traced: Plan, plan: Plan) -> Plan:
    """What to trace for zero:3 with offload: FSDP2's ``CPUOffloadPolicy`` streams no block and recomputes none
    (colabkit's own ``offload:params`` does, so its GPU trace adds ``checkpoint``): the plan as it is.

    >>> str(fsdp_offload_plan(Plan.parse("bf16+checkpoint"), Plan.parse("bf16+offload:params")))
    'bf16'
    """
    if "checkpoint" in plan:
        return traced
    return Plan.parse([k for k in traced.tokens if k.partition(":")[0] != "checkpoint"] or "baseline")


def cpu_offload(t: dict[str, Any], world_size: int, pinned: bool) -> dict[str, int]:
    """zero:3 with ``CPUOffloadPolicy``, on one rank's trace ``t`` (after :func:`shard_trace`), in place: the
    sharded parameters, their gradients and the optimizer state live in host RAM (torch's FSDP2 docs: "offloads
    parameters, gradients, and optimizer states to CPU"; the optimizer step runs there), so the GPU keeps what
    FSDP2 puts there for compute: the gathered 16/32-bit copies (root unit, current and prefetched block), the
    unsharded gradients before their reduce-scatter and its buffers, and the activations. Returns the rank's
    host RAM by category: each parameter's shard (dim 0 padded to a multiple of N rows) fp32, pinned on a GPU
    (``pin_memory()``: each rounded up to a power of two); the gradient shard the same (the reduce-scatter
    output is copied to pinned host memory with ``non_blocking``); the optimizer state pageable (allocated by
    the optimizer on the host), its per-rank share from the trace.

    >>> t = {"breakdown": {"params": 6, "grads": 6, "optimizer": 12, "activations": 9, "other": 1},
    ...      "trainable_shapes": [(3, 1)], "frozen": [], "phase_peaks": {"backward": {"peak": 0,
    ...      "at_peak": {"params": 6, "grads": 2, "optimizer": 12, "activations": 9, "other": 1}}}}
    >>> t["at_peak"] = dict(t["phase_peaks"]["backward"]["at_peak"])
    >>> cpu_offload(t, 2, pinned=True), t["peak_bytes"]
    ({'params': 8, 'grads': 8, 'optimizer': 12}, 10)
    """
    host = {"params": 0, "grads": 0, "optimizer": t["breakdown"]["optimizer"]}
    for shape in t["trainable_shapes"]:
        rows = shape[0] if shape else 1
        shard = 4 * -(-rows // world_size) * (math.prod(shape) // max(rows, 1))  # fp32 master shard
        host["params"] += pinned_bytes(shard) if pinned else shard
        host["grads"] += pinned_bytes(shard) if pinned else shard
    host["params"] += sum(-(-n * size // world_size) for n, _, size in t.get("frozen", ()))  # frozen: no gradient
    for d in [t] + list(t["phase_peaks"].values()):
        for k in ("breakdown", "own", "at_peak"):
            if k in d:
                d[k].update(params=0, grads=0, optimizer=0)
    if "optimizer" in t["phase_peaks"]:  # the step and its temporaries run on the host
        t["phase_peaks"]["optimizer"]["at_peak"]["other"] = 0
    for d in t["phase_peaks"].values():
        d["peak"] = sum(d["at_peak"].values())
    _settle(t)
    return host


def comm_elements(params: int, stage: int | None, world_size: int) -> int:
    """Elements each rank sends per optimizer step (ring collectives, the ZeRO paper's 2Ψ / 3Ψ times
    (N_d-1)/N_d).

    >>> comm_elements(1000, 3, 2)
    1500
    """
    if world_size < 2:
        return 0
    per = 3 if stage == 3 else 2
    return per * params * (world_size - 1) // world_size


def for_rank(plan: Plan, batch: int, world_size: int) -> tuple[Plan, int, int | None]:
    """The single-process plan and micro-batch to trace for one rank of a sharded run, and its stage.
    A batch smaller than the ranks is read as one sequence per rank (each rank needs one).

    >>> plan, micro, stage = for_rank(Plan.parse("zero:3+checkpoint"), 1, 8)
    >>> str(plan), micro, stage
    ('checkpoint', 1, 3)
    """
    stage = plan.get("zero")
    if world_size < 2 or stage is None:
        if stage is not None:
            raise PlanError(f"zero:{stage} is per rank of a sharded run: give world_size >= 2 (--world-size 2)")
        return plan, batch, None
    if batch < world_size:  # one sequence per rank at least: the global batch is world_size
        batch = world_size
    if batch % world_size:
        raise PlanError(f"batch {batch} does not split over {world_size} ranks: use a batch divisible by {world_size}")
    rest = [t for t in plan.tokens if t.partition(":")[0] != "zero"]
    return Plan.parse(rest or "baseline"), batch // world_size, stage

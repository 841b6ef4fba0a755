"""Moves block parameters to host RAM; each block's come to the device just before it runs (``offload:params``)."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..device import DevicePair, pair_of
from ..models import blocks_of
from .checkpoint import recompute_context
from .offload_guard import guard_plan


# ----- offload:params (layer streaming) ----------------------------------------------------------
class BlockStreamer:
    """Copies one block's host-resident parameters to the compute side on demand, and
    (``prefetch``) the next block's on the side stream while the current one computes."""

    def __init__(self, blocks: nn.ModuleList, pair: DevicePair, prefetch: bool = True):
        self.blocks, self.pair, self.prefetch = blocks, pair, prefetch
        self._pending: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
        self.copies = 0
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, accumulated gradient in flight)
        self._sync_queued = False

    def _start(self, i: int) -> None:
        if i in self._pending or not 0 <= i < len(self.blocks):
            return
        named = dict(self.blocks[i].named_parameters()) | dict(self.blocks[i].named_buffers())
        # allocated on the compute stream, which reads them (no record_stream needed); filled on the side
        dev = {n: torch.empty(t.shape, dtype=t.dtype, device=self.pair.compute) for n, t in named.items()}
        with self.pair.side():
            for n, t in named.items():
                self.pair.copy_(dev[n], t)
        self.copies += 1
        self._pending[i] = (dev, self.pair.done())

    def get(self, i: int, next_i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors on the compute side; starts copying block ``next_i`` when prefetching."""
        self._start(i)
        dev, ev = self._pending.pop(i)
        self.pair.use(ev)
        if self.prefetch:
            self._start(next_i)
        return dev

    def grads_to_host(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Block gradients go to pinned host buffers on the side stream (overlapping the rest of
        backward); a second gradient before the step (``accum:K``, a block called twice) goes out the same
        way and is added on the host once it landed: at the next block (one block's copies in flight at a
        time) or when backward ends. The copies are waited for once, when backward ends, so ``p.grad`` is
        complete when ``backward()`` returns."""
        self._land_adds()
        for p, h in zip(params, self.pair.to_host_async(grads)):
            if p.grad is None:
                p.grad = h
            else:
                self._adds.append((p, h))
        if not self._sync_queued:
            self._sync_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _land_adds(self) -> None:
        """Add the accumulated block gradients in flight to ``p.grad``, once the side stream has run them."""
        if self._adds:
            self.pair.sync()
            for p, h in self._adds:
                p.grad.add_(h)
            self._adds.clear()

    def _end_of_backward(self) -> None:
        self._sync_queued = False
        self.pair.sync()
        self._land_adds()


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
        ctx.replay = recompute_context()  # and the forward's other contexts (attention:* backend)
        return tuple(o for o in flat if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grad_outs):
        call, needs = ctx.call, ctx.needs_input_grad[1:]
        w = call.streamer.get(call.i, call.i - 1)  # backward walks the blocks in reverse: prefetch the previous
        names = [n for n, p in call.block.named_parameters() if p.requires_grad]
        for n in names:
            w[n].requires_grad_(True)
        dev, dtype, enabled = ctx.autocast
        with torch.enable_grad(), call.streamer.pair.replay_rng(ctx.rng), torch.autocast(dev, dtype=dtype, enabled=enabled), ctx.replay:
            xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
            outs = [o for o in call(w, xs) if isinstance(o, torch.Tensor)]
        used = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad and g is not None]
        inputs = [x for x, need in zip(xs, needs) if need] + [w[n] for n in names]
        grads = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True)
        gx = iter(grads)
        result = [next(gx) if need else None for need in needs]
        params = dict(call.block.named_parameters())
        got = [(params[n], g) for n, g in zip(names, gx) if g is not None]
        call.streamer.grads_to_host([p for p, _ in got], [g for _, g in got])  # straight to the host side
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


def stream_blocks(model: nn.Module, device: str | torch.device, prefetch: bool = True,
                  guard: bool = True) -> nn.Module:
    """Keep the transformer blocks' parameters on the host side (pinned on CUDA) and move everything
    else to ``device``; each block's weights visit the device only while it runs (forward, then
    recomputed in backward). Block gradients land on the host parameters. Returns the model.
    ``guard``: first check host RAM for the blocks' weights, gradients and AdamW state
    (:func:`guard_plan`; the plan path guards the whole plan itself and passes False).

    >>> from colabkit.models import build_model
    >>> m = stream_blocks(build_model("gpt:2x32"), "cpu")
    >>> m.blocks[0].streamer.prefetch, m._colabkit_placed
    (True, True)
    """
    if guard:
        guard_plan(model, ["params"], "adamw")
    pair = pair_of(model, device)
    blocks = blocks_of(model)
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

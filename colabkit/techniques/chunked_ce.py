"""Chunked cross-entropy ``chunked-ce`` / ``chunked-ce:C``: the LM head and the cross-entropy computed C
token rows at a time, so the (B, S, V) logits never exist.

For a large vocabulary the logits are often the largest activation of a step: at batch 1 x seq 2048 and
Llama 3's V = 128,256 the fp32 logits take 1.05 GB, the cross-entropy keeps their log-softmax (as much
again) and backward makes their gradient. Here the head's input (the hidden states, (N, D) for N = B*S
rows) is what is kept: :class:`ChunkedCrossEntropy` runs the head on C rows at a time, keeps one
log-sum-exp per row, and in backward computes each chunk's logits again to form its gradient
``softmax - one_hot`` and the gradients of the hidden states, the weight (and bias). At most one chunk's
logits (C x V) and their gradient exist at a time, for one more head matmul per step (the recompute).
The same idea as Liger Kernel's ``fused_linear_cross_entropy`` (which computes the gradients in the
forward instead of recomputing) and Apple's Cut Cross-Entropy.

The default C gives a chunk's logits about as many elements as the hidden states (Liger Kernel's rule:
``C = next_pow2(ceil(N / ceil(V / D)))``), at least 128 rows. Under ``fp16``/``bf16`` autocast a chunk's logits are computed
in that dtype and the loss in fp32; a frozen head (``lora``/``qlora``) gets no weight gradient; a weight
tied to the input embeddings receives both gradients, as without chunks. The loss is the summed token
cross-entropy (labels -100 ignored) that the Trainer divides by the window's token count, so ``accum:K``
still equals the un-accumulated step.

How it hooks in: the technique replaces the LM head's ``forward`` on the model (an instance attribute, as
``checkpoint`` does for blocks); inside the Trainer's forward context the head returns a
:class:`ChunkedLogits` -- its input and weights -- instead of logits, and :func:`colabkit.batches.summed_loss`
asks it for its cross-entropy. Outside that context (generation, your own calls) the head computes logits
as before. It sets ``ctx.loss_from_head``, so the Trainer keeps the labels from the model (a transformers
model would otherwise compute its own loss from full logits) and refuses a ``loss_fn=``. With transformers'
Trainer, which gives the labels to the model, ``colabkit.hf.prepare_model`` also wraps the model's forward
(:func:`loss_in_forward`): training with labels, the model computes the chunked loss itself. Refused: a
model without a plain ``nn.Linear`` LM head (classification), logits transformed after the head
(soft-capping), a ``loss_fn=``, and ``zero:3`` (FSDP frees the head's gathered weight before the recompute).

>>> from colabkit.plan import Plan
>>> Plan.parse("chunked-ce").get("chunked-ce"), Plan.parse("chunked-ce:256").get("chunked-ce")
(0, 256)
>>> h, w = torch.randn(6, 8), torch.randn(32, 8)
>>> y = torch.tensor([1, 5, -100, 7, 0, 31])
>>> ref = F.cross_entropy(h @ w.T, y, reduction="sum")
>>> torch.allclose(chunked_cross_entropy(h, w, y, chunk=4), ref)
True
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..batches import Batch, add_decoder_inputs, count, head_of, summed_loss
from ..data import IGNORE_INDEX
from ..memory import MemoryTracker
from ..models import logits_of
from ..plan import Context, Plan, PlanError, Technique, register

AUTO = 0  # the plan's value for ``chunked-ce`` without C: chunk size from the shapes (auto_chunk)
# The chunk size while the Trainer's forward context is active; None: the head computes plain logits.
_ACTIVE: contextvars.ContextVar[int | None] = contextvars.ContextVar("colabkit_chunked_ce", default=None)


MIN_CHUNK = 128  # rows: a smaller matmul underuses a GPU's tiles (and a CPU's), for logits that are small anyway


def auto_chunk(rows: int, vocab: int, width: int) -> int:
    """Rows per chunk so that a chunk's logits hold about as many elements as the hidden states (Liger
    Kernel's rule, ``next_pow2(ceil(rows / ceil(vocab / width)))``), at least ``MIN_CHUNK`` rows.

    >>> auto_chunk(1024, 32000, 128), auto_chunk(16384, 128256, 2048), auto_chunk(4096, 256, 64)
    (128, 512, 1024)
    """
    c = math.ceil(rows / math.ceil(vocab / width))
    return max(MIN_CHUNK, 1 << max(0, (c - 1).bit_length()))


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as ``F.linear`` would), else the
    inputs' common dtype. >>> compute_dtype(torch.ones(1), torch.ones(1, dtype=torch.float64))
    torch.float64"""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, C rows at a time.

    forward(hidden (N, D), weight (V, D), bias (V,) or None, labels (N,) int, chunk C, dtype) -> loss (),
    fp32. Saved for backward: hidden, weight, bias, labels and one fp32 log-sum-exp per row (N) -- no logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, dtype: torch.dtype):
        # Explicit dtypes instead of autocast: backward runs outside autocast and must compute the same.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # (V, D): autocast's copy of the weight, freed after the forward
            b = bias.to(dtype) if bias is not None else None
            valid = labels != IGNORE_INDEX
            target = labels.clamp(min=0)
            lse = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)  # (N,)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for a in range(0, hidden.shape[0], chunk):
                z = F.linear(hidden[a:a + chunk].to(dtype), w, b).float()  # (C, V): the only logits alive
                picked = z.gather(1, target[a:a + chunk, None]).squeeze(1)  # (C,) the target's logit
                top = z.amax(dim=-1)  # log-sum-exp in place (torch.logsumexp may allocate a (C, V) temporary)
                lse[a:a + chunk] = z.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top)
                total += torch.where(valid[a:a + chunk], lse[a:a + chunk] - picked, 0.0).sum()
                del z
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk, dtype = ctx.chunk, ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            # d loss / d logits of row r = grad_out * (softmax(z_r) - one_hot(y_r)), zero for ignored rows
            scale = grad_out.float() * (labels != IGNORE_INDEX)  # (N,)
            target = labels.clamp(min=0)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # (V, D) accumulated in fp32
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            for a in range(0, hidden.shape[0], chunk):
                x = hidden[a:a + chunk].to(dtype)  # (C, D)
                g = F.linear(x, w, b).float()  # (C, V): this chunk's logits, recomputed
                g.sub_(lse[a:a + chunk, None]).exp_()  # softmax, in place
                g.scatter_add_(1, target[a:a + chunk, None], g.new_full((g.shape[0], 1), -1.0))
                g.mul_(scale[a:a + chunk, None])
                g = g.to(dtype)
                if need_h:
                    grad_h[a:a + chunk] = g @ w  # (C, D)
                if need_w:
                    grad_w += g.t() @ x  # (V, D)
                if need_b:
                    grad_b += g.float().sum(0)
                del g, x
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          bias: torch.Tensor | None = None, chunk: int = AUTO) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=-100, reduction="sum")``
    (fp32) without the (N, V) logits: ``chunk`` rows at a time (``AUTO``: :func:`auto_chunk`). ``hidden``
    (..., D) and ``labels`` (...) are flattened to rows.

    >>> h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    >>> chunked_cross_entropy(h, w, torch.zeros(2, 3, dtype=torch.long), chunk=2).backward()
    >>> h.grad.shape, w.grad.shape
    (torch.Size([2, 3, 8]), torch.Size([16, 8]))
    """
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    y = labels.reshape(-1)
    if y.shape[0] != h.shape[0]:
        raise PlanError(f"chunked-ce: labels {tuple(labels.shape)} do not match the hidden states "
                        f"{tuple(hidden.shape)}: give one label per position")
    c = chunk or auto_chunk(h.shape[0], weight.shape[0], weight.shape[1])
    return ChunkedCrossEntropy.apply(h, weight, bias, y, c, compute_dtype(h, weight))


class ChunkedLogits:
    """What an LM head returns under ``chunked-ce``: its input and weights, standing for the (B, S, V)
    logits it did not compute. Its only use is :meth:`cross_entropy_sum`; anything else a model does with
    its logits inside ``forward`` is refused, naming it. ``dtype`` is float32, what the loss is computed in:
    accelerate's mixed-precision wrapper, which casts a forward's fp16/bf16 outputs to fp32, leaves it alone."""

    dtype = torch.float32

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int):
        self.hidden, self.weight, self.bias, self.chunk = hidden, weight, bias, chunk
        self.shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))
        self.ndim = len(self.shape)

    def cross_entropy_sum(self, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy against ``labels`` (shaped like the logits without V; -100 ignored), fp32."""
        return chunked_cross_entropy(self.hidden, self.weight, labels, self.bias, self.chunk)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or not hasattr(torch.Tensor, name):  # not a tensor's: plain "no such attribute"
            raise AttributeError(name)
        raise PlanError(f"chunked-ce: the model uses its logits inside forward (.{name}), but under chunked-ce "
                        "the LM head returns its input, not logits: the loss is all chunked-ce computes. Drop "
                        "chunked-ce for this model")

    def __repr__(self) -> str:
        return f"ChunkedLogits(shape={tuple(self.shape)}, chunk={self.chunk or 'auto'})"


@contextlib.contextmanager
def chunked_logits(chunk: int = AUTO):
    """While active, LM heads prepared by :func:`prepare_head` return :class:`ChunkedLogits`."""
    token = _ACTIVE.set(chunk)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def lm_head_of(model: nn.Module) -> nn.Module | None:
    """The model's LM head: ``get_output_embeddings()`` (transformers), else an ``lm_head`` attribute."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else getattr(model, "lm_head", None)


def _head_forward(head: nn.Linear, x: torch.Tensor) -> Any:
    chunk = _ACTIVE.get()
    if chunk is None:  # outside the Trainer's forward: plain logits
        return F.linear(x, head.weight, head.bias)
    return ChunkedLogits(x, head.weight, head.bias, chunk)


def prepare_head(model: nn.Module) -> nn.Module:
    """Make ``model``'s LM head return :class:`ChunkedLogits` inside :func:`chunked_logits`, in place; a
    model without a plain ``nn.Linear`` LM head whose output is the model's is refused.

    >>> from colabkit.models import build_model
    >>> m = prepare_head(build_model("gpt-tiny"))
    >>> with chunked_logits(16):
    ...     m(torch.zeros(1, 4, dtype=torch.long))
    ChunkedLogits(shape=(1, 4, 256), chunk=16)
    """
    head = lm_head_of(model)
    cfg = getattr(model, "config", None)
    if head is None:
        raise PlanError(f"chunked-ce computes a language model head's cross-entropy, and {type(model).__name__} has no "
                        "LM head (no get_output_embeddings() nor lm_head): drop chunked-ce (for classification it "
                        "has nothing to chunk)")
    if type(head).forward is not nn.Linear.forward or getattr(head, "weight", None) is None \
            or not head.weight.is_floating_point():
        raise PlanError(f"chunked-ce needs the LM head to be a plain nn.Linear with a floating weight; "
                        f"{type(model).__name__}'s is {type(head).__name__} (a quantized or adapted head): keep the "
                        "head unquantized and without adapters, or drop chunked-ce")
    for key in ("final_logit_softcapping", "logit_scale", "output_mult"):
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            raise PlanError(f"chunked-ce: {type(model).__name__} transforms its logits after the head ({key}="
                            f"{getattr(cfg, key)}), which the chunked loss would skip: drop chunked-ce for this model")
    if not getattr(head, "_colabkit_chunked", False):
        head.forward = functools.partial(_head_forward, head)  # an instance attribute shadows the class forward
        head._colabkit_chunked = True
    return model


def loss_in_forward(model: nn.Module, chunk: int = AUTO) -> nn.Module:
    """For transformers' Trainer, which gives the labels to the model: wrap ``model.forward`` (in place) so
    that, training with ``labels``, the model computes the chunked loss itself in transformers' convention
    (summed over the counted tokens, shifted for a causal LM, divided by ``num_items_in_batch`` when the
    Trainer passes it, else by the count) and returns :class:`ChunkedLogits` as its logits. Without labels,
    or in evaluation, it is the model's own forward. Call :func:`prepare_head` first.

    >>> from colabkit.hf_models import build_llama
    >>> m = loss_in_forward(prepare_head(build_llama("llama:1x64")), chunk=4)
    >>> ids = torch.zeros(1, 8, dtype=torch.long)
    >>> out = m(input_ids=ids, labels=ids)
    >>> out.logits, round(float(out.loss), 2) == round(float(m.eval()(input_ids=ids, labels=ids).loss), 2)
    (ChunkedLogits(shape=(1, 8, 256), chunk=4), True)
    """
    inner = model.forward

    @functools.wraps(inner)  # keeps the signature transformers inspects (labels, loss kwargs)
    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None or not model.training or not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if kwargs.get("shift_labels") is not None:
            raise PlanError("chunked-ce: shift_labels (context parallelism) is not supported: drop chunked-ce")
        kwargs.pop("labels")
        add_decoder_inputs(model, kwargs, labels)  # T5/BART: the decoder's inputs, as the model makes them from labels
        n = kwargs.pop("num_items_in_batch", None)
        with chunked_logits(chunk):
            out = inner(*args, **kwargs)
        head = head_of(model, Batch(args, kwargs, labels))
        n = n if n is not None else count(labels, head, labels.shape[0]).clamp(min=1)
        out["loss"] = summed_loss(logits_of(out), labels, head) / n
        return out

    model.forward = forward
    return model


def _check(plan: Plan, ctx: Context) -> None:
    if plan.get("zero") == 3:
        raise PlanError("chunked-ce and zero:3 conflict: FSDP frees the gathered LM head weight after the forward and "
                        "gathers it again only for gradients flowing into the model's outputs, while chunked-ce "
                        "recomputes the logits from that weight inside the loss's backward; use zero:2 or zero:1 "
                        "with chunked-ce")


def _prepare(model: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    ctx.loss_from_head = "chunked-ce"  # the Trainer keeps the labels from the model and refuses loss_fn=
    return prepare_head(model)


def _parse(arg: str | None) -> int:
    if arg is None:
        return AUTO
    if not arg.isdigit() or int(arg) < 1:
        raise PlanError(f"':{arg}' is not a positive whole number of token rows per chunk, e.g. chunked-ce:1024")
    return int(arg)


def logits_bytes(rows: int, vocab: int, chunk: int | None = None, half: bool = False) -> int:
    """The formula: bytes the forward holds for the logits of ``rows`` tokens at its peak (the activations
    category). Without chunks: the (N, V) logits (fp16 under autocast, plus their fp32 copy) and the
    fp32 log-softmax the cross-entropy keeps for backward, whose gradient is as large again in backward.
    With chunks of C rows: one chunk's logits (fp16 + fp32, or fp32) and one fp32 log-sum-exp per row.

    >>> logits_bytes(1024, 32000) // 2**20, logits_bytes(1024, 32000, chunk=128) // 2**20
    (250, 15)
    """
    if not chunk:
        return rows * vocab * ((2 if half else 0) + 4 + 4)
    return min(chunk, rows) * vocab * ((2 if half else 0) + 4) + 4 * rows


register(Technique(
    name="chunked-ce",
    help="LM head + cross-entropy over chunks of C token rows, logits recomputed in backward: the (B, S, V) "
         "logits never exist (default C: a chunk's logits the size of the hidden states)",
    parse=_parse,
    check=_check,
    prepare_model=_prepare,
    forward_context=lambda plan, ctx: chunked_logits(plan.get("chunked-ce")),
    examples=("chunked-ce", "chunked-ce:1024"),
    order=70,
))


# ----- measurement: the logits' memory against vocabulary and sequence -------------------------------
def logits_memory(vocabs=(8000, 32000), seqs=(512,), chunk: int | None = AUTO, width: int = 128, batch: int = 1,
                  device: str | torch.device | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Measure the LM head + cross-entropy alone (forward + backward, fp16 autocast on a GPU, fp32 on the
    CPU) with :class:`~colabkit.memory.MemoryTracker` at each vocabulary x sequence: ``chunk=None`` the
    plain ``F.cross_entropy`` of the full logits, else :func:`chunked_cross_entropy` with that chunk
    (``AUTO``: :func:`auto_chunk`). ``activations`` is the forward's own peak beyond the hidden states
    and weight, ``peak_bytes`` the peak over forward and backward, ``formula`` :func:`logits_bytes` (plus
    autocast's fp16 copy of the weight on a GPU).

    >>> plain, chunked = (logits_memory((4096,), (256,), c, width=64)[0] for c in (None, 64))
    >>> abs(plain["activations"] - plain["formula"]) < 1024, chunked["activations"] < plain["activations"] / 3
    (True, True)
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    half = dev.type == "cuda"
    rows = []
    for vocab in vocabs:
        for seq in seqs:
            g = torch.Generator().manual_seed(seed)
            n = batch * seq
            h = torch.randn(n, width, generator=g).to(dev).requires_grad_()  # (N, D): before the tracker starts
            w = (torch.randn(vocab, width, generator=g) * 0.02).to(dev).requires_grad_()  # (V, D)
            y = torch.randint(0, vocab, (n,), generator=g).to(dev)
            c = None if chunk is None else (chunk or auto_chunk(n, vocab, width))
            with MemoryTracker(device=dev, alert_at=None) as mt:
                with mt.phase("forward"), torch.autocast(dev.type, dtype=torch.float16, enabled=half):
                    z = F.linear(h, w) if c is None else None  # kept while the loss runs, as a model's output is
                    loss = (F.cross_entropy(z.float(), y, reduction="sum") if c is None
                            else chunked_cross_entropy(h, w, y, chunk=c))
                with mt.phase("backward"):
                    loss.backward()
            r = mt.report()
            rows.append({"vocab": vocab, "seq": seq, "batch": batch, "chunk": c, "activations": r["breakdown"]["activations"],
                         "peak_bytes": r["tracked_peak_bytes"], "loss": float(loss.detach()),
                         # under autocast the forward also holds the head's fp16 weight copy (V, D)
                         "formula": logits_bytes(n, vocab, c, half) + 2 * vocab * width * half, "device": str(dev)})
            del h, w, y, z, loss
    return rows

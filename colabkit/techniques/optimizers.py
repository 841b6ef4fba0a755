"""Low-memory optimizers as plan tokens: ``adamw8bit``, ``paged-adamw8bit``, ``lion``, ``lion8bit``
(bitsandbytes), ``adamw4bit`` (:class:`AdamW4bit`, pure torch), ``adafactor`` (torch) and ``sgd``.

AdamW keeps two fp32 moments: 8 bytes of state per parameter, twice the fp32 weights. The tokens
here trade that for fewer bits (8-bit / 4-bit blockwise-quantized moments), fewer moments (Lion:
one), factored moments (Adafactor: a row and a column vector per matrix) or none (SGD).
:func:`state_bytes_per_param` gives the theory each one is measured against.

Small tensors (< 4096 elements: norms, biases) keep 32-bit state in the quantized optimizers,
like bitsandbytes' ``min_8bit_size`` default: they are a tiny share of the bytes, and blockwise
quantization of a handful of values is where it is least stable.

>>> from colabkit.plan import Plan
>>> Plan.parse("adamw4bit").optimizer
'adamw4bit'
>>> state_bytes_per_param("adamw"), state_bytes_per_param("lion"), state_bytes_per_param("sgd")
(8.0, 4.0, 0.0)
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from ..plan import Context, Plan, PlanError, Technique, register

MIN_QUANT_SIZE = 4096  # tensors smaller than this keep fp32 state (bitsandbytes' min_8bit_size)
BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per 256 values
BLOCK_4BIT = 128  # AdamW4bit: one fp32 absmax per 128 values


# ----- theory: bytes of optimizer state per parameter --------------------------------------------
# Formulas other optimizer modules register: name -> f(arg, shape) -> bytes per parameter.
STATE_FORMULAS: dict[str, Any] = {}


def state_bytes_per_param(token: str, shape: tuple[int, ...] | None = None) -> float:
    """Bytes of optimizer state per parameter for an optimizer token (per-step scalars ignored).

    ``shape`` matters for Adafactor (factored only for matrices) and for the quantized optimizers
    (tensors under 4096 elements keep fp32 state). Formulas, per parameter:
    adamw 8 (two fp32 moments) · adamw8bit/paged-adamw8bit 2 + 2·4/256 (two uint8 moments + an
    fp32 absmax per 256) · adamw4bit 1 + 2·4/128 (two 4-bit moments + an absmax per 128) ·
    lion 4 (one fp32 moment) · lion8bit 1 + 4/256 · adafactor 4·(rows+cols)/(rows·cols) for a
    matrix, 4 for a vector · sgd 0 (``sgd:M`` with momentum M > 0: 4).

    >>> state_bytes_per_param("adafactor", (1024, 256))
    0.01953125
    >>> round(state_bytes_per_param("adamw8bit"), 4)
    2.0312
    """
    name, _, arg = token.partition(":")
    n = math.prod(shape) if shape is not None else None
    small = n is not None and n < MIN_QUANT_SIZE
    if name == "adamw":
        return 8.0
    if name in ("adamw8bit", "paged-adamw8bit"):
        return 8.0 if small else 2 + 2 * 4 / BNB_BLOCK
    if name == "adamw4bit":
        return 8.0 if small else 1 + 2 * 4 / BLOCK_4BIT
    if name == "lion":
        return 4.0
    if name == "lion8bit":
        return 4.0 if small else 1 + 4 / BNB_BLOCK
    if name == "adafactor":
        if shape is not None and len(shape) >= 2:  # torch's factored moments: a row and a column per trailing matrix
            lead = math.prod(shape[:-2])  # (a conv's (out, in, kh, kw): out*in*kh rows, out*in*kw columns)
            return 4 * lead * (shape[-2] + shape[-1]) / math.prod(shape)
        return 4.0
    if name == "sgd":
        return 4.0 if arg and float(arg) > 0 else 0.0
    if name in STATE_FORMULAS:
        return STATE_FORMULAS[name](arg, shape)
    raise ValueError(f"no state formula for optimizer token {token!r}")


def optimizer_state_bytes(params: "torch.nn.Module | Iterable[torch.Tensor]", token: str) -> int:
    """Predicted optimizer-state bytes for trainable parameters (or a model) under ``token``.

    >>> optimizer_state_bytes(torch.nn.Linear(256, 1024), "adamw")
    2105344
    """
    if isinstance(params, torch.nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    return int(sum(p.numel() * state_bytes_per_param(token, tuple(p.shape)) for p in params))


# ----- AdamW with 4-/8-bit blockwise-quantized moments --------------------------------------------
# Each moment is stored as integer codes plus one fp32 absmax per block of values. The kernels below
# work on a whole chunk at once as a (blocks, block) matrix: a handful of torch ops per chunk, no loop
# over blocks, each in place in a preallocated buffer (measured on a CPU: a broadcast mul_/add_ pair is
# twice as fast as one addcmul, amax + amin four times aminmax(dim=1)), and the AdamW update itself is
# torch's fused kernel. Rounding is round-half-up: floor(x + 0.5) through the float -> uint8 cast
# (which truncates, and x >= 0 there).
def _signed_codes(x: torch.Tensor, levels: int, absmax: torch.Tensor) -> torch.Tensor:
    """(nb, block) floats -> the same buffer holding codes ``round(x / absmax · levels) + levels + 1``
    (1 .. 2·levels+1; 0 is exact) as floats + 0.5, ready for the uint8 cast; the per-block absmax
    into ``absmax``."""
    torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_(), out=absmax).clamp_(min=1e-30)
    return x.mul_((levels / absmax)[:, None]).add_(levels + 1.5)


def _signed_values(codes: torch.Tensor, absmax: torch.Tensor, levels: int, out: torch.Tensor) -> torch.Tensor:
    """(nb, block) uint8 codes -> floats (code - levels - 1) / levels · absmax, into ``out``."""
    step = (absmax / levels)[:, None]
    return out.copy_(codes).sub_(levels + 1).mul_(step)


def _sqrt_codes(v: torch.Tensor, levels: int, absmax: torch.Tensor) -> torch.Tensor:
    """(nb, block) second moments (>= 0) -> the same buffer holding codes k = floor(sqrt(v) / absmax ·
    levels) (as floats, ready for the uint8 cast), k = 0 .. levels-1: bin k of sqrt(v) dequantizes to its
    centre (k + 1/2) / levels · absmax. There is no zero level, so a tiny v never dequantizes to 0 and
    blows up the update m / sqrt(v); the absmax into ``absmax``."""
    s = v.sqrt_()  # an AdamW second moment is never negative
    torch.amax(s, dim=1, out=absmax).clamp_(min=1e-30)
    return s.mul_((levels * (1 - 2 ** -20) / absmax)[:, None])  # sqrt(v) = absmax lands in the top bin


def _sqrt_values(codes: torch.Tensor, absmax: torch.Tensor, levels: int, out: torch.Tensor) -> torch.Tensor:
    """(nb, block) uint8 codes -> second moments ((code + 1/2) / levels · absmax)², into ``out``."""
    return out.copy_(codes).add_(0.5).mul_((absmax / levels)[:, None]).square_()


def _pack(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, block) uint8 codes in 0..15 -> (nb, block/2) uint8: byte j of a block holds value j in its
    low nibble and value j + block/2 in its high one (contiguous halves: 8x faster than every other
    value on a CPU)."""
    half = codes.shape[1] // 2
    return torch.add(codes[:, :half], codes[:, half:], alpha=16, out=out)


def _unpack(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(nb, block/2) uint8 -> (nb, block) uint8 codes in 0..15 (the layout of :func:`_pack`)."""
    nb, half = packed.shape
    out = torch.empty(nb, 2 * half, dtype=torch.uint8, device=packed.device) if out is None else out
    torch.bitwise_and(packed, 15, out=out[:, :half])
    torch.bitwise_right_shift(packed, 4, out=out[:, half:])
    return out


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flatten to (n_blocks, block) float32 (a copy), zero-padding the tail."""
    flat = x.reshape(-1).float()
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)


def quantize_signed4(x: torch.Tensor, block: int = BLOCK_4BIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric 4-bit: code = round(x / absmax · 7) + 8, so 0 is exact. Returns
    (packed uint8 codes, fp32 absmax per block).

    >>> q, a = quantize_signed4(torch.tensor([1.0, -0.5, 0.0, 0.25]))
    >>> [round(v, 4) for v in dequantize_signed4(q, a, (4,)).tolist()]
    [1.0, -0.4286, 0.0, 0.2857]
    """
    b = _blocks(x, block)
    absmax = torch.empty(b.shape[0], device=b.device)
    return _pack(_signed_codes(b, 7, absmax).to(torch.uint8)).view(-1), absmax


def dequantize_signed4(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
    n, codes = math.prod(shape), _unpack(packed.view(absmax.numel(), -1))
    return _signed_values(codes, absmax, 7, torch.empty(codes.shape, device=codes.device)).view(-1)[:n].view(shape)


def quantize_sqrt4(v: torch.Tensor, block: int = BLOCK_4BIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moment (>= 0) stored as sqrt(v) in 16 bins of absmax/16, each dequantized to its centre
    (k + 1/2)/16 · absmax, k = 0..15: there is no zero level, so a tiny v never dequantizes to 0 and
    blows up the update m / sqrt(v)."""
    b = _blocks(v.clamp(min=0), block)
    absmax = torch.empty(b.shape[0], device=b.device)
    return _pack(_sqrt_codes(b, 16, absmax).to(torch.uint8)).view(-1), absmax


def dequantize_sqrt4(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
    n, codes = math.prod(shape), _unpack(packed.view(absmax.numel(), -1))
    return _sqrt_values(codes, absmax, 16, torch.empty(codes.shape, device=codes.device)).view(-1)[:n].view(shape)


# The estimator's kernel counter (colabkit.estimate.counting.counted_as, registered when it is imported): a
# context in which what runs is counted ``times`` times -- the blockwise kernels' one full chunk of a fake tensor
_CHUNK_COUNTER: list = []


def register_chunk_counter(counted_as) -> None:
    """Install the context the blockwise kernels run one fake chunk under, counted as ``times`` chunks."""
    _CHUNK_COUNTER[:] = [counted_as]


class _BlockwiseAdamW(torch.optim.Optimizer):
    """AdamW with blockwise-quantized moments (``BITS`` per value, one fp32 absmax per ``block_size``
    values); subclasses fix the format. Each step dequantizes the moments of one chunk of a tensor
    (``CHUNK`` values) into two fp32 buffers, updates them with torch's fused AdamW kernel and quantizes
    them back into the state's own storage, so the fp32 scratch is bounded by the chunk, not by the
    largest tensor. Tensors under ``min_size`` elements keep fp32 moments."""

    BITS = 4
    SIGNED_LEVELS, SQRT_LEVELS = 7, 16  # m on 2·7+1 signed levels, sqrt(v) on 16 positive ones
    # values updated at once: 1 Mi (two 4 MiB fp32 buffers, 9 MiB of scratch in all). Fewer, larger chunks cost
    # fewer kernel launches: at 30M parameters on a 2-core EPYC, 256 Ki values (buffers in L2) took 3.9-4.3x
    # torch's fused AdamW, 1 Mi 3.8x; 32 Ki 8.3x (benchmarks/peers.py, 2026-11-26)
    CHUNK = BLOCK_4BIT * 8192

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block_size: int = BLOCK_4BIT, min_size: int = MIN_QUANT_SIZE):
        if block_size % 2 or self.CHUNK % block_size:
            raise ValueError(f"block_size must be even (two 4-bit codes per byte) and divide {self.CHUNK}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                        min_size=min_size)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded floating state to the parameter's dtype and would turn the uint8 codes
        into floats; put the saved codes and absmax back exactly as they were."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in state_dict["state"].get(i, {}).items():
                if k.endswith(("_codes", "_absmax")):
                    self.state[p][k] = v.to(p.device, copy=True)

    def _code_bytes(self, n: int, bs: int) -> int:
        """Bytes of codes for ``n`` values: 4-bit pads to whole blocks, two codes per byte."""
        return -(-n // bs) * bs // 2

    @staticmethod
    def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                group: dict, step_t: torch.Tensor | None = None) -> None:
        """One AdamW update of (a slice of) a parameter from fp32 moments m, v, in place: torch's fused
        kernel where it runs (same dtype everywhere, a device torch has it for), else the same math.
        ``step`` is the host-side count; ``step_t`` the same on ``p``'s device, made once per parameter."""
        b1, b2 = group["betas"]
        if p.dtype == g.dtype == m.dtype and p.device.type in _FUSED_DEVICES:
            if step_t is None:
                step_t = _device_step(step, p.device)
            torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=group["lr"], beta1=b1, beta2=b2,
                                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
            return
        t = step.item()
        g = g.float()
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
        p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-group["lr"] / (1 - b1 ** t))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scratch: dict[Any, tuple[torch.Tensor, ...]] = {}  # device -> fp32 m, v and uint8 codes for one chunk
        for group in self.param_groups:
            bs = group["block_size"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                quant = p.numel() >= group["min_size"]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    if quant:  # zero codes/absmax: the first step starts from m = v = 0 (below)
                        nb = -(-p.numel() // bs)
                        for key in ("exp_avg", "exp_avg_sq"):
                            st[f"{key}_codes"] = torch.zeros(self._code_bytes(p.numel(), bs), dtype=torch.uint8,
                                                             device=p.device)
                            st[f"{key}_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
                    else:
                        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                if not quant:
                    self._update(p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], group)
                    continue
                size = min(self.CHUNK, -(-p.numel() // bs) * bs)  # one chunk, whole blocks
                if scratch.get(p.device, (torch.empty(0),))[0].numel() < size:  # made once per step, reused
                    scratch[p.device] = (torch.empty(size, device=p.device), torch.empty(size, device=p.device),
                                         torch.empty(size, dtype=torch.uint8, device=p.device))
                self._step_quantized(p, st, group, bs, *scratch[p.device])
        return loss

    def _step_quantized(self, p: torch.Tensor, st: dict, group: dict, bs: int, mbuf: torch.Tensor,
                        vbuf: torch.Tensor, ubuf: torch.Tensor) -> None:
        """Chunks of CHUNK values (whole blocks): dequantize, fused update, quantize back in place."""
        # the first step starts from m = v = 0 (zero codes and absmax: dequantized, also 0). On fake tensors the step
        # count reads 1 (trace._HostScalars) while the estimator traces a later step: the dequantizing path
        first = not is_fake(p) and st["step"].item() == 1
        flat_p, grad, n = p.data.view(-1), p.grad.reshape(-1), p.numel()
        mc, vc, ma_all, va_all = (st[k] for k in ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax",
                                                   "exp_avg_sq_absmax"))
        views: dict[int, tuple[torch.Tensor, ...]] = {}  # kp -> buffers as (nb, bs): made once, not per chunk
        step_t = _device_step(st["step"], p.device)  # once per parameter, not a host-to-device copy per chunk
        full = n // self.CHUNK
        # On fake tensors (the estimator's trace) nothing is computed and every full chunk allocates what the first
        # one does (same buffers, same block counts): the first full chunk and the partial last one give the same
        # peak at a fraction of the traced ops, and the first one is counted as all ``full`` of them by the
        # estimator's kernel counter (register_chunk_counter), so a step's kernels and bytes are the real step's.
        few = is_fake(p) and full > 1
        starts = [0] + ([full * self.CHUNK] if n % self.CHUNK else []) if few else range(0, n, self.CHUNK)
        for c0 in starts:
            times = full if few and c0 == 0 else 1
            with _CHUNK_COUNTER[0](times) if times > 1 and _CHUNK_COUNTER else contextlib.nullcontext():
                c1 = min(n, c0 + self.CHUNK)
                k = c1 - c0
                nb = -(-k // bs)
                kp, b0 = nb * bs, c0 // bs
                if kp not in views:
                    views[kp] = (mbuf[:kp].view(nb, bs), vbuf[:kp].view(nb, bs), ubuf[:kp].view(nb, bs),
                                 mbuf[:k], vbuf[:k])
                m, v, u, m_flat, v_flat = views[kp]
                ma, va = ma_all[b0:b0 + nb], va_all[b0:b0 + nb]
                if first:
                    m.zero_()
                    v.zero_()
                else:
                    self._m_in(mc, ma, c0, k, kp, u, m)
                    _sqrt_values(self._codes_in(vc, c0, k, kp, u), va, self.SQRT_LEVELS, v)
                    if kp > k:  # the padding of the last block: zeros, as when it was quantized
                        mbuf[k:kp].zero_()
                        vbuf[k:kp].zero_()
                self._update(flat_p[c0:c1], grad[c0:c1], m_flat, v_flat, st["step"], group, step_t)
                self._m_out(m, ma, mc, c0, k, kp, u)
                self._codes_out(_sqrt_codes(v, self.SQRT_LEVELS, va), vc, c0, k, kp, u)

    def _m_in(self, codes: torch.Tensor, absmax: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor,
              out: torch.Tensor) -> None:
        """The first moment of values c0 .. c0+kp into ``out`` (nb, block)."""
        _signed_values(self._codes_in(codes, c0, k, kp, u), absmax, self.SIGNED_LEVELS, out)

    def _m_out(self, m: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor, c0: int, k: int, kp: int,
               u: torch.Tensor) -> None:
        """The first moment ``m`` (nb, block; overwritten) quantized into the state's storage."""
        self._codes_out(_signed_codes(m, self.SIGNED_LEVELS, absmax), codes, c0, k, kp, u)

    def _codes_in(self, codes: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor) -> torch.Tensor:
        """The (nb, block) uint8 codes of values c0 .. c0+kp (4-bit: unpacked into ``u``)."""
        return _unpack(codes[c0 // 2:(c0 + kp) // 2].view(u.shape[0], -1), out=u)

    def _codes_out(self, x: torch.Tensor, codes: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor) -> None:
        """Float codes ``x`` (nb, block; 0 <= x < 16) into the state's storage through ``u``, packed."""
        u.view(torch.int8).copy_(x)  # truncates, so floor (x >= 0); to int8 4x faster than to uint8 on a CPU
        _pack(u, out=codes[c0 // 2:(c0 + kp) // 2].view(u.shape[0], -1))


_FUSED_DEVICES = frozenset(_get_fused_kernels_supported_devices())  # where torch has _fused_adamw_


def _device_step(step: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host-side step count as the fused kernel's step tensor on ``device``: the same tensor on the
    host, else a fill on the device (no host-to-device copy, no sync)."""
    return step if step.device == device else torch.full((), float(step.item()), device=device)


class AdamW4bit(_BlockwiseAdamW):
    """AdamW whose two moments are stored in 4 bits, blockwise (128 values share an fp32 absmax):
    about 1.06 bytes of state per parameter instead of 8. m on 15 signed levels (0 exact), sqrt(v) on
    16 positive ones; updated chunk by chunk with torch's fused AdamW kernel (see ``_BlockwiseAdamW``).
    Tensors under ``min_4bit_size`` elements keep fp32 moments.

    >>> w = torch.nn.Parameter(torch.ones(8192))
    >>> opt = AdamW4bit([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.ones(8192); opt.step()
    >>> round(w[0].item(), 3), opt.state[w]["exp_avg_codes"].dtype
    (0.9, torch.uint8)
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block_size: int = BLOCK_4BIT, min_4bit_size: int = MIN_QUANT_SIZE):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                         min_size=min_4bit_size)


class AdamW8bit(_BlockwiseAdamW):
    """AdamW whose two moments are stored in 8 bits, blockwise (256 values share an fp32 absmax), the
    state layout of bitsandbytes' ``AdamW8bit`` (one uint8 per value and moment, 2 + 2·4/256 bytes per
    parameter): m on 255 signed levels (int8, 0 exact), sqrt(v) in 256 bins, linear where bitsandbytes
    uses its dynamic map. The ``adamw8bit`` token's optimizer off CUDA: a few fused passes per chunk,
    where bitsandbytes' CPU path is several times slower (benchmarks/peers.py); on CUDA the token is
    bitsandbytes' kernel.

    >>> w = torch.nn.Parameter(torch.ones(8192))
    >>> opt = AdamW8bit([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.ones(8192); opt.step()
    >>> round(w[0].item(), 3), opt.state[w]["exp_avg_codes"].shape
    (0.9, torch.Size([8192]))
    """

    BITS = 8
    SIGNED_LEVELS, SQRT_LEVELS = 127, 256

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block_size: int = BNB_BLOCK, min_8bit_size: int = MIN_QUANT_SIZE):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                         min_size=min_8bit_size)

    def _code_bytes(self, n: int, bs: int) -> int:
        return n  # one byte per value, no padding (as bitsandbytes)

    def _codes_in(self, codes: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor) -> torch.Tensor:
        if kp == k:
            return codes[c0:c0 + k].view(u.shape)
        u.view(-1)[:k].copy_(codes[c0:c0 + k])  # the last, partial block: padded in the buffer
        u.view(-1)[k:].zero_()
        return u

    def _codes_out(self, x: torch.Tensor, codes: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor) -> None:
        codes[c0:c0 + k].copy_(x.view(-1)[:k])  # float -> uint8 truncates: x >= 0, so this is floor

    # m as int8 (two's complement in the uint8 storage): round(m / absmax · 127), no offset to add or remove
    def _m_in(self, codes: torch.Tensor, absmax: torch.Tensor, c0: int, k: int, kp: int, u: torch.Tensor,
              out: torch.Tensor) -> None:
        out.copy_(self._codes_in(codes, c0, k, kp, u).view(torch.int8)).mul_((absmax / self.SIGNED_LEVELS)[:, None])

    def _m_out(self, m: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor, c0: int, k: int, kp: int,
               u: torch.Tensor) -> None:
        torch.maximum(m.amax(dim=1), m.amin(dim=1).neg_(), out=absmax).clamp_(min=1e-30)
        m.mul_((self.SIGNED_LEVELS / absmax)[:, None]).round_()
        codes[c0:c0 + k].view(torch.int8).copy_(m.view(-1)[:k])


# ----- the tokens ------------------------------------------------------------------------------
def _bnb():
    """bitsandbytes, or a clear error saying how to get it."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # pragma: no cover - installed in CI
        raise ImportError("this optimizer needs bitsandbytes: pip install bitsandbytes "
                          "(or use adamw4bit / adafactor, which need only torch)") from e
    return bnb


def _needs_bnb(token: str):
    def check(plan: Plan, ctx: Context) -> None:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PlanError(f"{token!r} needs bitsandbytes, which is not installed: pip install bitsandbytes, "
                            "or use adamw4bit / adafactor (torch only)")
    return check


def _check_paged(plan: Plan, ctx: Context) -> None:
    _needs_bnb("paged-adamw8bit")(plan, ctx)
    if not ctx.cuda:
        raise PlanError("'paged-adamw8bit' pages optimizer state from GPU to host RAM under memory pressure; "
                        "on a CPU run there is no GPU memory to page out of: use 'adamw8bit'")


def _sgd_arg(arg: str | None) -> float:
    if arg is None:
        return 0.0
    try:
        m = float(arg)
    except ValueError:
        raise PlanError(f"sgd:{arg}: the argument is the momentum, a number in [0, 1), e.g. sgd:0.9") from None
    if not 0 <= m < 1:
        raise PlanError(f"sgd:{arg}: momentum must be in [0, 1), e.g. sgd:0.9")
    return m


# Adafactor's lr is relative: each tensor moves by about lr * RMS(tensor) per step (RMS ~0.02 for GPT
# weights at init), so an AdamW lr of 3e-4 (absolute) corresponds to torch's default relative lr 1e-2.
ADAFACTOR_LR_PER_ADAMW_LR = 1e-2 / 3e-4


def _adafactor(groups: list[dict], plan: Plan, ctx: Context) -> torch.optim.Optimizer:
    """torch Adafactor with ctx.lr mapped to a relative lr; weight decay rescaled so that each step
    still decays by ctx.lr * weight_decay, as AdamW does (torch applies lr * weight_decay)."""
    lr = ctx.lr * ADAFACTOR_LR_PER_ADAMW_LR
    groups = [dict(g, weight_decay=g.get("weight_decay", 0.0) * ctx.lr / lr) for g in groups]
    return torch.optim.Adafactor(groups, lr=lr)


# transformers' TrainingArguments(optim=...) name of each optimizer token that transformers has
# (colabkit.hf maps a plan to it; the estimator reads a TrainingArguments back into a plan)
HF_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "paged-adamw8bit": "paged_adamw_8bit",
            "lion": "lion_32bit", "lion8bit": "lion_8bit", "adamw4bit": "adamw_torch_4bit", "adafactor": "adafactor",
            "sgd": "sgd"}


def _bnb_opt(cls_name: str, **kw):
    def make(groups, plan, ctx):
        opt = getattr(_bnb().optim, cls_name)(groups, lr=ctx.lr, **kw)
        # bitsandbytes files per-parameter overrides on one process-global manager, by position (group,
        # index): transformers' Trainer registers its embeddings for 32-bit state there, and every later
        # bitsandbytes optimizer in the process would give its first parameters 32-bit state (other
        # numbers, other memory). A private, empty manager keeps a plan's optimizer what the plan says.
        mng = type(opt.mng).__new__(type(opt.mng))
        mng.initialize()
        opt.mng = mng
        return opt
    return make


def _on_device(p: torch.Tensor) -> bool:
    """A CUDA parameter that stays on the device (not one of offload:params' host-side block parameters)."""
    return p.is_cuda and not getattr(p, "_colabkit_host", False)


# bitsandbytes' Optimizer8bit.step synchronizes the device after every parameter (sync_gpu): harmless once per
# step, but under fused-step each parameter is stepped alone inside backward, so it is a full GPU stall per tensor.
BNB_SYNC_PER_PARAM = ("paged-adamw8bit", "lion", "lion8bit")  # bitsandbytes only: refused with fused-step on CUDA


def adamw8bit_kernel(plan: Plan | str, all_on_gpu: bool) -> str:
    """Which kernel steps the ``adamw8bit`` token: ``"bitsandbytes"`` (its fused blockwise CUDA kernel) when
    ``all_on_gpu`` -- every parameter the optimizer is given lives on the GPU -- and they step together (no
    ``fused-step``); ``"colabkit"`` (:class:`AdamW8bit`, same state bytes, pure torch) otherwise: off CUDA,
    where bitsandbytes runs a slow fallback; under fused-step, where bitsandbytes' device sync after every
    parameter would stall backward once per tensor; with offload:params (host and device parameters mixed:
    colabkit's kernel runs each on its own side, with per-device scratch) or offload:optimizer (host copies).
    The one place this rule is written: the token's factory asks it with the parameters it is given, the
    estimator with where the plan puts them (:func:`colabkit.estimate.substitutes.steps_own_8bit_kernel`).

    >>> adamw8bit_kernel("adamw8bit", True), adamw8bit_kernel("adamw8bit+fused-step", True)
    ('bitsandbytes', 'colabkit')
    >>> adamw8bit_kernel("adamw8bit", False)
    'colabkit'
    """
    return "bitsandbytes" if all_on_gpu and "fused-step" not in Plan.parse(plan) else "colabkit"


def _adamw8bit(groups: list[dict], plan: Plan, ctx: Context) -> torch.optim.Optimizer:
    """The kernel :func:`adamw8bit_kernel` names for these parameters: bitsandbytes' AdamW8bit or
    colabkit's :class:`AdamW8bit`."""
    ps = [p for g in groups for p in g["params"]]
    if adamw8bit_kernel(plan, bool(ps) and all(_on_device(p) for p in ps)) == "bitsandbytes":
        return _bnb_opt("AdamW8bit", min_8bit_size=MIN_QUANT_SIZE)(groups, plan, ctx)
    return AdamW8bit(groups, lr=ctx.lr, min_8bit_size=MIN_QUANT_SIZE)


def _check_adamw8bit(plan: Plan, ctx: Context) -> None:
    if ctx.cuda:  # off CUDA the token is colabkit's AdamW8bit: torch only
        _needs_bnb("adamw8bit")(plan, ctx)


OPTIMIZERS = [
    Technique(name="adamw8bit", group="optimizer", order=40, check=_check_adamw8bit,
              help="AdamW with blockwise 8-bit moments: ~2 bytes/param instead of 8 (bitsandbytes on CUDA)",
              make_optimizer=_adamw8bit),
    Technique(name="paged-adamw8bit", group="optimizer", order=40, check=_check_paged,
              help="adamw8bit whose state pages to host RAM when the GPU runs short (CUDA only)",
              make_optimizer=_bnb_opt("PagedAdamW8bit", min_8bit_size=MIN_QUANT_SIZE)),
    Technique(name="lion", group="optimizer", order=40, check=_needs_bnb("lion"),
              help="Lion (sign of a momentum): one fp32 moment, 4 bytes/param; use ~3-10x smaller lr than AdamW",
              make_optimizer=_bnb_opt("Lion", optim_bits=32)),
    Technique(name="lion8bit", group="optimizer", order=40, check=_needs_bnb("lion8bit"),
              help="Lion with an 8-bit blockwise moment: ~1 byte/param",
              make_optimizer=_bnb_opt("Lion8bit", min_8bit_size=MIN_QUANT_SIZE)),
    Technique(name="adamw4bit", group="optimizer", order=40,
              help="AdamW with 4-bit blockwise moments (pure torch): ~1.06 bytes/param",
              make_optimizer=lambda groups, plan, ctx: AdamW4bit(groups, lr=ctx.lr)),
    Technique(name="adafactor", group="optimizer", order=40,
              help="torch Adafactor: factored second moment (a row and a column per matrix), no momentum",
              make_optimizer=_adafactor),
    Technique(name="sgd", group="optimizer", order=40, parse=_sgd_arg, examples=("sgd", "sgd:0.9"),
              help="plain SGD: no state (sgd:M adds momentum M, 4 bytes/param)",
              make_optimizer=lambda groups, plan, ctx: torch.optim.SGD(groups, lr=ctx.lr, momentum=plan.get("sgd", 0.0))),
]
for _t in OPTIMIZERS:
    register(_t)


def make_optimizer(model: torch.nn.Module, token: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.1,
                   device: str | torch.device = "cpu") -> Any:
    """The optimizer a plan token names, on ``model``'s trainable parameters in two groups (no weight
    decay on norms and biases): the same factory the Trainer uses, for your own loop.

    >>> opt = make_optimizer(torch.nn.Linear(4, 4), "adafactor")
    >>> type(opt).__name__, [g["weight_decay"] > 0 for g in opt.param_groups]
    ('Adafactor', [True, False])
    """
    from ..plan import REGISTRY, param_groups

    plan = Plan.parse(token)
    ctx = Context(device=torch.device(device), lr=lr, weight_decay=weight_decay, model=model)  # adam-mini, galore: names
    plan.check(ctx)
    return REGISTRY[plan.optimizer].make_optimizer(param_groups(model, weight_decay), plan, ctx)

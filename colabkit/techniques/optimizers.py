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

import importlib.util
import math
from typing import Any, Iterable

import torch

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
        if shape is not None and len(shape) >= 2:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            return 4 * (rows + cols) / (rows * cols)
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


# ----- AdamW with 4-bit blockwise-quantized moments ----------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flatten to (n_blocks, block), zero-padding the tail."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """(N,) codes in 0..15 (N even) -> (N/2,) uint8, two codes per byte."""
    c = codes.to(torch.uint8)
    return c[0::2] | (c[1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """(N/2,) uint8 -> (N,) codes in 0..15 as float32."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).float()


def quantize_signed4(x: torch.Tensor, block: int = BLOCK_4BIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric 4-bit: code = round(x / absmax · 7) + 8, so 0 is exact. Returns
    (packed uint8 codes, fp32 absmax per block).

    >>> q, a = quantize_signed4(torch.tensor([1.0, -0.5, 0.0, 0.25]))
    >>> dequantize_signed4(q, a, (4,)).tolist()
    [1.0, -0.5714285969734192, 0.0, 0.2857142984867096]
    """
    b = _blocks(x.float(), block)  # (nb, block)
    absmax = b.abs().amax(dim=1).clamp(min=1e-30)  # (nb,)
    codes = torch.round(b / absmax[:, None] * 7).clamp_(-7, 7) + 8
    return _pack(codes.reshape(-1)), absmax


def dequantize_signed4(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
    n = math.prod(shape)
    b = (_unpack(packed).view(absmax.numel(), -1) - 8) / 7 * absmax[:, None]
    return b.reshape(-1)[:n].view(shape)


def quantize_sqrt4(v: torch.Tensor, block: int = BLOCK_4BIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moment (>= 0) stored as sqrt(v) on the levels (k+1)/16 · absmax, k = 0..15: there is
    no zero level, so a tiny v never dequantizes to 0 and blows up the update m / sqrt(v)."""
    b = _blocks(v.float().clamp(min=0).sqrt(), block)  # (nb, block), sqrt(v)
    absmax = b.amax(dim=1).clamp(min=1e-30)
    codes = (torch.round(b / absmax[:, None] * 16) - 1).clamp_(0, 15)
    return _pack(codes.reshape(-1)), absmax


def dequantize_sqrt4(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
    n = math.prod(shape)
    s = (_unpack(packed).view(absmax.numel(), -1) + 1) / 16 * absmax[:, None]
    return s.reshape(-1)[:n].view(shape).square()


class AdamW4bit(torch.optim.Optimizer):
    """AdamW whose two moments are stored in 4 bits, blockwise (128 values share an fp32 absmax):
    about 1.06 bytes of state per parameter instead of 8. Each step dequantizes the moments of one
    chunk of a tensor (``CHUNK`` values), updates them in fp32 and quantizes them back in place, so
    the fp32 scratch is bounded by the chunk, not by the largest tensor. Tensors under ``min_4bit_size`` elements keep fp32 moments.

    >>> w = torch.nn.Parameter(torch.ones(8192))
    >>> opt = AdamW4bit([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.ones(8192); opt.step()
    >>> round(w[0].item(), 3), opt.state[w]["exp_avg_codes"].dtype
    (0.9, torch.uint8)
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block_size: int = BLOCK_4BIT, min_4bit_size: int = MIN_QUANT_SIZE):
        if block_size % 2 or self.CHUNK % block_size:
            raise ValueError(f"block_size must be even (two 4-bit codes per byte) and divide {self.CHUNK}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                        min_4bit_size=min_4bit_size)
        super().__init__(params, defaults)

    CHUNK = BLOCK_4BIT * 8192  # values updated at once (a multiple of any even block size up to 8192)

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

    @staticmethod
    def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: float, group: dict) -> None:
        """One AdamW update of (a slice of) a parameter from fp32 moments m, v, in place."""
        b1, b2 = group["betas"]
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
        for group in self.param_groups:
            bs = group["block_size"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                quant = p.numel() >= group["min_4bit_size"]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    if quant:  # zero codes/absmax: the first step starts from m = v = 0 (below)
                        nb = -(-p.numel() // bs)
                        for key in ("exp_avg", "exp_avg_sq"):
                            st[f"{key}_codes"] = torch.zeros(nb * bs // 2, dtype=torch.uint8, device=p.device)
                            st[f"{key}_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
                    else:
                        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                t = st["step"].item()
                if not quant:
                    self._update(p, p.grad.float(), st["exp_avg"], st["exp_avg_sq"], t, group)
                    continue
                # Chunks of CHUNK values (whole blocks): fp32 moments and temporaries exist for one
                # chunk at a time, so a 50k x 768 embedding does not need ~1 GB of scratch.
                flat_p, flat_g, n = p.data.view(-1), p.grad.reshape(-1), p.numel()
                for c0 in range(0, n, self.CHUNK):
                    c1 = min(n, c0 + self.CHUNK)
                    b0, b1 = c0 // bs, -(-c1 // bs)
                    mc, ma = st["exp_avg_codes"][b0 * bs // 2: b1 * bs // 2], st["exp_avg_absmax"][b0:b1]
                    vc, va = st["exp_avg_sq_codes"][b0 * bs // 2: b1 * bs // 2], st["exp_avg_sq_absmax"][b0:b1]
                    if t == 1:
                        m = torch.zeros(c1 - c0, dtype=torch.float32, device=p.device)
                        v = torch.zeros_like(m)
                    else:
                        m = dequantize_signed4(mc, ma, (c1 - c0,))
                        v = dequantize_sqrt4(vc, va, (c1 - c0,))
                    self._update(flat_p[c0:c1], flat_g[c0:c1].float(), m, v, t, group)
                    for (codes, absmax), (q, a) in (((mc, ma), quantize_signed4(m, bs)), ((vc, va), quantize_sqrt4(v, bs))):
                        codes.copy_(q)  # into the existing state storage: the state never exists twice
                        absmax.copy_(a)
        return loss


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


OPTIMIZERS = [
    Technique(name="adamw8bit", group="optimizer", order=40, check=_needs_bnb("adamw8bit"),
              help="bitsandbytes AdamW with blockwise 8-bit moments: ~2 bytes/param instead of 8",
              make_optimizer=_bnb_opt("AdamW8bit", min_8bit_size=MIN_QUANT_SIZE)),
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

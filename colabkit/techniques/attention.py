"""Memory-efficient attention: ``attention:math|efficient|flash`` picks the scaled-dot-product-attention
backend through ``torch.nn.attention.sdpa_kernel`` around each forward.

``math`` materialises the (B, H, S, S) attention matrix and keeps its softmax for backward: memory
grows with S². ``efficient`` (memory-efficient, sm50+, what a T4 has) and ``flash`` (sm80+) work in
tiles and keep only the output and a (B, H, S) log-sum-exp: memory grows with S. Forcing a backend the
device lacks is refused when the plan is built. On the CPU only ``math`` can be forced portably;
without a token torch already uses a fused, linear-memory CPU kernel (``backend="default"`` in
:func:`attention_memory` measures it).

>>> from colabkit.plan import Plan
>>> Plan.parse("attention:math").get("attention")
'math'
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ..env import emulating_t4, sdpa_backends
from ..memory import MemoryTracker
from ..plan import Context, Plan, PlanError, Technique, register
from .checkpoint import recomputed_with

BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def _parse(arg: str | None) -> str:
    if arg not in BACKENDS:
        got = f"':{arg}'" if arg is not None else "no backend"
        raise PlanError(f"{got}: choose attention:math, attention:efficient or attention:flash")
    return arg


def refusal(backend: str, device: str | torch.device) -> str | None:
    """Why ``backend`` cannot be forced on ``device`` (None when it can).

    >>> refusal("math", "cpu") is None, "attention:math" in refusal("flash", "cpu")
    (True, True)
    """
    dev = torch.device(device)
    have = sdpa_backends(dev)
    if backend in have:
        return None
    if dev.type == "cpu":
        return (f"attention:{backend}: on the CPU only attention:math can be forced (torch's own choice without "
                "a token is already a fused, memory-efficient CPU kernel); on a T4 use attention:efficient")
    name = "a T4 (T4 emulation is on)" if emulating_t4() else torch.cuda.get_device_name(dev)
    major, minor = (7, 5) if emulating_t4() else torch.cuda.get_device_capability(dev)
    need = "sm80+ (Ampere: A100, L4, RTX 30xx)" if backend == "flash" else "sm50+"
    use = "attention:efficient" if "efficient" in have else "attention:math"
    linear = ", which also keeps attention memory linear in the sequence length" if "efficient" in have else ""
    return f"attention:{backend} needs {need}; {name} (sm{major}{minor}) has {', '.join(have)}: use {use}{linear}"


HALF = ("fp16", "bf16")


def _check(plan: Plan, ctx: Context) -> None:
    backend = plan.get("attention")
    if backend == "flash" and not any(h in plan for h in HALF):  # true on any device: said first
        raise PlanError("attention:flash has kernels for fp16 and bf16 only: with fp32 activations torch finds no "
                        "flash kernel ('No available kernel', seen on an H200). Add fp16 ('fp16+attention:flash'; "
                        "bf16 on sm80+), or use attention:efficient, which also runs in fp32")
    why = refusal(backend, ctx.device)
    if why:
        raise PlanError(why)


def _prepare(model: torch.nn.Module, plan: Plan, ctx: Context) -> torch.nn.Module:
    # Hugging Face models only reach F.scaled_dot_product_attention with attn_implementation="sdpa";
    # with "eager" the token would have no effect, so say so rather than silently ignore it.
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise PlanError(f"attention:{plan.get('attention')} chooses an SDPA backend, but this model uses "
                        f"attn_implementation={impl!r}: load it with attn_implementation='sdpa'")
    return model


def backend_context(backend: str):
    """The context that forces ``backend`` for every ``F.scaled_dot_product_attention`` inside it.

    >>> with backend_context("math"):
    ...     F.scaled_dot_product_attention(*torch.ones(3, 1, 1, 4, 8)).shape
    torch.Size([1, 1, 4, 8])
    """
    return sdpa_kernel([BACKENDS[backend]])


@contextlib.contextmanager
def _forward_context(backend: str):
    # the backend for this forward and for every block recomputed from it in backward (checkpoint,
    # offload:params): the recompute must save the same tensors as the forward did
    with backend_context(backend), recomputed_with(lambda: backend_context(backend)):
        yield


class SDPACalls(TorchFunctionMode):
    """Notes in ``calls`` each ``scaled_dot_product_attention`` inside it, however the model reached it
    (``F.``, imported by name, or through a wrapper that calls torch's own).

    >>> calls = []
    >>> with SDPACalls(calls):
    ...     _ = F.scaled_dot_product_attention(*torch.ones(3, 1, 1, 4, 8))
    >>> len(calls)
    1
    """

    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            self.calls.append(1)
        return func(*args, **(kwargs or {}))


_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is (or calls, when wrapped)
NO_SDPA = ("no scaled_dot_product_attention call ran: the model computes attention itself, where no SDPA backend "
           "applies")


def _witness(plan: Plan, ctx: Context):
    calls: list[int] = []
    tok = f"attention:{plan.get('attention')}"
    return SDPACalls(calls), lambda: None if calls else f"{tok} did not act in the first training forward ({NO_SDPA}): drop {tok!r} from the plan"


register(Technique(
    name="attention",
    help="scaled-dot-product-attention backend: math (S² memory), efficient (linear; T4), flash (linear; sm80+)",
    parse=_parse,
    check=_check,
    prepare_model=_prepare,
    forward_context=lambda plan, ctx: _forward_context(plan.get("attention")),
    witness=_witness,
    examples=("attention:math", "attention:efficient", "attention:flash"),
    order=60,
))


# ----- measurement: attention memory vs sequence length ------------------------------------------
def random_qkv(batch: int, heads: int, seq: int, head_dim: int, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """Seeded q, k, v of shape (B, H, S, d) that require grad, the same on every device.

    >>> [t.shape for t in random_qkv(1, 2, 8, 4)][0]
    torch.Size([1, 2, 8, 4])
    """
    g = torch.Generator().manual_seed(seed)
    # created before any tracker starts: a measurement then counts only what attention adds
    return [torch.randn(batch, heads, seq, head_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


def _context(backend: str, device: torch.device):
    # "default" leaves the choice to torch (a context that changes nothing: a value, not a branch)
    return backend_context(backend) if backend != "default" else contextlib.nullcontext()


def attention_run(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Causal SDPA forward + backward (loss = sum of outputs²) under ``backend`` (``default`` = torch's
    own choice); returns the output and the gradients of q, k, v."""
    with _context(backend, q.device):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return out.detach(), grads


def attention_memory(backend: str = "math", seqs: Iterable[int] = (128, 256, 512), batch: int = 1,
                     heads: int = 4, head_dim: int = 64, device: str | torch.device | None = None,
                     dtype: torch.dtype | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Measure one causal attention's forward + backward memory with :class:`MemoryTracker` at each
    sequence length. ``activations`` is the forward's own peak (what is kept for backward plus
    temporaries), ``peak_bytes`` the peak over forward and backward beyond the q, k, v inputs;
    ``matrix_bytes`` is one (B, H, S, S) attention matrix, the unit of the quadratic term.

    >>> rows = attention_memory("math", seqs=(256, 512), device="cpu")
    >>> rows[1]["activations"] > 3 * rows[0]["activations"]  # ~S²
    True
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend != "default" and (why := refusal(backend, dev)):
        raise PlanError(why)
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    rows = []
    for seq in seqs:
        q, k, v = random_qkv(batch, heads, seq, head_dim, dev, dtype, seed)
        with MemoryTracker(device=dev, alert_at=None) as mt:
            t0 = time.perf_counter()
            with mt.phase("forward"):
                with _context(backend, dev):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                loss = out.float().square().sum()
            with mt.phase("backward"):
                loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
        r = mt.report()
        rows.append({"backend": backend, "seq": seq, "activations": r["breakdown"]["activations"],
                     "peak_bytes": r["tracked_peak_bytes"], "time_s": dt,
                     "matrix_bytes": batch * heads * seq * seq * torch.finfo(dtype).bits // 8,
                     "device": str(dev), "dtype": str(dtype).replace("torch.", "")})
        del q, k, v, out, loss
    return rows


def quadratic_fit(rows: Sequence[dict[str, Any]], key: str = "activations") -> dict[str, float]:
    """Fit ``bytes = a + b·S + c·S²`` to measured rows and express the S² term in attention matrices
    (B·H·S² elements): about 0 for a linear-memory kernel, ≥ 1 when the matrix is materialised.

    >>> fit = quadratic_fit(attention_memory("math", seqs=(64, 128, 256), device="cpu"))
    >>> fit["matrices"] >= 1
    True
    """
    import numpy as np

    s = np.array([r["seq"] for r in rows], dtype=float)
    m = np.array([r[key] for r in rows], dtype=float)
    c, b, a = np.polyfit(s, m, 2) if len(rows) >= 3 else (0.0, *np.polyfit(s, m, 1))
    per_matrix = rows[-1]["matrix_bytes"] / rows[-1]["seq"] ** 2  # bytes of one matrix per S²
    return {"a": float(a), "b": float(b), "c": float(c), "matrices": float(c / per_matrix)}

"""Will it fit? :func:`estimate` predicts the peak memory of a whole training step without allocating it.

It traces the real Trainer on fake tensors (:mod:`.trace`), moves offloaded state to the host
(:mod:`.formulas`), compares the result with the budget of a GPU profile or of this machine, and puts
the textbook formula beside it so you see where that is off.

>>> r = estimate("gpt-tiny", "baseline", batch=2, seq=16, device="cpu")
>>> r["breakdown"]["params"] == 4 * r["params"], r["fits"]
(True, True)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..env import budget_bytes as _budget_bytes
from ..memory import CATEGORIES, fmt_bytes
from ..plan import REGISTRY, Plan
from .formulas import _host_split, analytic
from .zero import for_rank, zero_per_rank
from .trace import CUDA_ALLOC_ROUND, _as_t4, _profile, _split_gpu_tokens, check_as_gpu, trace_with_substitutes


def estimate(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str = "baseline", batch: int = 8,
             seq: int = 128, gpu: str | None = "t4", device: str | None = None, steps: int = 2,
             budget_bytes: int | None = None, world_size: int = 1) -> dict[str, Any]:
    """Predicted peak and per-category breakdown of a training run, on a GPU profile or on the CPU.

    ``device="cpu"`` predicts a CPU ``bench`` run (what CI checks); ``gpu="t4"`` predicts a T4:
    the plan is validated as on a T4 (no bf16), traced on the CPU (same graph), storages rounded to
    the CUDA allocator's 512 B, offload tokens move state to ``host_bytes``, and ``fits`` compares the
    peak with the T4's usable bytes (15360 MiB minus the CUDA context ~0.4 GiB and allocator slack).

    >>> r = estimate("gpt-tiny", "checkpoint" if "checkpoint" in REGISTRY else "baseline", 2, 16)
    >>> r["peak_bytes"] < r["budget_bytes"]
    True
    """
    profile = _profile(gpu, device)
    plan = Plan.parse(plan)
    sharded_plan, plan, batch, zero = plan, *for_rank(plan, batch, world_size)  # zero:N: one rank's share
    notes: list[str] = []
    with _as_t4(profile):
        traced_plan, offload = _split_gpu_tokens(plan, profile)
        if profile is not None:
            check_as_gpu(plan)
        t = trace_with_substitutes(model_fn, traced_plan, batch, seq, steps,
                                    CUDA_ALLOC_ROUND if profile else 1, notes)
    br, at = zero_per_rank(t["breakdown"], zero, world_size), zero_per_rank(t["at_peak"], zero, world_size)
    t["peak_bytes"] -= sum(t["at_peak"].values()) - sum(at.values())
    host = 0
    cfg = t["config"]
    if offload:
        br, at, host = _host_split(br, at, offload, t["trainable_shapes"], getattr(cfg, "n_layer", 1), notes)
        peak = sum(at.values())
    else:
        peak = t["peak_bytes"]
    if profile is not None:
        budget = budget_bytes or profile["usable_bytes"]
        notes.append(f"budget {fmt_bytes(budget)}: {profile['name']} shows {profile['total_bytes'] // 2**20} MiB; "
                     f"usable = total minus CUDA context and allocator slack ({profile['source']})")
    else:
        budget = budget_bytes or _budget_bytes()
    out = {"model": model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom"),
           "plan": str(sharded_plan), "batch": batch, "world_size": world_size, "seq": seq, "device": "cpu" if profile is None else gpu,
           "params": t["params"], "trainable_params": t["trainable_params"], "peak_bytes": int(peak),
           "breakdown": {c: int(br[c]) for c in CATEGORIES}, "at_peak": {c: int(at[c]) for c in CATEGORIES},
           "peak_phase": t["peak_phase"], "host_bytes": int(host), "budget_bytes": int(budget),
           "notes": notes}
    # Every resource the plan uses, judged on its own; the worst one decides the verdict.
    resources = {"device": {"need": int(peak), "budget": int(budget), "uncertainty": 0}}
    if profile is not None and host:
        resources["host"] = {"need": int(host), "budget": int(profile["host_ram_bytes"]), "uncertainty": 0}
    out.update(verdict(resources))
    if cfg is not None and hasattr(cfg, "n_layer"):
        a = analytic(cfg, plan, batch, seq, t["trainable_params"])
        a["error_vs_trace"] = (a["total"] - peak) / peak
        out["analytic"] = a
    return out


VERDICTS = ("fits", "tight", "does not fit")


def verdict(resources: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Judge each resource ``{"need", "budget", "uncertainty"}`` (bytes): ``fits`` when need plus its
    uncertainty is within budget, ``tight`` when only need is, else ``does not fit``. The worst
    resource decides (``decided_by``); ``margin_bytes`` is its budget minus need.

    >>> v = verdict({"device": {"need": 9, "budget": 10, "uncertainty": 2}, "host": {"need": 1, "budget": 10, "uncertainty": 0}})
    >>> v["verdict"], v["decided_by"], v["margin_bytes"], v["fits"]
    ('tight', 'device', 1, True)
    """
    judged = {}
    for name, r in resources.items():
        margin = r["budget"] - r["need"]
        judged[name] = dict(r, margin=margin, verdict=VERDICTS[0] if margin >= r.get("uncertainty", 0)
                            else VERDICTS[1] if margin >= 0 else VERDICTS[2])
    worst = max(judged, key=lambda n: (VERDICTS.index(judged[n]["verdict"]), -judged[n]["margin"]))
    w = judged[worst]
    return {"resources": judged, "verdict": w["verdict"], "decided_by": worst, "margin_bytes": int(w["margin"]),
            "fits": w["verdict"] != VERDICTS[2]}

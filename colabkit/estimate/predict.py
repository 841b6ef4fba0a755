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
from . import overheads as _overheads
from .formulas import _host_split, analytic
from .trace import CUDA_ALLOC_ROUND, _as_t4, _profile, _split_gpu_tokens, check_as_gpu, trace_with_substitutes


def estimate(model_fn: Callable[[], torch.nn.Module] | str, plan: Plan | str = "baseline", batch: int = 8,
             seq: int = 128, gpu: str | None = "t4", device: str | None = None, steps: int = 2,
             budget_bytes: int | None = None, calibration: dict[str, Any] | bool = True) -> dict[str, Any]:
    """Predicted peak and per-category breakdown of a training run, on a GPU profile or on the CPU.

    ``device="cpu"`` predicts a CPU ``bench`` run (what CI checks); ``gpu="t4"`` (or another key of
    ``GPU_PROFILES``) predicts that GPU: the plan is validated as on a T4 (no bf16), traced on the CPU
    (same graph), storages rounded to the CUDA allocator's 512 B, offload tokens move state to
    ``host_bytes``. ``peak_bytes`` stays the tensors' peak (what ``max_memory_allocated`` shows);
    ``overheads`` names what the GPU adds (:mod:`.overheads`: CUDA context, cuBLAS workspaces, allocator
    rounding, fragmentation, optimizer-step temporaries), and the device resource needs their sum on top,
    within their ``uncertainty``, of the capacity CUDA reports (``budget_bytes``). ``calibration``: True
    uses the profile ``colabkit calibrate`` stored for this GPU (if any), False ignores it, a dict is used.

    >>> r = estimate("gpt-tiny", "checkpoint" if "checkpoint" in REGISTRY else "baseline", 2, 16)
    >>> r["peak_bytes"] < r["budget_bytes"]
    True
    """
    profile = _profile(gpu, device)
    plan = Plan.parse(plan)
    notes: list[str] = []
    with _as_t4(profile):
        traced_plan, offload = _split_gpu_tokens(plan, profile)
        if profile is not None:
            check_as_gpu(plan)
        t = trace_with_substitutes(model_fn, traced_plan, batch, seq, steps,
                                    CUDA_ALLOC_ROUND if profile else 1, notes)
    br, at = t["breakdown"], t["at_peak"]
    host = 0
    cfg = t["config"]
    if offload:
        br, at, host = _host_split(br, at, offload, t["trainable_shapes"], getattr(cfg, "n_layer", 1), notes)
        peak = sum(at.values())
    else:
        peak = t["peak_bytes"]
    terms: dict[str, _overheads.Term] = {}
    if profile is not None:
        # The budget is the capacity CUDA reports; what the GPU adds to the traced tensors is named in `overheads`.
        calibrated = (_overheads.load_profile(profile["key"]) if calibration is True
                      else calibration or None)  # False: the uncalibrated terms; a dict: that profile
        budget = budget_bytes or (calibrated or {}).get("capacity_bytes") or profile["capacity_bytes"]
        terms = _overheads.terms(profile, plan, t["trainable_shapes"], int(peak), t.get("frozen16", ()),
                                 transformers_model=type(cfg).__module__.startswith("transformers"),
                                 calibrated=calibrated)
        notes.append(f"budget {fmt_bytes(budget)}: the capacity CUDA reports on a {profile['name']} "
                     f"(nvidia-smi shows {profile['total_bytes'] // 2**20} MiB); {profile['source']}"
                     + (f"; calibrated profile from {calibrated.get('date')}" if calibrated else ""))
    else:
        budget = budget_bytes or _budget_bytes()
    extra, uncertainty = _overheads.total(terms)
    out = {"model": model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", "custom"),
           "plan": str(plan), "batch": batch, "seq": seq, "device": "cpu" if profile is None else gpu,
           "params": t["params"], "trainable_params": t["trainable_params"], "peak_bytes": int(peak),
           "breakdown": {c: int(br[c]) for c in CATEGORIES}, "at_peak": {c: int(at[c]) for c in CATEGORIES},
           "peak_phase": t["peak_phase"], "host_bytes": int(host), "budget_bytes": int(budget),
           "notes": notes}
    if profile is not None:
        out["overheads"] = {k: v.nbytes for k, v in terms.items()}
        out["overhead_terms"] = {k: v.as_dict() for k, v in terms.items()}
    # Every resource the plan uses, judged on its own; the worst one decides the verdict. On a GPU the
    # device needs the traced peak plus the overheads, within the overheads' uncertainty.
    resources = {"device": {"need": int(peak) + extra, "budget": int(budget), "uncertainty": uncertainty}}
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


def rejudge(r: dict[str, Any], device_uncertainty: int) -> dict[str, Any]:
    """The verdict again after ``peak_bytes``, ``overheads`` or ``host_bytes`` of an estimate ``r`` were
    changed (the planner's depth extrapolation): the device needs peak plus overheads, the host its bytes.

    >>> r = {"peak_bytes": 5, "host_bytes": 0, "overheads": {"cuda_context": 3},
    ...      "resources": {"device": {"need": 1, "budget": 10, "uncertainty": 0}}}
    >>> v = rejudge(r, 1); v["verdict"], v["margin_bytes"], v["resources"]["device"]["need"]
    ('fits', 2, 8)
    """
    res = {k: {f: v[f] for f in ("need", "budget", "uncertainty")} for k, v in r["resources"].items()}
    res["device"].update(need=int(r["peak_bytes"] + sum(r.get("overheads", {}).values())),
                         uncertainty=int(device_uncertainty))
    if "host" in res:
        res["host"]["need"] = int(r["host_bytes"])
    out = verdict(res)
    if "overhead_terms" in r:
        out["overhead_terms"] = {k: dict(v, nbytes=r["overheads"][k]) for k, v in r["overhead_terms"].items()}
    return out

"""Deep models on paper: an estimate at depth L from traces at depth 1 and 2.

Every transformer block is the same, so each phase's peak (forward, backward, optimizer step), each
category, the host bytes, the GPU's overheads and the fp32 build are affine in depth: two shallow traces
give the deep model's figures in seconds instead of minutes (a 405B model has 126 blocks). The planner's
:func:`~colabkit.estimate.planner.largest` extrapolates GPT shapes this way; :func:`by_depth` does it for
``hf:<id>`` configs (Llama-3.1-70B, -405B, ...), checked against full traces by the tests.

>>> lin = affine(10, 14, 48)   # 10 bytes at depth 1, 14 at depth 2
>>> lin
198
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from ..env import GPU_PROFILES
from ..memory import CATEGORIES
from ..models import count_params, hub_config
from .speed import COUNT_KEYS, speed_of

# hf:<id> configs deeper than this are estimated by depth extrapolation (a full fake trace of 80 blocks
# takes a minute on a 2-core machine; two shallow ones take seconds)
DEEP = 8
_DEPTH_KEYS = ("num_hidden_layers", "n_layer")


def affine(at1: float, at2: float, depth: int) -> int:
    """The value at ``depth`` of a quantity affine in depth, from its values at depth 1 and 2."""
    return int(at1 + (at2 - at1) * (depth - 1))


def extrapolate(r1: dict[str, Any], r2: dict[str, Any], depth: int) -> dict[str, Any]:
    """An estimate at ``depth`` from estimates at depth 1 and 2 (same plan, batch, sequence, GPU).
    Each phase's peak is affine on its own; the step's peak is the largest of them at ``depth`` (at depth 1
    the peak may sit in backward and move to the optimizer step at depth 48). ``resources`` keep depth 2's
    budgets with the needs extrapolated; the caller re-judges the verdict (:func:`.predict.rejudge`)."""
    lin = lambda a, b: affine(a, b, depth)  # noqa: E731
    out = dict(r2)
    phases = {}
    for p in set(r1["phase_peaks"]) & set(r2["phase_peaks"]):
        a, b = r1["phase_peaks"][p], r2["phase_peaks"][p]
        phases[p] = {"peak": lin(a["peak"], b["peak"]),
                     "at_peak": {c: lin(a["at_peak"][c], b["at_peak"][c]) for c in CATEGORIES},
                     "own": {c: lin(a["own"][c], b["own"][c]) for c in CATEGORIES}}
    top = max(phases, key=lambda p: phases[p]["peak"])
    out["phase_peaks"], out["peak_phase"] = phases, top
    out["peak_bytes"], out["at_peak"] = phases[top]["peak"], phases[top]["at_peak"]
    out["breakdown"] = {c: max(v["own"][c] for v in phases.values()) for c in CATEGORIES}
    for k in ("host_bytes", "disk_bytes", "params", "trainable_params", "build_bytes") + COUNT_KEYS:
        if k in r2:
            out[k] = lin(r1[k], r2[k])
    if "overheads" in r2:  # GPU terms (issue 12) are affine in depth too
        out["overheads"] = {k: lin(r1["overheads"][k], v) for k, v in r2["overheads"].items()}
    if "flops" in out:  # the step time of the deep model, from its extrapolated FLOPs
        out.update(speed_of(out, {k: out[k] for k in COUNT_KEYS}, GPU_PROFILES.get(out["device"])))
    none = {"need": 0, "uncertainty": 0}  # a resource only the deeper model uses (host RAM at depth 2)
    out["resources"] = {k: dict(v, need=lin(r1["resources"].get(k, none)["need"], v["need"]),
                                uncertainty=lin(r1["resources"].get(k, none)["uncertainty"], v["uncertainty"]))
                        for k, v in r2["resources"].items()}
    return out


def hub_depth(model: Any) -> int | None:
    """Blocks of an ``hf:<id>`` model deep enough to extrapolate (None otherwise: traced whole)."""
    if not (isinstance(model, str) and model.startswith("hf:")):
        return None
    cfg = hub_config(model[3:])
    depth = next((getattr(cfg, k) for k in _DEPTH_KEYS if isinstance(getattr(cfg, k, None), int)), None)
    return depth if depth and depth > DEEP else None


def by_depth(estimate: Callable[..., dict], model: str, depth: int, **kw: Any) -> dict[str, Any]:
    """``estimate(model, **kw)`` of a deep ``hf:<id>`` model from its config at depth 1 and 2; the
    parameter count is the full model's (built on the meta device: shapes only)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hub_config(model[3:])
    key = next(k for k in _DEPTH_KEYS if isinstance(getattr(cfg, k, None), int))

    def at(n: int) -> dict[str, Any]:
        c = copy.deepcopy(cfg)
        setattr(c, key, n)
        build = lambda: AutoModelForCausalLM.from_config(c)  # noqa: E731
        build.__name__ = model
        return estimate(build, **kw)

    r1, r2 = at(1), at(2)
    out = extrapolate(r1, r2, depth)
    with torch.device("meta"):
        n = count_params(AutoModelForCausalLM.from_config(cfg))
    out["model"] = model
    out["notes"] = list(r2["notes"]) + [f"depth: traced at 1 and 2 of {depth} blocks, extrapolated (every block is "
                                        f"the same: each phase's bytes are affine in depth); {n / 1e9:.1f} B parameters"]
    if out["params"] != n:  # the affine count is exact for identical blocks: a check, not a correction
        out["notes"].append(f"extrapolated parameter count {out['params']} differs from the model's {n}")
    return out

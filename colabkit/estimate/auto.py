"""``plan="auto"``: the plan with the highest predicted tokens/s among those predicted to fit with margin.

:func:`choose` ranks the planner's candidates (:func:`~colabkit.estimate.planner.plans`) whose verdict is
``fits`` (the device need plus its uncertainty within the budget; ``tight`` ones only when nothing fits
with margin) by the predicted tokens/s of :mod:`.speed`, and says why: the runner-up and what it would
cost. :func:`train_auto` is what ``train(..., plan="auto")`` runs (registered with
:func:`colabkit.train.register_auto`): the chosen plan with ``on_oom="shrink"``, and on an out-of-memory
that shrinking cannot cure, the next plan.

>>> choose("gpt-tiny", 2, 16, device="cpu", candidates=["baseline", "checkpoint"])["plan"]
'baseline'
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..env import profile_for
from ..memory import fmt_bytes
from ..oom import is_oom
from ..plan import PlanError
from ..train import register_auto, train
from ..trainer import register_auto_plan
from .inputs import module_factory
from .planner import plans


def choose(model: Any, batch: int, seq: int, gpu: str | None = "t4", device: str | None = None,
           candidates: Iterable[str] | None = None, budget_bytes: int | None = None,
           inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fastest predicted plan that fits: ``{"plan", "why", "ranked", "rows"}`` (``ranked``: the plans
    that fit, fastest first -- the order :func:`train_auto` falls back through). ``model``: a name, a
    function that builds it, or the built module (estimated on a copy of its shapes); ``inputs``: its batch
    described as :func:`~colabkit.estimate.estimate` takes it."""
    if isinstance(model, torch.nn.Module):  # one shapes-only copy per estimate, never the weights
        model = module_factory(model)
    rows = [r for r in plans(model, batch, seq, gpu, device, candidates, budget_bytes, inputs) if not r.get("error")]
    ok = [r for r in rows if r.get("verdict", "fits" if r["fits"] else "") == "fits"] or [r for r in rows if r["fits"]]
    if not ok:
        raise PlanError(f"plan='auto': no candidate plan is predicted to fit {getattr(model, '__name__', model)} at "
                        f"batch {batch} x seq {seq} "
                        f"on {gpu or device}: try a smaller batch or sequence (python -m colabkit plan lists them)")
    ok.sort(key=lambda r: -r["tokens_per_s"])
    best = ok[0]
    why = (f"auto: {best['plan']}: predicted {best['tokens_per_s']:,.0f} tokens/s, {best['step_time_s']:.3g} s/step, "
           f"peak {fmt_bytes(best['peak_bytes'])} ({best.get('verdict', 'fits')})")
    if len(ok) > 1:
        nxt = ok[1]
        why += (f"; runner-up {nxt['plan']}: {nxt['tokens_per_s']:,.0f} tokens/s "
                f"({1 - nxt['tokens_per_s'] / best['tokens_per_s']:.0%} slower), peak {fmt_bytes(nxt['peak_bytes'])}")
    return {"plan": best["plan"], "why": why, "ranked": [r["plan"] for r in ok], "rows": ok}


def _choose(model: Any, *a: Any, **kw: Any) -> dict[str, Any]:
    """:func:`choose`; a built module is estimated as the estimator estimates one (``estimate(module)``), and
    where it cannot be, the error says what to pass instead."""
    try:
        return choose(model, *a, **kw)
    except PlanError:
        raise
    except Exception as e:  # noqa: BLE001  (the estimator could not take this module)
        if not isinstance(model, torch.nn.Module):
            raise
        raise PlanError(f"plan='auto' could not estimate this built {type(model).__name__} ({type(e).__name__}: {e}): "
                        "pass its name (e.g. 'gpt2-124m') or a function that builds it") from e


def train_auto(model: Any, **kw: Any) -> dict[str, Any]:
    """``train(model, plan="auto", **kw)``: :func:`choose` for this run's model (a name, a function that
    builds it, or the built module), batch, sequence, GPU and ``budget_bytes``, then the chosen plan with
    ``on_oom="shrink"``; an out-of-memory that remains moves on to the next plan."""
    dev = torch.device(kw.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = (profile_for(torch.cuda.get_device_name(dev)) or "t4") if dev.type == "cuda" else None
    choice = _choose(model, kw.get("batch", 8), kw.get("seq", 128), gpu=gpu, device=None if gpu else "cpu",
                     budget_bytes=kw.get("budget_bytes"))  # the run's budget
    print(f"colabkit: {choice['why']}")
    return run_ranked(model, choice, **kw)


def run_ranked(model: Any, choice: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Train with ``choice["ranked"]``'s plans in turn until one runs without an out-of-memory."""
    kw["on_oom"] = "shrink"
    built = isinstance(model, (str, torch.nn.Module)) or not callable(model)
    for i, p in enumerate(choice["ranked"]):
        try:
            out = train(model if built else model(), plan=p, **kw)  # train takes a name or a module
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err) or i + 1 == len(choice["ranked"]):
                raise
            print(f"colabkit: auto: {p} ran out of memory even after shrinking; next: {choice['ranked'][i + 1]}")
            continue
        out.update(plan=p, auto=choice["why"])
        return out
    raise PlanError("plan='auto': no candidate plan")  # unreachable: choose() returns at least one


def auto_plan(model: Any, device: Any = None, model_name: str | None = None, batch: int = 8, seq: int = 128,
              budget_bytes: int | None = None) -> str:
    """What ``Trainer(model, "auto")`` trains with: :func:`choose` for ``model`` (a name, a factory or a module) on
    this device, for ``batch`` x ``seq`` (the Trainer sees no batch before its first step: it says which it assumed)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = (profile_for(torch.cuda.get_device_name(dev)) or "t4") if dev.type == "cuda" else None
    choice = _choose(model_name or model, batch, seq, gpu=gpu, device=None if gpu else "cpu", budget_bytes=budget_bytes)
    print(f"colabkit: {choice['why']} (chosen for batch {batch} x seq {seq}: for your sizes use "
          f"colabkit.choose_plan(model, batch, seq) or train(..., plan='auto', batch=..., seq=...))")
    return choice["plan"]


register_auto(train_auto)
register_auto_plan(auto_plan)

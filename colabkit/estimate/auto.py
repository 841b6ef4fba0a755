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

import contextlib
from collections.abc import Mapping
from typing import Any, Iterable

import torch

from ..checkpoints import saved_plan
from ..env import profile_for
from ..feed import _is_corpus, feed
from ..memory import fmt_bytes
from ..oom import AUTO_CHOICE, is_oom
from ..plan import PlanError
from ..train import register_auto, train
from ..trainer import register_auto_plan
from .inputs import batch_shape, module_factory
from .planner import plans


def choose(model: Any, batch: int = 8, seq: int = 128, gpu: str | None = "t4", device: str | None = None,
           candidates: Iterable[str] | None = None, budget_bytes: int | None = None,
           inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fastest predicted plan that fits: ``{"plan", "why", "ranked", "rows"}`` (``ranked``: the plans
    that fit, fastest first -- the order :func:`train_auto` falls back through). ``model``: a name, a
    function that builds it, or the built module (estimated on a copy of its shapes); ``inputs``: its batch
    described as :func:`~colabkit.estimate.estimate` takes it (``batch`` and ``seq`` are then read from it)."""
    if inputs is not None:
        batch, seq = batch_shape(inputs)
    if isinstance(model, torch.nn.Module):  # one shapes-only copy per estimate, never the weights
        model = module_factory(model)
    every = plans(model, batch, seq, gpu, device, candidates, budget_bytes, inputs)
    rows = [r for r in every if not r.get("error")]
    ok = [r for r in rows if r.get("verdict", "fits" if r["fits"] else "") == "fits"] or [r for r in rows if r["fits"]]
    if every and not rows:  # nothing could be estimated (e.g. a batch key the model does not take): say why
        raise PlanError(f"plan='auto' could not estimate any plan: {every[0]['error']}")
    if not ok:
        name, where = getattr(model, "__name__", model), f"a {device} run" if device else gpu
        weights = min(r["breakdown"]["params"] for r in rows) if rows else 0
        if rows and weights > rows[0]["budget_bytes"]:  # no batch or sequence can help: say so
            raise PlanError(f"plan='auto': {name}'s weights alone take {fmt_bytes(weights)} in every candidate plan, "
                            f"more than the budget ({fmt_bytes(rows[0]['budget_bytes'])}) on {where}: no batch or "
                            "sequence fits -- use a smaller model, or lora:R / qlora:R (a frozen 16- or 4-bit base)")
        raise PlanError(f"plan='auto': no candidate plan is predicted to fit {name} at batch {batch} x seq {seq} "
                        f"on {where}: try a smaller batch or sequence (python -m colabkit plan lists them)")
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
                        "auto estimates (batch, seq) token ids unless told what the model takes -- describe its batch: "
                        "plan = colabkit.choose_plan(model, inputs={'pixel_values': ((B, 3, H, W), torch.float32), "
                        "'labels': ((B,), torch.long)})['plan'], then give that plan (colabkit.train(model, data=...) "
                        "with plan='auto' reads the inputs from your data's first batch)") from e


def train_auto(model: Any, **kw: Any) -> dict[str, Any]:
    """``train(model, plan="auto", **kw)``: :func:`choose` for this run's model (a name, a function that
    builds it, or the built module), batch, sequence, GPU and ``budget_bytes``, then the chosen plan with
    ``on_oom="shrink"``; an out-of-memory that remains moves on to the next plan."""
    dev = torch.device(kw.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = (profile_for(torch.cuda.get_device_name(dev)) or "t4") if dev.type == "cuda" else None
    ck = kw.get("checkpointing")
    folder, resume = (ck.dir, ck.resume) if ck is not None else (kw.get("checkpoint_dir"), kw.get("resume"))
    if resume and folder and (p := saved_plan(folder)) is not None:  # a resumed run keeps the plan it started with
        print(f"colabkit: auto: resuming {folder} with its plan {p} (chosen when the run started)")
        return run_ranked(model, {"plan": p, "why": f"auto: {p}, resumed from {folder}", "ranked": [p]}, **kw)
    batch, seq, inputs = _first_batch(model, kw)
    choice = _choose(model, batch, seq, gpu=gpu, device=None if gpu else "cpu",
                     budget_bytes=kw.get("budget_bytes"), inputs=inputs)  # the run's budget, its first batch
    print(f"colabkit: {choice['why']}")
    return run_ranked(model, choice, **kw)


def _first_batch(model: Any, kw: dict[str, Any]) -> tuple[int, int, dict[str, torch.Tensor] | None]:
    """The (batch, seq) the run will step on, and for your own data its first batch as ``inputs=`` (a function
    or a module is called with the batch's keys; a name builds its own ids from (batch, seq))."""
    batch, seq, data = kw.get("batch", 8), kw.get("seq", 128), kw.get("data")
    if data is None or _is_corpus(data):  # colabkit's text windows: batch x seq as asked
        return batch, seq, None
    b = feed(data, batch, seq, kw.get("seed", 0)).batch(0)
    try:  # a batch dict's tensors (or nested lists of numbers), or (x, y)
        tensors = {k: torch.as_tensor(v) for k, v in b.items() if isinstance(v, (torch.Tensor, list, tuple))} \
            if isinstance(b, Mapping) else None
        x = tensors.get("input_ids", next(iter(tensors.values()), None)) if tensors is not None else torch.as_tensor(b[0])
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError):  # not numbers: train() itself will say so
        return batch, seq, None
    if x is None or x.ndim == 0:
        return batch, seq, None
    batch, seq = x.shape[0], x.shape[1] if x.ndim == 2 else seq  # ids (B, S); images (B, C, H, W): seq unused
    return batch, seq, tensors if tensors and not isinstance(model, str) else None


@contextlib.contextmanager
def _planned(why: str):
    token = AUTO_CHOICE.set(why)
    try:
        yield
    finally:
        AUTO_CHOICE.reset(token)


def run_ranked(model: Any, choice: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Train with ``choice["ranked"]``'s plans in turn until one runs without an out-of-memory."""
    kw["on_oom"] = "shrink"
    for i, p in enumerate(choice["ranked"]):
        try:
            # a function is given as it is: train builds it after seeding, as with the plan named (built here, it
            # took the RNG as the estimate left it: other initial weights than the chosen plan's own run)
            with _planned(choice["why"]):  # a memory alert's advice knows the plan was the planner's own
                out = train(model, plan=p, **kw)
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

"""The selftest's technique checks: each runs a technique and holds its answer against a reference answer.

A reference is never the technique run twice: the same seed without the technique on the same device (plain
AdamW, the whole batch at once, the full logits, torch's default attention), torch's own ``AdamW`` on the same
gradients, bitsandbytes' 8-bit step against colabkit's own 8-bit kernel, a plain torch loop for transformers'
Trainer, the predicted step time for the measured one. Updates are compared as ``max |Δw - Δw_ref| /
max |Δw_ref|`` (``Δw``: the weights' change over the steps), so a technique whose update is 1% off fails
(:data:`UPDATE_TOL`), not only one that crashes. On CUDA the side stream sleeps before its copies
(:meth:`~colabkit.device.DevicePair.widened_races`) and the no-sync paths run under the sync-debug mode
"error" (:meth:`~colabkit.device.DevicePair.sync_debug`); both calls live in the seam, :mod:`colabkit.device`.

>>> r = check_fused_step(torch.device("cpu"), {"model": "gpt:2x32", "batch": 2, "seq": 16, "steps": 2})
>>> r["ok"], r["reference"]
(True, 'baseline (AdamW after backward), same seed and device')
"""
from __future__ import annotations

import contextlib
import importlib.util
import tempfile
import types
from typing import Any, Callable, Iterator

import torch

from .data import TextData
from .determinism import deterministic, seed_all
from .device import pair_of
from .env import profile_for
from .estimate.speed import fit_host, measure_host, predict_step_time
from .hf import prepare_model, training_arguments
from .memory import fmt_bytes
from .models import build_model
from .plan import PlanError
from .techniques.optimizers import MIN_QUANT_SIZE, AdamW8bit
from .timing import time_fn
from .trainer import Trainer

UPDATE_TOL = 5e-3  # update rel. diff allowed where the technique computes the same step (CPU noise: ~1.5e-3 at most)
LOSS_TOL = 1e-5  # loss rel. diff allowed there
# 4-/8-bit moments read back after the first step: ||Δw - Δw_ref|| / ||Δw_ref|| allowed (L2 over all weights) after
# 2 steps; measured on gpt:2x32 (CPU, 2026-11-27): adamw4bit vs AdamW 0.094, bitsandbytes vs colabkit 8-bit 0.020;
# about twice that allowed (the full size on a GPU: not yet measured)
QUANT_TOL = {"4bit": 0.2, "8bit": 0.05}


class Skipped(Exception):
    """A check that cannot run here (the reason is the message)."""


def _trained(plan: str, dev: torch.device, size: dict, steps: int | None = None,
             around: Callable[[Trainer], Any] | None = None,
             reversed_rows: bool = False) -> tuple[list[float], Trainer, list[torch.Tensor]]:
    """``steps`` optimizer steps of ``plan`` on a fresh model (seed 0); offload simulated off CUDA. Returns the
    losses, the Trainer and the weights before the first step; ``around(trainer)`` is a context for the steps.
    ``reversed_rows``: each batch's rows in reverse order (the same step up to rounding: :func:`noise_floor`)."""
    torch.manual_seed(0)
    try:
        t = Trainer(build_model(size["model"], seq=size["seq"]), plan, device=dev, offload_sim=dev.type != "cuda")
    except PlanError as e:  # refused on this device (e.g. attention:flash on a CPU or a T4): said, not failed
        raise Skipped(f"skipped: {plan} refused here: {e}") from e
    start = [p.detach().float().cpu().clone() for p in t.model.parameters()]
    data = TextData()
    with (around(t) if around else contextlib.nullcontext()):
        losses = [t.step(*[b.flip(0) if reversed_rows else b
                           for b in data.batch(size["batch"], size["seq"], step=i, device=dev)])
                  for i in range(steps or size["steps"])]
    return losses, t, start


def update_diff(a: tuple, b: tuple) -> float:
    """``max |Δa - Δb| / max |Δb|`` over all weights, Δ the change since the start (``_trained``'s result)."""
    da = [p.detach().float().cpu() - s for p, s in zip(a[1].model.parameters(), a[2])]
    db = [p.detach().float().cpu() - s for p, s in zip(b[1].model.parameters(), b[2])]
    num = max((x - y).abs().max().item() for x, y in zip(da, db))
    return num / max(max(y.abs().max().item() for y in db), 1e-30)


def _l2(da: list[torch.Tensor], db: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.flatten() for t in da]), torch.cat([t.flatten() for t in db])
    return ((x - y).norm() / y.norm().clamp(min=1e-30)).item()


def update_l2(a: tuple, b: tuple) -> float:
    """``||Δa - Δb|| / ||Δb||`` over all weights (quantized state: a few elements of a block may move apart)."""
    return _l2([p.detach().float().cpu() - s for p, s in zip(a[1].model.parameters(), a[2])],
               [p.detach().float().cpu() - s for p, s in zip(b[1].model.parameters(), b[2])])


def loss_diff(a: tuple, b: tuple) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a[0], b[0]))


FLOOR_FACTOR = 4  # an update may differ from its reference by this many times the reference's own noise floor
_FLOORS: dict[tuple, float] = {}


def noise_floor(reference: str, dev: torch.device, size: dict, ref: tuple | None = None) -> float:
    """How far :func:`update_diff` moves when nothing but rounding changes: ``reference`` trained on the same
    batches with their rows reversed, against ``reference`` itself (cached per reference, device and size).

    Adam's first steps are close to ``lr * sign(g)``, so an element whose gradient is near zero flips with
    the last bits of its gradient. On a CPU both orders round alike (floor ~1e-4); on CUDA another kernel
    (math against fused attention, chunked cross-entropy, deterministic algorithms) rounds differently, and an
    H200 showed 1-3e-2 for steps that are the same mathematically (2026-11-27), above the CPU's
    :data:`UPDATE_TOL`. A wrong step (a lost gradient, a missed unscale) moves it by O(1)."""
    key = (reference, str(dev), tuple(sorted(size.items())))
    if key not in _FLOORS:
        _FLOORS[key] = update_diff(_trained(reference, dev, size, reversed_rows=True),
                                   ref or _trained(reference, dev, size))
    return _FLOORS[key]


def update_tol(reference: str, dev: torch.device, size: dict, ref: tuple | None = None,
               base: float = UPDATE_TOL) -> tuple[float, float]:
    """(tolerance, floor): ``max(base, FLOOR_FACTOR * noise_floor)``."""
    floor = noise_floor(reference, dev, size, ref)
    return max(base, FLOOR_FACTOR * floor), floor


def with_sgd(plan: str) -> str:
    """``plan`` stepped by plain SGD. >>> with_sgd("baseline"), with_sgd("fp16+chunked-ce")
    ('sgd', 'fp16+chunked-ce+sgd')"""
    return "sgd" if plan == "baseline" else f"{plan}+sgd"


def _same_step(plan: str, reference: str = "baseline", what: str | None = None,
               around: Callable[[Trainer], Any] | None = None, need_pinned: bool = False,
               sgd: bool = False) -> Callable:
    """A check: ``plan`` against ``reference`` (same seed, same device): the same update and losses.

    ``sgd=True`` for a technique that changes the gradient's path, not the optimizer (chunked cross-entropy,
    an attention kernel, accumulation on the host): both step with plain SGD, whose update is the gradient
    times lr, so rounding stays rounding. AdamW's first steps are close to ``lr * sign(g)`` and magnify any
    difference in a near-zero gradient: on an H200 (2026-11-27) another attention kernel moved its update by
    1.9e-2 in fp32 and by 1.3 (max-norm) in fp16, as much as a wrong gradient does."""
    if sgd:
        plan, reference = with_sgd(plan), with_sgd(reference)
        what = f"{what or reference} (both with SGD: the gradients' path)"

    def check(dev: torch.device, size: dict) -> dict:
        ref = _trained(reference, dev, size)
        got = _trained(plan, dev, size, around=around)
        du, dl = update_diff(got, ref), loss_diff(got, ref)
        tol, floor = update_tol(reference, dev, size, ref)
        stats = pair_of(got[1].model, got[1].ctx.device).stats() if need_pinned else {}
        pinned = stats.get("pinned_peak_bytes", 0)
        ok = du <= tol and dl <= LOSS_TOL and not stats.get("poisoned") and (pinned > 0 or not need_pinned)
        return {"ok": ok, "reference": what or f"{reference}, same seed and device",
                "detail": f"update vs reference: rel. diff {du:.1e} (<= {tol:.2g}; rows reversed: {floor:.1e}), "
                          f"loss rel. diff {dl:.1e} "
                          f"(<= {LOSS_TOL:g})" + (f"; pinned host peak {fmt_bytes(pinned)} (> 0)" if need_pinned else "")}
    return check


# ----- on CUDA: race windows widened, no-sync paths under the sync-debug mode "error" ----------------------
@contextlib.contextmanager
def _raced(t: Trainer) -> Iterator[None]:
    with pair_of(t.model, t.ctx.device).widened_races():
        yield


@contextlib.contextmanager
def _no_sync_step(t: Trainer) -> Iterator[None]:
    """The optimizer's step (chunk by chunk, no host read of a device value) under the sync-debug mode "error";
    under ``fused-step`` the wrapped optimizer's, which each parameter's hook runs inside backward."""
    opt = getattr(t.optimizer, "optimizer", t.optimizer)  # fused-step and offload wrap the plan's optimizer
    pair, step = pair_of(t.model, t.ctx.device), opt.step

    def checked(*a: Any, **kw: Any) -> Any:
        with pair.sync_debug("error"):
            return step(*a, **kw)
    opt.step = checked
    try:
        yield
    finally:
        del opt.step


def check_fp16_offload(dev: torch.device, size: dict) -> dict:
    """fp16 with gradients in host memory: the same as fp16 on the device, and an overflow (scale 2^40)
    skips the step (weights unchanged, optimizer state finite) and halves the scale."""
    plan = "fp16+offload:optimizer"
    # the update with SGD (its step scales with the gradient: a missed or doubled unscale shows in full; AdamW's step
    # hardly depends on the gradient's scale)
    ref, got = _trained("fp16+sgd", dev, size), _trained("fp16+offload:optimizer+sgd", dev, size, around=_raced)
    du = update_diff(got, ref)
    tol, floor = update_tol("fp16+sgd", dev, size, ref, base=2e-2)
    torch.manual_seed(0)
    t = Trainer(build_model(size["model"], seq=size["seq"]), plan, device=dev, offload_sim=dev.type != "cuda")
    state = t.scaler.state_dict()  # the scaler the Trainer built (host unscaling included), started far too high
    state["scale"] = 2.0**40
    t.scaler.load_state_dict(state)
    before = [p.detach().clone() for p in t.model.parameters()]
    scales = []
    for i in range(2):
        scales.append(t.scaler.get_scale() if i else 2.0**40)
        t.step(*TextData().batch(size["batch"], size["seq"], step=i, device=dev))
    scales.append(t.scaler.get_scale())
    same = all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    finite = all(torch.isfinite(v).all().item() for s in t.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.is_floating_point())
    halved = scales == [2.0**40, 2.0**39, 2.0**38]
    ok = du <= tol and same and finite and halved
    return {"ok": ok, "reference": "fp16 without offload (both with SGD), same seed and device; overflow: weights as "
                                   "before, scale / 2",
            "detail": f"update vs fp16: rel. diff {du:.1e} (<= {tol:.2g}; rows reversed: {floor:.1e}); scale 2^40 "
                      f"injected: steps skipped, weights "
                      f"unchanged: {same}, scale {' -> '.join(f'{s:g}' for s in scales)} "
                      f"(halved each step: {halved}), optimizer state finite: {finite}"}


def check_adamw4bit(dev: torch.device, size: dict) -> dict:
    """adamw4bit: the first step is AdamW's exactly (moments quantized after use), the second within
    :data:`QUANT_TOL` of AdamW's (moments read back from 4 bits); on CUDA the step runs with no device sync."""
    one = update_diff(_trained("adamw4bit", dev, size, steps=1), _trained("baseline", dev, size, steps=1))
    two = update_l2(_trained("adamw4bit", dev, size, around=_no_sync_step), _trained("baseline", dev, size))
    tol = QUANT_TOL["4bit"]
    return {"ok": one <= UPDATE_TOL and two <= tol, "reference": "torch AdamW (baseline), same seed and device",
            "detail": f"step 1 update rel. diff {one:.1e} (<= {UPDATE_TOL:g}); {size['steps']} steps: L2 rel. diff {two:.2g} "
                      f"(<= {tol:g})" + ("; optimizer step under sync debug 'error'" if dev.type == "cuda" else "")}


def _grads(dev: torch.device, size: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(size["model"], seq=size["seq"]).to(dev)
    x, y = TextData().batch(size["batch"], size["seq"], step=0, device=dev)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return [p.detach().clone() for p in model.parameters()], [p.grad.detach().clone() for p in model.parameters()]


def _stepped(make: Callable, params: list[torch.Tensor], grads: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make(ps)
    for _ in range(steps):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().float().cpu() for p in ps]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor], l2: bool = False) -> float:
    """The update of ``a`` against that of ``b`` (both from ``start``): max-norm relative, or L2 relative."""
    s = [x.float().cpu() for x in start]
    da, db = [x - s0 for x, s0 in zip(a, s)], [y - s0 for y, s0 in zip(b, s)]
    if l2:
        return _l2(da, db)
    return max((x - y).abs().max().item() for x, y in zip(da, db)) / max(max(y.abs().max().item() for y in db), 1e-30)


def check_adamw8bit_kernels(dev: torch.device, size: dict) -> dict:
    """bitsandbytes' AdamW8bit (the adamw8bit token's optimizer on CUDA) against colabkit's own 8-bit kernel
    and torch's AdamW, on the same gradients: the first step AdamW's, then the two within :data:`QUANT_TOL`."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skipped("skipped: bitsandbytes is not installed (pip install bitsandbytes)")
    import bitsandbytes as bnb

    params, grads = _grads(dev, size)
    kw = {"lr": 1e-3, "weight_decay": 0.0}
    makers = {"bnb": lambda ps: bnb.optim.AdamW8bit(ps, min_8bit_size=MIN_QUANT_SIZE, **kw),
              "colabkit": lambda ps: AdamW8bit(ps, min_8bit_size=MIN_QUANT_SIZE, **kw),
              "torch": lambda ps: torch.optim.AdamW(ps, **kw)}
    one = {k: _stepped(m, params, grads, 1) for k, m in makers.items()}
    two = {k: _stepped(m, params, grads, size["steps"]) for k, m in makers.items()}
    d1 = max(_rel(one["bnb"], one["torch"], params), _rel(one["colabkit"], one["torch"], params))
    d2, tol = _rel(two["bnb"], two["colabkit"], params, l2=True), QUANT_TOL["8bit"]
    return {"ok": d1 <= UPDATE_TOL and d2 <= tol,
            "reference": "colabkit's AdamW8bit kernel and torch AdamW, same gradients",
            "detail": f"step 1: bitsandbytes and colabkit vs torch AdamW rel. diff {d1:.1e} (<= {UPDATE_TOL:g}); "
                      f"{size['steps']} steps: bitsandbytes vs colabkit L2 rel. diff {d2:.2g} (<= {tol:g}) "
                      f"(bitsandbytes {bnb.__version__}, {'CUDA' if dev.type == 'cuda' else 'CPU'} kernels)"}


def _tiny_llama(vocab: int = 128) -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def _qlora_hub_model(dev: torch.device) -> torch.nn.Module:
    """A tiny Llama as a 4-bit hub load leaves it (``is_quantized``, a bitsandbytes ``hf_quantizer``), then
    ``prepare_model(model, "qlora:4")``: NF4 base, LoRA adapters (seed 0)."""
    import types

    torch.manual_seed(0)
    model = _tiny_llama()
    model.is_quantized = True
    model.hf_quantizer = types.SimpleNamespace(is_trainable=True, is_qat_trainable=False,
                                               quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
    return prepare_model(model, "qlora:4", device=dev)


def check_hf_qlora(dev: torch.device, size: dict) -> dict:
    """transformers' Trainer on a prepared QLoRA model: it builds (issue 34, item 2) and its two steps move
    the adapters as a plain torch loop (same batch, AdamW, constant lr, no clipping) moves them."""
    for lib in ("bitsandbytes", "transformers", "peft"):
        if importlib.util.find_spec(lib) is None:
            raise Skipped(f"skipped: {lib} is not installed (pip install {lib})")
    import transformers


    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, 128, (size["seq"],), generator=g)), "labels": ids.clone()}
            for _ in range(size["batch"])]
    batch = {k: torch.stack([r[k] for r in rows]).to(dev) for k in rows[0]}
    lr, steps = 1e-3, size["steps"]

    ref = _qlora_hub_model(dev)  # the reference: a plain loop on the same prepared model
    trainable = [p for p in ref.parameters() if p.requires_grad]
    start = [p.detach().float().cpu().clone() for p in trainable]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        ref(**batch).loss.backward()
        opt.step()
        opt.zero_grad()

    model = _qlora_hub_model(dev)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with tempfile.TemporaryDirectory() as out:
        args = training_arguments("qlora:4", output_dir=out, per_device_train_batch_size=size["batch"], max_steps=steps,
                                  learning_rate=lr, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                                  warmup_steps=0, report_to="none", save_strategy="no", disable_tqdm=True,
                                  use_cpu=dev.type != "cuda", seed=0, logging_steps=1)
        hft = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   data_collator=lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]})
        hft.remove_callback(transformers.PrinterCallback)  # the report says what ran; no log dicts printed
        hft.train()
    got = [p.detach().float().cpu() for p in model.parameters() if p.requires_grad]
    du = _rel(got, [p.detach().float().cpu() for p in trainable], start)
    now = dict(model.named_parameters())
    base_same = all(torch.equal(v, now[n]) for n, v in frozen.items())
    return {"ok": du <= UPDATE_TOL and base_same and len(got) > 0,
            "reference": "a plain torch loop (AdamW, same batch) on the same prepared model",
            "detail": f"transformers.Trainer built and ran {steps} steps; adapters' update vs the plain loop: rel. diff "
                      f"{du:.1e} (<= {UPDATE_TOL:g}), {len(got)} adapter tensors, 4-bit base unchanged: {base_same}"}


def check_deterministic(dev: torch.device, size: dict) -> dict:
    """--deterministic: two runs with one seed give the same bytes; and the same step as without it."""
    def run() -> tuple:
        seed_all(0)
        with deterministic():
            return _trained("sgd", dev, size)

    # SGD: other kernels round differently, and AdamW's sign-like first step would magnify it (see _same_step)
    a, b, free = run(), run(), _trained("sgd", dev, size)
    same = all(torch.equal(p, q) for p, q in zip(a[1].model.parameters(), b[1].model.parameters())) and a[0] == b[0]
    du = update_diff(a, free)
    tol, floor = update_tol("sgd", dev, size, free)
    return {"ok": same and du <= tol, "reference": "the first deterministic run (bytes); the run without it (update, "
                                                   "both with SGD)",
            "detail": f"second run bit-identical: {same}; update vs non-deterministic run rel. diff {du:.1e} "
                      f"(<= {tol:.2g}; rows reversed: {floor:.1e})"}


STEP_TIME_RATIO = {"cuda": (1 / 3, 3.0),  # measured / predicted allowed: the prediction's uncertainty, widened
                   "cpu": (0.1, 10.0)}  # a CPU shared with other processes: only a gross error fails


def check_step_time(dev: torch.device, size: dict) -> dict:
    """Measured step time (untracked, warmed up, median of 5: :func:`~colabkit.timing.time_fn`) next to
    :func:`~colabkit.estimate.speed.predict_step_time` for this device, within :data:`STEP_TIME_RATIO`."""
    gpu = profile_for(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    if dev.type == "cuda" and gpu is None:  # another GPU's figures would say nothing about this one
        raise Skipped(f"skipped: no GPU profile for {torch.cuda.get_device_name(dev)} (its throughput is unknown)")
    _, t, _ = _trained("baseline", dev, size, steps=1)
    batch = TextData().batch(size["batch"], size["seq"], step=0, device=dev)
    got = time_fn(lambda: t.step(*batch), warmup=2, repeats=5, device=dev).median
    # on a GPU the host's part is measured first (two tiny models' steps, not this one: fit_host), as calibrate does
    host = fit_host(measure_host(dev)) if dev.type == "cuda" else None
    pred = float(predict_step_time(size["model"], "baseline", size["batch"], size["seq"], gpu=gpu,
                                   calibration={"speed": host} if host else False)["step_time_s"])
    ratio, (lo, hi) = got / pred, STEP_TIME_RATIO["cuda" if dev.type == "cuda" else "cpu"]
    line = (f"; host measured: {host['step_overhead_s'] * 1e3:.2f} ms a step + {host['launch_s'] * 1e6:.1f} us a "
            f"kernel" if host else "")
    return {"ok": lo <= ratio <= hi, "reference": f"predicted step time ({gpu or 'this CPU'})", "measured_s": got,
            "predicted_s": pred, "detail": f"measured {got * 1e3:.2f} ms/step, predicted {pred * 1e3:.2f} ms: "
                                           f"{ratio:.2f}x (allowed {lo:.2g}-{hi:g}x){line}"}


def check_attention_cuda_only(backend: str, with_checkpoint: bool) -> Callable:
    """``attention:<backend>`` (+checkpoint) against torch's default attention; flash under fp16 (its kernels
    take fp16/bf16 only), against fp16."""
    half = "fp16+" if backend == "flash" else ""
    ref = half + ("checkpoint" if with_checkpoint else "baseline")
    plan = f"{half}attention:{backend}" + ("+checkpoint" if with_checkpoint else "")
    ref = ref.replace("fp16+baseline", "fp16")
    inner = _same_step(plan, ref, f"{ref} (torch's default attention), same seed and device", sgd=True)

    def check(dev: torch.device, size: dict) -> dict:
        if dev.type != "cuda":
            raise Skipped("skipped: needs CUDA (on a CPU only attention:math can be forced)")
        return inner(dev, size)
    return check


def check_8bit_sides(plan: str) -> Callable:
    """``plan`` (fused-step or offload:params with adamw8bit) against adamw8bit alone. Off CUDA both are colabkit's
    8-bit kernel (the same update); on CUDA the plan may run colabkit's kernel where the reference runs
    bitsandbytes' (issue 34, item 5): then within :data:`QUANT_TOL` (L2)."""
    around = _no_sync_step if plan.startswith("fused-step") else None  # per parameter inside backward: no sync
    exact = _same_step(plan, "adamw8bit", "adamw8bit (after backward, on the device), same seed and device", around)

    def check(dev: torch.device, size: dict) -> dict:
        if dev.type != "cuda":
            return exact(dev, size)
        du, tol = update_l2(_trained(plan, dev, size, around=around), _trained("adamw8bit", dev, size)), QUANT_TOL["8bit"]
        return {"ok": du <= tol, "reference": "adamw8bit (bitsandbytes, after backward), same seed and device",
                "detail": f"update vs reference: L2 rel. diff {du:.2g} (<= {tol:g})"
                          + ("; each parameter's step under sync debug 'error'" if around else "")}
    return check


def check_fused_step(dev: torch.device, size: dict) -> dict:
    return _same_step("fused-step", what="baseline (AdamW after backward), same seed and device")(dev, size)


CHECKS: dict[str, Callable[[torch.device, dict], dict]] = {
    "fp16 + offload:optimizer (overflow injected)": check_fp16_offload,
    "offload:disk": _same_step("offload:disk", what="baseline (AdamW in device memory), same seed and device"),
    "accum:2 + offload:optimizer": _same_step("accum:2+offload:optimizer", around=_raced, need_pinned=True, sgd=True,
                                              what="baseline on the whole batch at once, same seed and device"),
    "chunked-ce": _same_step("chunked-ce", what="baseline (full logits), same seed and device", sgd=True),
    "fused-step": check_fused_step,
    "fused-step + adamw8bit": check_8bit_sides("fused-step+adamw8bit"),
    "offload:params + adamw8bit": check_8bit_sides("offload:params+adamw8bit"),
    "adamw4bit": check_adamw4bit,
    "adamw8bit: bitsandbytes vs colabkit kernel": check_adamw8bit_kernels,
    "attention:math": _same_step("attention:math", what="baseline (torch's default attention), same seed and device",
                                 sgd=True),
    "attention:math + checkpoint": _same_step("attention:math+checkpoint", "checkpoint",
                                              "checkpoint (torch's default attention), same seed and device", sgd=True),
    **{f"attention:{b}{' + checkpoint' if c else ''}": check_attention_cuda_only(b, c)
       for b in ("efficient", "flash") for c in (False, True)},
    "HF Trainer + qlora:4": check_hf_qlora,
    "--deterministic": check_deterministic,
    "step time vs prediction": check_step_time,
}

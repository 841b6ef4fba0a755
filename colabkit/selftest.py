"""``python -m colabkit selftest``: the GPU paths run for real, or their CPU twin, in a report to attach to an issue.

On a GPU every check runs the CUDA-only code: offload with its side stream, events and pinned host memory
(``offload:optimizer``, ``offload:activations``, ``offload:params``, each against the plain run), a QLoRA
model built and stepped with bitsandbytes' 4-bit kernels, fp16 with the GradScaler (its overflow skips
included), ``paged-adamw8bit`` against ``adamw8bit`` (same update: paging only moves state under pressure),
each technique's measured peak next to :func:`colabkit.estimate`'s prediction, and :func:`colabkit.calibrate`;
then the technique checks of :mod:`colabkit.selftest_checks` (fp16 with host gradients and an injected overflow,
``offload:disk``, accumulation with offload, ``chunked-ce``, ``fused-step``, the 8-/4-bit optimizers,
``attention:*`` alone and with ``checkpoint``, transformers' Trainer on a QLoRA model, ``--deterministic``, the
step time against its prediction), each against a reference answer (a wrong number fails, not only a crash),
with the side stream's race windows widened and the no-sync paths under the sync-debug mode "error" on CUDA.
Every check row says its ``reference``.
On a CPU the same functions run with the device the only difference: offload simulated (``offload_sim``, the
:class:`~colabkit.device.CudaTwin` under the :class:`~colabkit.device.DevicePair`, a
copy read before it was waited for holds NaN), fp16 through the CPU's autocast, qlora through bitsandbytes'
CPU kernels; what only CUDA has (paged optimizers, calibration) is *skipped: needs CUDA*, never a pass. The
report says ``"simulated": true`` then.

:func:`selftest` returns the report and :func:`write_report` writes ``selftest.md`` / ``selftest.json``
(device, driver, library versions, each check with its status, measured vs predicted and the estimate's
error). A failing check makes ``ok`` False (the CLI exits 1).

>>> r = run_checks([CHECKS["fp16 + GradScaler"]], "cpu", SIZES["smoke"])
>>> r[0]["status"], r[0]["name"]
('pass', 'fp16 + GradScaler')
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import time
import traceback
from typing import Any, Callable

import torch

from .data import TextData
from .demos import fp16_overflow_demo
from .env import env, profile_for
from .estimate import calibrate, estimate
from .memory import fmt_bytes
from .models import blocks_of, build_model
from .selftest_checks import CHECKS as TECHNIQUE_CHECKS, Skipped
from .train import measure
from .trainer import Trainer

__all__ = ["selftest", "write_report", "report_markdown", "run_checks", "CHECKS", "SIZES", "ESTIMATE_TOLERANCE"]

# smoke: CI's CPU (seconds); full: a GPU, big enough that the estimate is not all allocator rounding
SIZES = {"smoke": {"model": "gpt:2x32", "batch": 2, "seq": 16, "steps": 2},
         "full": {"model": "gpt:4x256", "batch": 8, "seq": 128, "steps": 2}}
OFFLOAD_PLANS = ("offload:optimizer", "offload:activations", "offload:params")
ESTIMATE_PLANS = ("baseline", "fp16", *OFFLOAD_PLANS, "qlora:8", "paged-adamw8bit")
ESTIMATE_TOLERANCE = 0.15  # |predicted - measured| / measured above this fails the estimate's check
SKIP = "skipped: needs CUDA"


def _needs_cuda(dev: torch.device, what: str) -> None:
    if dev.type != "cuda":
        raise Skipped(f"{SKIP} ({what})")


def _trained(plan: str, dev: torch.device, size: dict, steps: int | None = None) -> tuple[list[float], Trainer]:
    """``steps`` optimizer steps of ``plan`` on a fresh model (seed 0); offload is simulated off CUDA."""
    torch.manual_seed(0)
    model = build_model(size["model"], seq=size["seq"])
    t = Trainer(model, plan, device=dev, offload_sim=dev.type != "cuda")
    data = TextData()
    losses = [t.step(*data.batch(size["batch"], size["seq"], step=i, device=dev)) for i in range(steps or size["steps"])]
    return losses, t


def _max_diff(a: Trainer, b: Trainer) -> float:
    return max((p.detach().float().cpu() - q.detach().float().cpu()).abs().max().item()
               for p, q in zip(a.model.parameters(), b.model.parameters()))


def _offload_check(plan: str) -> Callable[[torch.device, dict], dict]:
    def check(dev: torch.device, size: dict) -> dict:
        ref_losses, ref = _trained("baseline", dev, size)
        losses, t = _trained(plan, dev, size)
        from .device import pair_of

        stats = pair_of(t.model, t.ctx.device).stats()  # CUDA: pinned host allocator; the twin: also copies, waits, poison
        diff = _max_diff(ref, t)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        pinned = stats.get("pinned_peak_bytes", 0)
        counted = dev.type != "cuda" or hasattr(torch.cuda, "host_memory_stats")  # torch < 2.6: no pinned stats
        ok = diff <= 1e-4 and rel <= 1e-5 and not stats.get("poisoned") and (pinned > 0 or not counted)
        return {"ok": ok, "reference": "baseline, same seed and device; pinned host peak > 0", "detail": f"weights vs plain run: max |diff| {diff:.1e} (<= 1e-4), loss rel. diff {rel:.1e} "
                                    f"(<= 1e-5); pinned host peak {fmt_bytes(pinned)} (> 0)"
                                    + (f"; twin: {stats.get('copies', 0)} side-stream copies, {stats.get('poisoned', 0)} "
                                       "landed poison (source freed or not ready)" if "copies" in stats else ""),
                "stats": stats}
    return check


def check_fp16(dev: torch.device, size: dict) -> dict:
    """fp16 autocast + GradScaler: close to fp32, and an overflowing scale skips the step and halves."""
    ref_losses, ref = _trained("baseline", dev, size)
    losses, t = _trained("fp16", dev, size)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    rows = fp16_overflow_demo(size["model"], steps=2, init_scale=2.0**40, batch=size["batch"], seq=size["seq"], device=dev)
    skips = [r["skipped"] for r in rows] == [True, True] and rows[1]["scale"] == rows[0]["scale"] / 2
    ok = rel <= 2e-2 and skips and t.scaler.is_enabled() and t.scaler.get_scale() > 0
    return {"ok": ok, "reference": "fp32 baseline, same seed and device; overflow: scale / 2", "detail": f"loss vs fp32: rel. diff {rel:.1e} (<= 2e-2); overflowing scale 2^40: steps skipped "
                                f"and scale halved: {skips}; scale now {t.scaler.get_scale():g}"
                                + ("" if dev.type == "cuda" else " (CPU autocast fp16: numerics, not T4 speed)")}


def check_qlora(dev: torch.device, size: dict) -> dict:
    """qlora:8: the base's linear layers in 4-bit NF4 (bitsandbytes), frozen; a step moves only the adapters."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    t = Trainer(build_model(size["model"], seq=size["seq"]), "qlora:8", device=dev)
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in t.model.modules())
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    losses = [t.step(*TextData().batch(size["batch"], size["seq"], step=i, device=dev)) for i in range(size["steps"])]
    now = dict(t.model.named_parameters())
    base_same = all(torch.equal(v, now[n]) for n, v in frozen.items())
    moved = sum(not torch.equal(v, now[n]) for n, v in trainable.items())
    finite = all(torch.isfinite(torch.tensor(losses)).tolist())
    blocks = len(blocks_of(t.model))
    ok = n4 >= blocks and base_same and moved > 0 and finite
    return {"ok": ok, "reference": "the weights before the steps (base frozen, adapters moved)", "detail": f"{n4} Linear4bit layers ({blocks} blocks), base unchanged by the steps: {base_same}, "
                                f"{moved} of {len(trainable)} trainable tensors moved, losses finite: {finite} "
                                f"(bitsandbytes {bnb.__version__}, {'CUDA' if dev.type == 'cuda' else 'CPU'} kernels)"}


def check_paged(dev: torch.device, size: dict) -> dict:
    """paged-adamw8bit (unified memory): the same update as adamw8bit while nothing is paged out."""
    _needs_cuda(dev, "paged optimizers use CUDA unified memory")
    _, a = _trained("adamw8bit", dev, size)
    _, b = _trained("paged-adamw8bit", dev, size)
    diff = _max_diff(a, b)
    return {"ok": diff <= 1e-6, "reference": "adamw8bit, same seed and device", "detail": f"weights vs adamw8bit: max |diff| {diff:.1e} (<= 1e-6)"}


def _predicted(e: dict, dev: torch.device) -> int:
    """The figure to hold against the measured peak: the tensors' peak, plus on CUDA the cuBLAS workspaces
    (the caching allocator holds them, so ``max_memory_allocated`` counts them; as :mod:`.calibrate`)."""
    return int(e["peak_bytes"] + (e["overheads"].get("cublas_workspace", 0) if dev.type == "cuda" else 0))


def _estimate_check(plan: str) -> Callable[[torch.device, dict], dict]:
    def check(dev: torch.device, size: dict) -> dict:
        if plan.startswith("paged-"):
            _needs_cuda(dev, "paged optimizers use CUDA unified memory")
        sim = dev.type != "cuda"
        m = measure(size["model"], plan, batch=size["batch"], seq=size["seq"], steps=size["steps"], device=dev,
                    offload_sim=sim)
        if not m["ok"]:
            return {"ok": False, "reference": "the estimate", "detail": f"measure failed: {m['error']}"}
        # the GPU's profile (a T4's when this GPU has none; the CPU twin predicts a T4): offload applied as on a GPU;
        # but qlora's base computes in fp32 on a CPU and in 16 bits on a GPU: the twin holds its run to the CPU's estimate
        gpu = None if sim and "qlora" in plan else (profile_for(torch.cuda.get_device_name(dev)) if not sim else None) or "t4"
        e = estimate(size["model"], plan, batch=size["batch"], seq=size["seq"], gpu=gpu, device=None if gpu else "cpu",
                     calibration=False)
        pred, got = _predicted(e, dev), int(m["peak_bytes"])
        err = (pred - got) / got
        err = 0.0 if abs(err) < 5e-5 else err  # (a few bytes: not "-0.0%")
        return {"ok": abs(err) <= ESTIMATE_TOLERANCE, "reference": f"colabkit.estimate ({gpu or 'cpu'} profile)", "measured_bytes": got, "predicted_bytes": pred,
                "estimate_error": round(err, 4), "host_bytes": m.get("host_bytes"), "predicted_host_bytes": e.get("host_bytes"),
                "detail": f"measured {fmt_bytes(got)}, estimate ({gpu or 'cpu'}) {fmt_bytes(pred)}: {err:+.1%} "
                          f"(tolerance {ESTIMATE_TOLERANCE:.0%})"}
    return check


def check_calibrate(dev: torch.device, size: dict) -> dict:
    """calibrate: this GPU's context and allocator slack measured (not stored), the estimate's error after it."""
    _needs_cuda(dev, "calibration measures a GPU")
    r = calibrate(store=False)
    errs = [a["need_error"] for a in r["after"]]
    return {"ok": all(abs(a["allocated_error"]) < 0.5 for a in r["after"]), "reference": "the allocator's measured peaks (max_memory_allocated)", "calibration": r, "estimate_error": round(max(errs, key=abs), 4),
            "detail": f"profile {r['profile']}: context {fmt_bytes(r['fitted']['context_bytes'])}, allocator slack "
                      f"{r['fitted']['fragmentation']:.1%}; device-need error after calibration "
                      + ", ".join(f"{e:+.1%}" for e in errs)}


CHECKS: dict[str, Callable[[torch.device, dict], dict]] = {
    **{p: _offload_check(p) for p in OFFLOAD_PLANS},
    "fp16 + GradScaler": check_fp16,
    "qlora:8 build and step": check_qlora,
    "paged-adamw8bit": check_paged,
    **{f"peak vs estimate: {p}": _estimate_check(p) for p in ESTIMATE_PLANS},
    "calibrate": check_calibrate,
    **TECHNIQUE_CHECKS,
}
for _name, _fn in list(CHECKS.items()):
    _fn.check_name = _name


def run_checks(checks: list[Callable], device: str | torch.device, size: dict) -> list[dict]:
    """Run each check; an exception is a failure with its message, :class:`Skipped` a skip."""
    dev, rows = torch.device(device), []
    for fn in checks:
        name = getattr(fn, "check_name", fn.__name__)
        t0 = time.perf_counter()
        try:
            r = fn(dev, size)
            status = "pass" if r.pop("ok") else "fail"
        except Skipped as s:
            r, status = {"detail": str(s)}, "skipped"
        except Exception as e:  # noqa: BLE001  (a crashing check is a failed check, the rest still run)
            r, status = {"detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=3)}, "fail"
        rows.append({"name": name, "status": status, "seconds": round(time.perf_counter() - t0, 2), **r})
    return rows


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for lib in ("colabkit", "bitsandbytes", "transformers", "peft", "accelerate"):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = None
    return out


def _driver() -> str | None:
    """The NVIDIA driver's version (NVML through torch, else /proc), None without one."""
    try:
        import pynvml  # shipped with torch's CUDA wheels as nvidia-ml-py

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:  # noqa: BLE001
        try:
            with open("/proc/driver/nvidia/version") as f:
                return f.readline().strip()
        except OSError:
            return None


def selftest(device: str | torch.device | None = None, size: str | None = None, checks: list[str] | None = None) -> dict:
    """Run the checks on ``device`` (default: the GPU if there is one) at ``size`` (``"smoke"``: seconds
    on a CPU; ``"full"``: default on a GPU) and return the report (``ok``: no check failed)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = size or ("full" if dev.type == "cuda" else "smoke")
    if size not in SIZES:
        raise ValueError(f"size {size!r}: use one of {', '.join(SIZES)}")
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}: use some of {', '.join(CHECKS)}")
    t0 = time.perf_counter()
    rows = run_checks([CHECKS[n] for n in (checks or CHECKS)], dev, SIZES[size])
    e = env()
    return {"ok": all(r["status"] != "fail" for r in rows), "simulated": dev.type != "cuda",
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores, "
                                                                               f"{torch.get_num_threads()} threads)",
            "driver": _driver(), "versions": _versions(), "platform": e["platform"], "profile": e["profile"],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "size": {"name": size, **SIZES[size]}, "estimate_tolerance": ESTIMATE_TOLERANCE,
            "counts": {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped")},
            "seconds": round(time.perf_counter() - t0, 1), "checks": rows}


def report_markdown(r: dict) -> str:
    """The report as Markdown: a header (device, driver, versions) and one table row per check."""
    v = r["versions"]
    head = [f"# colabkit selftest: {'PASS' if r['ok'] else 'FAIL'}"
            + (" (simulated: CPU twin of the CUDA paths)" if r["simulated"] else ""), "",
            f"- device: {r['device']}; driver: {r['driver'] or '-'}; CUDA {v['cuda'] or '-'}; platform {r['platform']}",
            "- versions: " + ", ".join(f"{k} {v[k] or '-'}" for k in v if k != "cuda"),
            f"- {r['date']}, size {r['size']['name']} ({r['size']['model']}, batch {r['size']['batch']}, seq "
            f"{r['size']['seq']}): {r['counts']['pass']} passed, {r['counts']['fail']} failed, "
            f"{r['counts']['skipped']} skipped in {r['seconds']} s", "",
            "| check | result | reference | measured | predicted | estimate error | detail |",
            "|---|---|---|---|---|---|---|"]
    for c in r["checks"]:
        m, p = c.get("measured_bytes"), c.get("predicted_bytes")
        err = c.get("estimate_error")
        head.append(f"| {c['name']} | {c['status']} | {c.get('reference', '')} | {fmt_bytes(m) if m else ''} | {fmt_bytes(p) if p else ''} | "
                    f"{'' if err is None else f'{err:+.1%}'} | {c['detail'].replace('|', chr(92) + '|')} |")  # a | in the detail escaped
    return "\n".join(head)


def write_report(r: dict, directory: str = ".") -> tuple[str, str]:
    """Write ``selftest.md`` and ``selftest.json`` to ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    md, js = os.path.join(directory, "selftest.md"), os.path.join(directory, "selftest.json")
    with open(md, "w") as f:
        f.write(report_markdown(r) + "\n")
    with open(js, "w") as f:
        json.dump(r, f, indent=2, default=str)
        f.write("\n")
    return md, js


def register_cli(subcommand: Callable) -> None:
    """Add ``selftest`` to the CLI (called by :func:`colabkit.__main__.build_parser`)."""
    def add_args(p) -> None:
        p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: the GPU if there is one)")
        p.add_argument("--size", default=None, choices=list(SIZES),
                       help="smoke (seconds; the default on a CPU) or full (the default on a GPU)")
        p.add_argument("--out", default=".", metavar="DIR", help="where selftest.md and selftest.json go (default: here)")
        p.add_argument("--check", action="append", default=None, metavar="NAME",
                       help="run only this check (repeat for several; default: all): " + ", ".join(CHECKS))

    @subcommand("selftest", "run the GPU paths (or their CPU twin) and write selftest.md/.json to attach to an issue",
                add_args, report_markdown)
    def _selftest(args) -> dict:
        import sys

        r = selftest(args.device, args.size, args.check)
        md, js = write_report(r, args.out)
        print(f"colabkit: wrote {md} and {js}: please attach them to your issue", file=sys.stderr)
        return r

"""colabkit's speed against named peers, one run: the optimizer steps (torch fused/foreach AdamW,
bitsandbytes AdamW8bit, torchao AdamW4bit, adam-mini, galore-torch: state bytes and step time), the
estimator (accelerate's ``calculate_maximum_sizes`` for the in-process row; the ``plan`` CLI as a
subprocess), ``offload:disk`` against the same AdamW kernel in memory, and the MemoryTracker's overhead.

Every speed figure is process CPU time on one thread (``torch.set_num_threads(1)``, subprocesses with
``OMP_NUM_THREADS=1``), untracked, warmed up and interleaved against its peers in the same rounds
(:func:`colabkit.timing.interleaved`): median, min-max spread, and ratios as the median of per-round
ratios. Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/peers-cpu``).

    python benchmarks/peers.py            # the issue's sizes: 30M-parameter optimizers, gpt2-350m plan
    python benchmarks/peers.py --quick    # tiny sizes, seconds (CI runs this)
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's colabkit, also when run as a script

import colabkit  # noqa: E402
from colabkit.estimate.trace_cache import ENV as TRACE_ENV  # noqa: E402
from colabkit.memory import MemoryTracker, _storages, optimizer_tensors  # noqa: E402
from colabkit.models import build_meta, build_model, count_params  # noqa: E402
from colabkit.plan import param_groups  # noqa: E402
from colabkit.techniques.disk_offload import DiskAdamW  # noqa: E402
from colabkit.techniques.optimizers import make_optimizer  # noqa: E402
from colabkit.timing import Timing, interleaved, ratio  # noqa: E402

PLAN_ARGS = ["plan", "--model", "gpt2-350m", "--batch", "4", "--seq", "1024", "--gpu", "t4"]
# Each CLI row runs with the trace cache "off" (every trace run) or "warm" (a folder of its own, filled by the
# warm-up run); a row with no mode runs with it off.
CACHE_LABEL = {"off": "trace cache off", "warm": "trace cache warm (the warm-up run's traces)"}
SIZES = {
    # the issue's table: optimizers at ~30M parameters (gpt:8x512 with an 8192 vocabulary: 29.9M, real shapes),
    # the tracker at gpt:8x256 batch 8 x seq 128, the estimator on gpt2-350m / gpt2-124m at seq 1024
    "full": dict(opt_model="gpt:8x512:v8192", opt_seq=128, tracker_model="gpt:8x256", batch=8, seq=128,
                 warmup=2, repeats=7, est_model="gpt2-124m", est_seq=1024, est_repeats=5,
                 cli=[("env", ["env"]),  # the floor every command pays: interpreter, torch and colabkit imported
                      # plan twice: every trace run (the first question about a model), and answered from the
                      # traces the warm-up run stored (colabkit.estimate.trace_cache: the same question again)
                      ("plan", PLAN_ARGS, "off"), ("plan", PLAN_ARGS, "warm"),
                      ("largest", ["largest", "--plan", "checkpoint+adamw8bit+fused-step", "--gpu", "t4"], "off")]),
    "quick": dict(opt_model="gpt:2x64", opt_seq=32, skip=("torchao AdamW4bit",), tracker_model="gpt:2x64", batch=2, seq=32,
                  warmup=1, repeats=2, est_model="gpt:2x64", est_seq=32, est_repeats=2,
                  cli_repeats=1, cli=[("estimate", ["estimate", "--model", "gpt:2x64", "--batch", "1", "--seq", "32", "--gpu", "t4"])]),
}
PEERS = ("torch", "bitsandbytes", "torchao", "adam-mini", "galore-torch", "accelerate", "transformers")
GALORE_RANK = 32


def versions() -> dict[str, str | None]:
    out = {}
    for name in PEERS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU ({cpu}, {os.cpu_count()} cores), 1 thread"


# ----- helpers -----------------------------------------------------------------------------------------
def _model_with_grads(name: str, seq: int) -> torch.nn.Module:
    """A model whose every parameter has a fixed random gradient (the optimizer rows time ``step()`` only)."""
    torch.manual_seed(0)
    model = build_model(name, seq=seq)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


def state_bytes(opt: Any) -> int:
    """Bytes of the optimizer's state tensors (each storage once), after a step."""
    seen, total = set(), 0
    for t in optimizer_tensors(opt):
        for st in _storages(t):  # inside wrapper subclasses too (torchao's 4-bit state)
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _timing(t: Timing) -> dict[str, Any]:
    return {"median_s": t.median, "low_s": t.low, "high_s": t.high, "samples_s": t.samples, "clock": t.clock}


def _peer_optimizers(model_name: str, seq: int) -> dict[str, Callable[[], tuple[Any, torch.nn.Module]]]:
    """name -> factory of (optimizer, model). colabkit's tokens go through make_optimizer (what a plan runs)."""
    def tok(token: str):
        def make():
            m = _model_with_grads(model_name, seq)
            return make_optimizer(m, token, lr=1e-3, weight_decay=0.01), m
        return make

    def torch_adamw(**kw):
        def make():
            m = _model_with_grads(model_name, seq)
            return torch.optim.AdamW(param_groups(m, 0.01), lr=1e-3, **kw), m
        return make

    def bnb_adamw8bit():
        import bitsandbytes as bnb

        m = _model_with_grads(model_name, seq)
        return bnb.optim.AdamW8bit(param_groups(m, 0.01), lr=1e-3, min_8bit_size=4096), m

    def torchao_adamw4bit():
        from torchao.optim import AdamW4bit

        m = _model_with_grads(model_name, seq)
        return AdamW4bit(param_groups(m, 0.01), lr=1e-3), m

    return {"torch fused AdamW": torch_adamw(fused=True), "torch foreach AdamW": torch_adamw(foreach=True),
            "torch single-tensor AdamW": torch_adamw(foreach=False),
            "bitsandbytes AdamW8bit": bnb_adamw8bit, "torchao AdamW4bit": torchao_adamw4bit,
            "adamw": tok("adamw"), "adamw4bit": tok("adamw4bit"), "adamw8bit": tok("adamw8bit"),
            "adam-mini": tok("adam-mini"), f"galore:{GALORE_RANK}": tok(f"galore:{GALORE_RANK}")}


# ----- the rows -------------------------------------------------------------------------------------------
# (colabkit's optimizer token, the peers it is timed against); every row also includes torch fused AdamW
OPTIMIZER_ROWS = [
    ("adamw", ["torch foreach AdamW", "torch single-tensor AdamW"], "torch fused AdamW"),
    ("adamw4bit", ["torchao AdamW4bit"], "torchao AdamW4bit"),
    ("adamw8bit", ["bitsandbytes AdamW8bit"], "bitsandbytes AdamW8bit"),
    ("adam-mini", [], "torch fused AdamW"),
    (f"galore:{GALORE_RANK}", [], "torch fused AdamW"),
]


def optimizer_rows(cfg: dict) -> list[dict]:
    makers = _peer_optimizers(cfg["opt_model"], cfg["opt_seq"])
    rows = []
    for token, peers, main_peer in OPTIMIZER_ROWS:
        names = [token, "torch fused AdamW", *peers]
        opts, refs, bytes_, skipped = {}, [], {}, {}
        for n in dict.fromkeys(names):
            if n in cfg.get("skip", ()):
                skipped[n] = "skipped in quick mode (its first step compiles for tens of seconds)"
                continue
            try:
                opt, model = makers[n]()
            except ImportError as e:  # an optional peer not installed: say so, time the rest
                skipped[n] = f"not installed: {e}"
                continue
            opt.step()  # state allocated (and kernels warm) before anything is timed
            opts[n], bytes_[n] = opt.step, state_bytes(opt)
            if n == token:  # which implementation the token runs on this device
                impl = f"{type(opt).__module__.split('.')[0]} {type(opt).__name__}" + (
                    " (fused)" if getattr(opt, "defaults", {}).get("fused") else "")
            refs.append((opt, model))
        t = interleaved(opts, warmup=cfg["warmup"], repeats=cfg["repeats"])
        n_params = count_params(refs[0][1], trainable_only=True)
        rows.append({"kind": "optimizer", "what": token, "implementation": impl, "params": n_params, "peer": main_peer,
                     "timings": {n: _timing(x) for n, x in t.items()},
                     "state_bytes": bytes_, "skipped": skipped,
                     "ratios": {n: ratio(t, token, n) for n in t if n != token}})
        del refs, opts
    return rows


def disk_row(cfg: dict) -> dict:
    """offload:disk (state in a mapped file, fused kernel on its pages) against the same kernel in memory."""
    model_d, model_m, model_s = (_model_with_grads(cfg["opt_model"], cfg["opt_seq"]) for _ in range(3))
    directory = tempfile.mkdtemp(prefix="colabkit-peers-")
    disk = DiskAdamW(param_groups(model_d, 0.01), lr=1e-3, directory=directory)
    mem = torch.optim.AdamW(param_groups(model_m, 0.01), lr=1e-3, fused=True)
    single = torch.optim.AdamW(param_groups(model_s, 0.01), lr=1e-3, foreach=False)
    try:
        t = interleaved({"offload:disk": disk.step, "torch fused AdamW": mem.step,
                         "torch single-tensor AdamW": single.step}, warmup=cfg["warmup"], repeats=cfg["repeats"])
    finally:
        disk.close()
        os.rmdir(directory)
    return {"kind": "disk", "what": "offload:disk", "params": count_params(model_d), "peer": "torch fused AdamW",
            "timings": {n: _timing(x) for n, x in t.items()},
            "ratios": {n: ratio(t, "offload:disk", n) for n in t if n != "offload:disk"}}


def tracker_row(cfg: dict) -> dict:
    """A training step (forward, backward, fused AdamW step) with a MemoryTracker open across steps and
    phases labelled, as ``measure``/``train`` run it, against the same step untracked."""
    x = torch.randint(0, 256, (cfg["batch"], cfg["seq"]))

    def make():
        torch.manual_seed(0)
        m = build_model(cfg["tracker_model"], seq=cfg["seq"])
        return m, make_optimizer(m, "adamw")

    (m1, o1), (m2, o2), (m3, o3) = make(), make(), make()

    def loss_of(m):
        return torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    def plain():
        loss_of(m1).backward()
        o1.step()
        o1.zero_grad(set_to_none=True)

    def phased(mt, m, o):  # one step, its phases labelled as the Trainer labels them
        with mt.phase("forward"):
            loss = loss_of(m)
        with mt.phase("backward"):
            loss.backward()
        with mt.phase("optimizer"):
            o.step()
        o.zero_grad(set_to_none=True)

    tracker = MemoryTracker(m2, o2, device="cpu", alert_at=None)

    def tracked():
        phased(tracker, m2, o2)
        tracker.set_step(tracker._step + 1)

    def fresh():  # a tracker made, entered, left and reported around each step (what a one-off check pays)
        with MemoryTracker(m3, o3, device="cpu", alert_at=None) as mt:
            phased(mt, m3, o3)
        mt.report()

    with tracker:
        t = interleaved({"tracked": tracked, "untracked": plain, "tracked, a new tracker per step": fresh},
                        warmup=cfg["warmup"], repeats=cfg["repeats"])
    return {"kind": "tracker", "what": f"MemoryTracker, {cfg['tracker_model']} batch {cfg['batch']} x seq {cfg['seq']}",
            "peer": "untracked step", "timings": {n: _timing(v) for n, v in t.items()},
            "ratios": {"untracked": ratio(t, "tracked", "untracked"),
                       "untracked (a new tracker per step)": ratio(t, "tracked, a new tracker per step", "untracked")}}


def questions(seq: int):
    """The sequence lengths the estimate row asks, one per call: ``seq``, ``seq - 1``, ... (each new)."""
    return iter(range(seq, 0, -1))


def estimate_row(cfg: dict) -> dict:
    """colabkit.estimate (fp16+checkpoint on a T4, warm: imports and optimizer profiles loaded, but its trace and
    FLOP-count caches cleared before every call and the trace cache on disk off, so each call traces anew) against accelerate's
    calculate_maximum_sizes on the same model built on the meta device (parameters only)."""
    from accelerate.utils import calculate_maximum_sizes

    name, seq = cfg["est_model"], cfg["est_seq"]

    trace_mod, speed_mod = (importlib.import_module(f"colabkit.estimate.{m}") for m in ("trace", "speed"))

    asked = questions(seq)

    def ours():  # the trace and FLOP count made afresh each call (cleared caches): what a new question costs --
        # another sequence length each call, as a user moving a slider asks: torch's fake-tensor dispatch cache
        # (per process, keyed by shapes) has seen none of its ops (the same question again costs ~30% less)
        trace_mod._CACHE.clear()
        speed_mod._COUNTS.clear()
        colabkit.estimate(name, "fp16+checkpoint", batch=1, seq=next(asked), gpu="t4")

    def accelerate():
        calculate_maximum_sizes(build_meta(name, seq=seq))

    was = os.environ.get(TRACE_ENV)
    os.environ[TRACE_ENV] = "off"  # a new question: no trace on disk either (colabkit.estimate.trace_cache)
    try:
        t = interleaved({"colabkit.estimate": ours, "accelerate calculate_maximum_sizes": accelerate},
                        warmup=1, repeats=cfg["est_repeats"])
    finally:
        if was is None:
            os.environ.pop(TRACE_ENV)
        else:
            os.environ[TRACE_ENV] = was
    return {"kind": "estimate", "what": f'colabkit.estimate("{name}", "fp16+checkpoint", batch=1, seq={seq}, {seq - 1}, ..., '
                                        f'gpu="t4"): another sequence each call',
            "peer": "accelerate calculate_maximum_sizes", "timings": {n: _timing(v) for n, v in t.items()},
            "ratios": {"accelerate calculate_maximum_sizes": ratio(t, "colabkit.estimate",
                                                                   "accelerate calculate_maximum_sizes")}}


def cli_rows(cfg: dict) -> list[dict]:
    """``python -m colabkit <args>`` in a subprocess (one thread), timed by its process CPU time (user + sys)."""
    rows = []
    # Python caches compiled bytecode by default (a user's machine, Colab); a sandbox that sets
    # PYTHONDONTWRITEBYTECODE would make every run recompile colabkit's sources, which no user pays
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, args, *mode in cfg["cli"]:
        cache = (mode or ["off"])[0]
        folder = tempfile.TemporaryDirectory(prefix="colabkit-traces-")
        env[TRACE_ENV] = "off" if cache == "off" else folder.name
        cpus = []
        for _ in range(1 + cfg.get("cli_repeats", 3)):  # the first run warms the caches (bytecode, page cache)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run([sys.executable, "-m", "colabkit", *args], capture_output=True, text=True, env=env,
                                  cwd=ROOT)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        cpus = cpus[1:]
        folder.cleanup()
        rows.append({"kind": "cli", "what": "colabkit " + " ".join(args), "cache": cache, "peer": None,
                     "exit_code": proc.returncode,
                     "timings": {"colabkit": {"median_s": statistics.median(cpus), "low_s": min(cpus),
                                              "high_s": max(cpus), "samples_s": cpus,
                                              "clock": "cpu process time (subprocess)"}},
                     "output_head": proc.stdout.splitlines()[:3], "ratios": {}})
    return rows


# ----- report ---------------------------------------------------------------------------------------------
def _ms(t: dict) -> str:
    m = t["median_s"]
    spread = f" ({t['low_s'] * 1e3:.1f}–{t['high_s'] * 1e3:.1f})" if len(t["samples_s"]) > 1 else ""
    return f"{m:.2f} s" if m >= 10 else f"{m * 1e3:.1f} ms{spread}"


def markdown(data: dict) -> str:
    v = data["versions"]
    lines = [f"colabkit against its peers — {data['device']}, {data['date']}; "
             + ", ".join(f"{k} {x}" for k, x in v.items() if x) + f"; python {data['python']}"
             + (f"; load average {data['load_avg_1m']:.1f} at start" if data.get("load_avg_1m") is not None else "")
             + (" — **quick mode (tiny sizes): not the issue's figures**" if data["quick"] else ""), "",
             "Process CPU time, one thread, untracked, warmed up; median (min–max) of interleaved rounds; "
             "ratio = median of per-round ratios (> 1: colabkit slower).", "",
             "| what | colabkit | peer | peer time | ratio | state bytes (colabkit / peer) |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        t = r["timings"]
        if r["kind"] == "cli":
            ok = "" if r["exit_code"] == 0 else f" (exit {r['exit_code']})"
            lines.append(f"| `{r['what']}`, {CACHE_LABEL[r.get('cache', 'off')]} | {_ms(t['colabkit'])}{ok} | "
                         "subprocess CPU time (user + sys), median of "
                         f"{len(t['colabkit']['samples_s'])} runs after a warm-up run, bytecode cached | | | |")
            continue
        ours = r["what"] if r["kind"] == "optimizer" else ("offload:disk" if r["kind"] == "disk" else
                                                           "tracked" if r["kind"] == "tracker" else "colabkit.estimate")
        label = (f"`{r['what']}` step, {r['params'] / 1e6:.1f}M params" if r["kind"] in ("optimizer", "disk")
                 else r["what"]) + (f" ({r['implementation']} here)" if r.get("implementation") else "")
        first = True
        for peer, rat in r["ratios"].items():
            sb = ""
            if r["kind"] == "optimizer":
                sb = f"{r['state_bytes'][ours] / r['params']:.3f} / {r['state_bytes'][peer] / r['params']:.3f} B/param"
            if peer in t:
                mine, theirs = t[ours], t[peer]
            else:  # the tracker's second variant: a new tracker per step, against the untracked step
                mine, theirs = t["tracked, a new tracker per step"], t["untracked"]
                peer = "untracked (colabkit: a new tracker per step)"
            lines.append(f"| {label if first else ''} | {_ms(mine)} | {peer} | {_ms(theirs)} | {rat:.2f}× | {sb} |")
            first = False
        for peer, why in r.get("skipped", {}).items():
            lines.append(f"| | | {peer} | {why[:70]} | | |")
    return "\n".join(lines) + "\n"


def run(quick: bool = False, only: set[str] | None = None) -> dict:
    torch.set_num_threads(1)
    cfg = SIZES["quick" if quick else "full"]
    data = {"device": device(), "versions": versions(), "python": platform.python_version(), "quick": quick,
            "date": datetime.date.today().isoformat(), "sizes": {k: v for k, v in cfg.items() if k != "cli"},
            # a shared machine's other work slows CPU time too (caches, SMT siblings): the figures' context
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "rows": []}
    print(f"{data['device']}; " + ", ".join(f"{k} {x}" for k, x in data["versions"].items()), file=sys.stderr)
    steps = [("cli", lambda: cli_rows(cfg)), ("estimate", lambda: [estimate_row(cfg)]),
             ("optimizers", lambda: optimizer_rows(cfg)), ("disk", lambda: [disk_row(cfg)]),
             ("tracker", lambda: [tracker_row(cfg)])]
    for name, fn in steps:
        if only and name not in only:
            continue
        rows = fn()
        data["rows"] += rows
        for r in rows:
            print(f"{r['what']}: " + ", ".join(f"{n} {_ms(t)}" for n, t in r["timings"].items())
                  + "".join(f"; ×{p} {x:.2f}" for p, x in r["ratios"].items()), file=sys.stderr, flush=True)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds): checks the code, not the figures")
    p.add_argument("--only", action="append", choices=["cli", "estimate", "optimizers", "disk", "tracker"],
                   help="run only these groups of rows (repeatable)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers-cpu"),
                   help="output path without extension: writes .json and .md")
    args = p.parse_args(argv)
    data = run(args.quick, set(args.only) if args.only else None)
    out = args.out[:-5] if args.out.endswith(".json") else args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    md = markdown(data)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The first command on a lent GPU (issue 35): the selftest, every plan token on gpt2-124m under T4 emulation,
and the estimator's figures next to each, in one results file named after the GPU and the date.

Run through ``benchmarks/device_run.sh OUT`` (it installs the carried wheels and sets the environment); in CI
``benchmarks/device_run.sh OUT --dry-run`` runs the same phases in smoke mode on the CPU (tiny model, a few
plans, two selftest checks) and labels its files "dry-run, cpu". Phases, each a subprocess with its own time
limit so that a crash or a hang in one still leaves the others' results:

1. ``python -m colabkit selftest --json``: every check, real on CUDA (``"simulated": false``);
2. ``python -m colabkit calibrate`` (GPU only): this GPU's profile, stored for the next phase's predictions;
3. ``benchmarks/run.py --device cuda --t4`` on gpt2-124m, batch 8 x seq 512: every token of its default list
   alone and the usual combinations (refusals shown as refusals), measured peak allocated and reserved, step
   time, loss after N steps against the baseline, the estimator's T4 prediction beside each;
4. (in the same records) the predicted step time with the profile of the GPU present against the measured one.
   A T4's step time cannot be measured here: T4 emulation caps memory and refuses bf16 and flash attention,
   so memory figures transfer to a T4, times do not.

Writes ``OUT/cuda-<gpu>-t4emu-<date>.json`` and ``.md`` (dry run: ``dry-run-cpu-<date>.*``) and
``OUT/device_run.log``: three files, inside the eight a run call brings back.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALL_S = 220  # this script; with the wheels' install (~15 s) the command stays within 4 minutes on one H100/H200,
# so that the machine's start, a second command and a rerun fit the 15 minutes of device time

# the tokens issue 35 needs measured at least once go first, so that a spent time budget leaves out the others
FIRST = ["baseline", "fp16", "checkpoint", "paged-adamw8bit", "adamw4bit", "fused-step", "offload:optimizer",
         "offload:activations", "offload:params", "offload:disk", "compress:int8", "attention:efficient", "chunked-ce",
         "lora:8", "qlora:8", "adamw8bit", "bf16", "fp16+attention:flash"]
FULL = {"model": "gpt2-124m", "batch": 8, "seq": 512, "steps": 3, "plans": "FIRST then run.PLANS", "checks": None,
        "size": "full"}
DRY = {"model": "gpt-tiny", "batch": 2, "seq": 16, "steps": 2, "size": "smoke",
       "plans": ["baseline", "offload:optimizer", "chunked-ce"],
       "checks": ["fp16 + GradScaler", "peak vs estimate: baseline"]}


def slug(gpu: str | None) -> str:
    """A file-name word for a GPU: its colabkit profile key, else its name in lower-case words.

    >>> slug("NVIDIA H100 80GB HBM3"), slug("NVIDIA B200")
    ('h100', 'nvidia-b200')
    """
    from colabkit.env import profile_for

    return profile_for(gpu) or re.sub(r"[^a-z0-9]+", "-", (gpu or "cpu").lower()).strip("-")


def result_stem(env: dict, dry: bool) -> str:
    """``cuda-<gpu>-t4emu-<date>`` (``dry-run-cpu-<date>`` for the dry run)."""
    date = env["date"][:10]
    return f"dry-run-cpu-{date}" if dry else f"cuda-{slug(env.get('gpu'))}-t4emu-{date}"


def _phase(name: str, cmd: list[str], timeout: float, log) -> dict:
    """Run one phase as a subprocess (output to the log), killed after ``timeout`` seconds."""
    t0 = time.perf_counter()
    print(f"\n=== {name}: {' '.join(cmd)} (limit {timeout:.0f} s)", file=log, flush=True)
    try:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=max(timeout, 1)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = round(time.perf_counter() - t0, 1)
    print(f"=== {name}: rc {rc} in {wall} s", file=log, flush=True)
    return {"cmd": cmd, "rc": rc, "wall_s": wall}


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def environment(selftest: dict | None, bench: dict | None, dry: bool) -> dict:
    """GPU name, driver, torch, CUDA and the date: from the selftest report (it reads the driver through NVML),
    else from this process."""
    import torch

    env = {"label": "dry-run, cpu" if dry else "cuda with T4 emulation",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "driver": None, "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if selftest:
        env.update(driver=selftest.get("driver"), versions=selftest.get("versions"), selftest_device=selftest.get("device"))
    if bench:
        env["emulating_t4"] = bench["env"].get("emulating_t4")
        env["budget_bytes"] = bench["env"].get("budget_bytes")
    if not dry and env["gpu"]:
        env["label"] = f"{env['gpu']} with T4 emulation"
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                        timeout=10).stdout.strip()
        env["commit"] = git("rev-parse", "--short", "HEAD") or None
        # a lent machine gets the working tree with the session's first .git: HEAD may not be what ran
        if env["commit"] and git("status", "--porcelain", "--untracked-files=no"):
            env["commit"] += " + uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def summary(bench: dict | None) -> dict:
    """Counts and the estimator's error per plan (peak, reserved, step time) from the bench records."""
    if not bench:
        return {}
    rs = bench["results"]
    ok = [r for r in rs if r["ok"]]
    errs = [abs(r["estimate_error"]) for r in ok if r.get("estimate_error") is not None]
    return {"plans": len(rs), "measured": len(ok), "refused": sum(not r["ok"] and not r.get("not_run") for r in rs),
            "not_run": sum(bool(r.get("not_run")) for r in rs),
            "max_abs_estimate_error": max(errs) if errs else None,
            "per_plan": {r["plan"]: {k: r.get(k) for k in ("estimate_error", "estimate_reserved_error", "step_time_error")}
                         for r in ok}}


def markdown(data: dict) -> str:
    """The results file's Markdown: the environment, the selftest's table and run.py's tables."""
    e = data["env"]
    lines = [f"# colabkit on {e['label']}, {e['date'][:10]}", "",
             f"- GPU: {e['gpu'] or 'none (CPU)'}; driver {e['driver'] or '-'}; torch {e['torch']}; CUDA {e['cuda'] or '-'}; "
             f"Python {e['python']}; commit {e.get('commit') or '-'}; {e['date']}",
             "- phases: " + ", ".join(f"{n} rc {p['rc']} in {p['wall_s']} s" for n, p in data["phases"].items())
             + f"; whole command {data['wall_s']} s (limit {data['limit_s']} s)"]
    if data["env"]["label"] != "dry-run, cpu":
        lines.append("- T4 emulation caps this process to a T4's usable memory and refuses bf16 and flash attention: the "
                     "memory figures transfer to a T4, the step times do not (a T4's are predicted only)")
    if data.get("summary"):
        s = data["summary"]
        err = s["max_abs_estimate_error"]
        lines.append(f"- plans: {s['measured']} measured, {s['refused']} refused, {s['not_run']} not run (time budget); "
                     f"largest |estimate error| {'-' if err is None else f'{err:.1%}'}")
    if data.get("selftest"):
        from colabkit.selftest import report_markdown

        lines += ["", "## Selftest", "", report_markdown(data["selftest"]).split("\n", 1)[1].strip()]
    if data.get("bench"):
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from run import markdown as bench_markdown

        lines += ["", "## Every plan token (benchmarks/run.py)", "", bench_markdown(data["bench"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results folder (created)")
    p.add_argument("--dry-run", action="store_true", help="smoke sizes on the CPU (what CI runs)")
    p.add_argument("--wall-s", type=float, default=None, help=f"the whole command's limit (default {WALL_S})")
    p.add_argument("--selftest-s", type=float, default=None, help="the selftest's limit (default: a third of it)")
    p.add_argument("--plan", action="append", default=None, help="run.py's plans (default: its whole list)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--check", action="append", default=None, help="selftest checks to run (default: every one)")
    args = p.parse_args(argv)
    cfg = dict(DRY if args.dry_run else FULL)
    if cfg["plans"] == FULL["plans"]:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from run import PLANS

        cfg["plans"] = FIRST + [p for p in PLANS if p not in FIRST]
    cfg["plans"] = args.plan or cfg["plans"]
    cfg["checks"] = args.check or cfg["checks"]
    cfg["steps"] = args.steps or cfg["steps"]
    limit = args.wall_s or WALL_S
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("device_run: torch sees no CUDA GPU here: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, ".parts")
    os.makedirs(tmp, exist_ok=True)
    py, dev = sys.executable, "cpu" if args.dry_run else "cuda"
    phases = {}
    with open(os.path.join(args.out, "device_run.log"), "w") as log:
        cmd = [py, "-m", "colabkit", "selftest", "--device", dev, "--size", cfg["size"], "--out", tmp,
               "--json", os.path.join(tmp, "selftest-cli.json")]
        for c in cfg["checks"] or []:
            cmd.append(f"--check={c}")  # one word: a check named like an option (--deterministic) stays a value
        phases["selftest"] = _phase("selftest", cmd, args.selftest_s or limit / 3, log)
        if not args.dry_run:  # this GPU's profile (context, slack, the host's line: speed.fit_host), stored where
            # run.py's estimates and step-time predictions read it; a CPU has nothing to calibrate
            phases["calibrate"] = _phase("calibrate", [py, "-m", "colabkit", "calibrate"], limit / 6, log)
        left = limit - (time.perf_counter() - t0)
        cmd = [py, os.path.join("benchmarks", "run.py"), "--device", dev, "--model", cfg["model"], "--batch",
               str(cfg["batch"]), "--seq", str(cfg["seq"]), "--steps", str(cfg["steps"]),
               "--out", os.path.join(tmp, "bench.json"), "--budget-s", f"{max(left - 45, 1):.0f}"]
        cmd += [] if args.dry_run else ["--t4"]
        for plan in cfg["plans"] or []:
            cmd += ["--plan", plan]
        phases["bench"] = _phase("bench", cmd, left - 15, log)
    selftest, bench = _load(os.path.join(tmp, "selftest.json")), _load(os.path.join(tmp, "bench.json"))
    data = {"env": environment(selftest, bench, args.dry_run), "config": cfg, "phases": phases,
            "limit_s": limit, "selftest": selftest, "bench": bench, "summary": summary(bench)}
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    stem = os.path.join(args.out, result_stem(data["env"], args.dry_run))
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))
    for name in os.listdir(tmp):  # the parts live in the results file: only three files come back
        os.remove(os.path.join(tmp, name))
    os.rmdir(tmp)
    print(f"device_run: wrote {stem}.json/.md in {data['wall_s']} s; phases "
          + ", ".join(f"{n} rc {p['rc']}" for n, p in phases.items()))
    ok = selftest is not None and bench is not None and all(p["rc"] in (0, 1) for p in phases.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

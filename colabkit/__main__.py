"""The command line: ``python -m colabkit {env,bench,train,...} [--json PATH]``.

Every subcommand prints a readable table, or JSON with ``--json PATH`` (``-`` for stdout). Other
modules add subcommands with :func:`subcommand`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from .env import emulate_t4, env, format_env
from .memory import CATEGORIES, fmt_bytes

_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any], Callable[[Any], str], str]] = {}


def subcommand(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
               printer: Callable[[Any], str]):
    """Register ``run(args) -> JSON-able result``; ``printer(result)`` gives the readable table."""
    def deco(run):
        _COMMANDS[name] = (add_args, run, printer, help)
        return run
    return deco


def emit(result: Any, json_path: str | None, printer: Callable[[Any], str]) -> None:
    if json_path is None:
        print(printer(result))
        return
    text = json.dumps(result, indent=2, default=str)
    if json_path == "-":
        print(text)
    else:
        with open(json_path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {json_path}", file=sys.stderr)


def bench_table(result: dict) -> str:
    rows = [f"{'plan':<34} {'peak':>10} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'step s':>8} {'loss':>8}"]
    for r in result["results"]:
        if not r["ok"]:
            rows.append(f"{r['plan']:<34} FAILED: {r['error']}")
            continue
        b = r["breakdown"]
        rows.append(f"{r['plan']:<34} {fmt_bytes(r['peak_bytes']):>10} " + " ".join(f"{fmt_bytes(b[c]):>11}" for c in CATEGORIES)
                    + f" {r['step_time_s']:>8.3f} {r['loss']:>8.4f}")
    return "\n".join(rows)


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help="preset, gpt:LxD, llama:LxD or hf:<id>")
    p.add_argument("--plan", action="append", help="plan tokens joined by '+'; repeat for several plans")
    p.add_argument("--batch", type=int, default=8, help="effective batch per optimizer step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--t4", action="store_true", help="emulate a T4 on a bigger GPU (memory cap, no bf16/flash)")
    p.add_argument("--offload-sim", action="store_true",
                   help="on a CPU, simulate offload tokens (a distinct host side; host_bytes in the record)")
    p.add_argument("--world-size", type=int, default=1, help="ranks for sharded plans (zero:1|2|3): one process each")


@subcommand("bench", "measure plans on a model: peak memory, breakdown, step time, loss", _bench_args, bench_table)
def _bench(args: argparse.Namespace) -> dict:
    from .train import measure

    if args.t4:
        emulate_t4()
    if getattr(args, "world_size", 1) > 1:
        from .distributed import bench_sharded

        results = bench_sharded(args.model, args.plan or ["baseline"], world_size=args.world_size, batch=args.batch,
                                seq=args.seq, steps=args.steps, device=args.device, seed=args.seed)
        return {"env": env(), "world_size": args.world_size, "results": results}
    results = [measure(args.model, p, batch=args.batch, seq=args.seq, steps=args.steps, device=args.device, seed=args.seed,
                       offload_sim=args.offload_sim)
               for p in (args.plan or ["baseline"])]
    return {"env": env(), "results": results}


@subcommand("env", "the environment report", lambda p: None, format_env)
def _env_cmd(args: argparse.Namespace) -> dict:
    return env()


def _train_args(p: argparse.ArgumentParser) -> None:
    _bench_args(p)
    p.set_defaults(steps=50)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --checkpoint-dir")
    p.add_argument("--no-track", action="store_true", help="no memory tracker (faster on the CPU; no OOM post-mortem)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest N)")
    p.add_argument("--on-oom", default="stop", choices=["stop", "shrink"],
                   help="on out-of-memory: halve the micro-batch and retry (shrink), or checkpoint and stop")
    p.add_argument("--log", default=None, help="tensorboard, wandb and/or csv (comma-separated): memory per step")
    p.add_argument("--log-dir", default=None, help="where --log writes (default runs/colabkit)")


@subcommand("train", "a real training run with checkpoints and exact resume", _train_args,
            lambda r: f"step {r['step']}  loss {r['loss']:.4f}  weights {r['weights_sha256'][:16]}")
def _train(args: argparse.Namespace) -> dict:
    from .train import train

    if args.plan and len(args.plan) > 1:
        raise SystemExit("train takes one --plan")
    if args.t4:
        emulate_t4()
    if args.world_size > 1:
        from .distributed import train_sharded

        return train_sharded(args.model, (args.plan or ["baseline"])[0], world_size=args.world_size, steps=args.steps,
                             batch=args.batch, seq=args.seq, seed=args.seed, device=args.device, lr=args.lr,
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                             resume=args.resume)
    out = train(args.model, plan=(args.plan or ["baseline"])[0], steps=args.steps, batch=args.batch, seq=args.seq,
                seed=args.seed, device=args.device, lr=args.lr, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every, resume=args.resume, progress=sys.stderr.isatty(),
                keep=args.keep, on_oom=args.on_oom, track=not args.no_track,
                log=args.log, log_dir=args.log_dir, offload_sim=args.offload_sim)
    return {"step": out["step"], "loss": out["loss"], "weights_sha256": out["weights_sha256"], "losses": out["losses"],
            "accum": out["accum"], "oom_shrinks": out["oom_shrinks"], "resumed_from": out["resumed_from"],
            "simulated": out["simulated"]}


def main(argv: list[str] | None = None) -> int:
    from . import techniques  # noqa: F401  (registers plan tokens and subcommands)
    from .estimate.cli import register_cli; register_cli(subcommand)  # noqa: E702  (estimate, plan, largest)
    from .structured import register_cli as structured_cli; structured_cli(subcommand)  # noqa: E702  (structured)

    parser = argparse.ArgumentParser(prog="python -m colabkit", description="GPU memory for training, measured.")
    subs = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _, _, help_) in _COMMANDS.items():
        sp = subs.add_parser(name, help=help_)
        add_args(sp)
        sp.add_argument("--json", metavar="PATH", default=None, help="write JSON to PATH ('-' for stdout)")
    args = parser.parse_args(argv)
    _, run, printer, _ = _COMMANDS[args.command]
    from .plan import PlanError

    try:
        result = run(args)
    except (PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(result, args.json, printer)
    if isinstance(result, dict) and any(not r.get("ok", True) for r in result.get("results", [])):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

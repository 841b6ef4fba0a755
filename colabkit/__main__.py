"""The command line: ``colabkit {env,bench,train,...} [--json PATH]`` (or ``python -m colabkit ...``).

Every subcommand prints a readable table, or JSON with ``--json PATH`` (``-`` for stdout: then stdout
holds the JSON only and colabkit's messages go to stderr). Other modules add subcommands with
:func:`subcommand`. A user mistake ends in one line, ``error: ...``, and exit status 2; a run that
did not succeed (a failed bench record, nothing that fits) exits 1.

>>> build_parser().parse_args(["train", "--resume"]).resume
'auto'
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import sys
import warnings
from typing import Any, Callable

from .env import default_device, emulate_t4, env, format_env
from .memory import CATEGORIES, fmt_bytes
from .notices import ColabkitWarning
from .timing import untracked_time

_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any], Callable[[Any], str], str]] = {}


def subcommand(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
               printer: Callable[[Any], str]):
    """Register ``run(args) -> JSON-able result``; ``printer(result)`` gives the readable table."""
    def deco(run):
        _COMMANDS[name] = (add_args, run, printer, help)
        return run
    return deco


def emit(result: Any, json_path: str | None, printer: Callable[[Any], str]) -> None:
    if json_path is None or json_path == "-":
        try:
            print(printer(result) if json_path is None else json.dumps(result, indent=2, default=str), flush=True)
        except BrokenPipeError:  # `colabkit ... | head`: the reader left early; the run itself went well
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return
    with open(json_path, "w") as f:
        f.write(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {json_path}", file=sys.stderr)


def bench_table(result: dict) -> str:
    rows = [f"{'plan':<34} {'peak':>10} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'step s':>8} {'loss':>8}"]
    for r in result["results"]:
        if not r["ok"]:
            rows.append(f"{r['plan']:<34} FAILED: {r['error']}")
            continue
        b = r["breakdown"]
        rows.append(f"{r['plan']:<34} {fmt_bytes(r['peak_bytes']):>10} " + " ".join(f"{fmt_bytes(b[c]):>11}" for c in CATEGORIES)
                    + f" {untracked_time(r):>8} {r['loss']:>8.4f}")
    rows.append("peak: tracked device memory at its highest during the measured steps; each category: its own peak; "
                "step s: seconds per optimizer step, timed on steps run after them without the tracker (on CUDA; "
                "-: not timed, as on a CPU, where the tracker slows each op); loss: mean over the last step's batch. "
                "Speed between plans: colabkit.step_times (untracked, warmed up, interleaved)")
    return "\n".join(rows)


def _run_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The arguments ``bench`` and ``train`` share (``--plan`` differs: several for bench, one for train)."""
    p.add_argument("--model", default="gpt-tiny", help="preset (gpt-tiny, gpt2-124m, ...), gpt:LxD, llama:LxD or hf:<id>; "
                   "or your own: FILE.py:FN or package.module:FN (a function building it)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (the effective batch; default %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence, at most the model's context (default %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (same seed, same numbers)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: the GPU if there is one)")
    p.add_argument("--t4", action="store_true", help="emulate a T4 on a bigger GPU (memory cap, no bf16/flash)")
    p.add_argument("--offload-sim", action="store_true",
                   help="on a CPU, simulate offload tokens (a distinct host side; host_bytes in the record)")
    p.add_argument("--world-size", type=int, default=1, help="ranks for sharded plans (zero:1|2|3): one process each")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms, cuBLAS workspace :4096:8 (set before CUDA starts) and every RNG "
                        "seeded: same seed, same bytes (on a GPU slower; an op with no deterministic kernel is an error)")


def _deterministic(args: argparse.Namespace) -> bool:
    """``--deterministic``: cuBLAS's workspace setting goes into the environment now, before anything starts CUDA."""
    if not getattr(args, "deterministic", False):
        return False
    if getattr(args, "world_size", 1) > 1:
        raise ValueError("--deterministic with --world-size is not supported yet (the ranks would not inherit it): "
                         "drop one of them")
    from .determinism import CUBLAS_WORKSPACE

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    return True


def _no_offload_sim_on_ranks(args: argparse.Namespace) -> None:
    """``--offload-sim`` with ``--world-size``: refused, not dropped (the ranks run zero:3's offload as FSDP2's
    CPUOffloadPolicy, which keeps the shards in CPU memory -- on a CPU run the device itself)."""
    if getattr(args, "offload_sim", False) and getattr(args, "world_size", 1) > 1:
        raise ValueError("--offload-sim with --world-size: the ranks offload through FSDP2's CPUOffloadPolicy, which "
                         "keeps the shards in CPU memory -- on a CPU run the device itself, so there is nothing to "
                         "simulate. For the per-rank GPU and host figures run `python -m colabkit estimate "
                         "--world-size N --gpu t4 --plan zero:3+offload:optimizer`; drop one of the two flags")


def _bench_args(p: argparse.ArgumentParser) -> None:
    _run_args(p, steps=2)
    p.add_argument("--plan", action="append", help="plan tokens joined by '+' (default baseline); repeat for several plans")


@subcommand("bench", "measure plans on a model: peak memory, breakdown, step time, loss", _bench_args, bench_table)
def _bench(args: argparse.Namespace) -> dict:
    from .train import check_context, check_sizes, measure

    check_sizes(args.batch, args.seq, args.steps)  # refused like train's, before any plan runs
    check_context(args.model, args.seq)
    det = _deterministic(args)
    _no_offload_sim_on_ranks(args)
    if "auto" in (args.plan or []):  # the fastest plan predicted to fit, for this machine (colabkit.estimate.auto)
        from .estimate.auto import choose

        cuda = (args.device or default_device()).startswith("cuda")
        choice = choose(args.model, args.batch, args.seq, gpu="t4" if cuda else None, device=None if cuda else "cpu")
        print(f"colabkit: {choice['why']}", file=sys.stderr)
        args.plan = [choice["plan"] if p == "auto" else p for p in args.plan]
    if args.t4:
        emulate_t4()
    if getattr(args, "world_size", 1) > 1:
        from .distributed import bench_sharded

        results = bench_sharded(args.model, args.plan or ["baseline"], world_size=args.world_size, batch=args.batch,
                                seq=args.seq, steps=args.steps, device=args.device, seed=args.seed)
        return {"env": env(), "world_size": args.world_size, "results": results}
    results = [measure(args.model, p, batch=args.batch, seq=args.seq, steps=args.steps, device=args.device, seed=args.seed,
                       offload_sim=args.offload_sim, deterministic=det)
               for p in (args.plan or ["baseline"])]
    return {"env": env(), "results": results}


@subcommand("env", "the environment report", lambda p: None, format_env)
def _env_cmd(args: argparse.Namespace) -> dict:
    return env()


def model_arg(spec: str) -> Any:
    """``--model`` of ``train``: a name, or your own model as ``FILE.py:FN`` / ``package.module:FN`` (a function
    that builds it, or a module object of that name).

    >>> model_arg("gpt:2x64"), model_arg("hf:gpt2")
    ('gpt:2x64', 'hf:gpt2')
    """
    import importlib
    import importlib.util
    import re

    return _user_object(spec, "--model", "function or model")


def data_arg(spec: str | None) -> Any:
    """``--data`` of ``train``: your own batches as ``FILE.py:FN`` / ``package.module:FN``, a function returning what
    ``train(model, data=...)`` takes (a list or map-style ``Dataset`` of batch dicts or examples, a ``DataLoader``),
    or a list / Dataset of that name; None: colabkit's own text.

    >>> data_arg(None) is None
    True
    """
    if spec is None:
        return None
    found = _user_object(spec, "--data", "function or dataset")
    if found is spec:
        raise ValueError(f"--data {spec}: give FILE.py:FUNCTION (or package.module:FUNCTION), a function returning your "
                         "batches -- a list or Dataset of batch dicts, or a DataLoader")
    return found() if inspect.isroutine(found) else found  # a function: called once, its batches as train takes them


def _user_object(spec: str, flag: str, what: str) -> Any:
    """The object ``FN`` of ``FILE.py:FN`` / ``package.module:FN`` (the file run as a module); ``spec`` itself when
    it has neither form (a name colabkit knows)."""
    import importlib
    import importlib.util
    import re

    m = re.match(r"^(?P<src>[^:]+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+):(?P<fn>[A-Za-z_]\w*)$", spec)
    if m is None:
        return spec
    src, name = m["src"], m["fn"]
    if src.endswith(".py"):
        if not os.path.isfile(src):
            raise ValueError(f"{flag} {spec}: no file {src!r}; give FILE.py:FUNCTION with the path of your file")
        loaded = importlib.util.spec_from_file_location(os.path.basename(src)[:-3], src)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(src)
    fn = getattr(module, name, None)
    if fn is None or (flag == "--model" and not callable(fn)):
        raise ValueError(f"{flag} {spec}: {src} has no {what} named {name!r}")
    return fn


def _train_args(p: argparse.ArgumentParser) -> None:
    _run_args(p, steps=50)
    p.add_argument("--budget-bytes", type=int, default=None, metavar="B",
                   help="device memory budget: --plan auto picks a plan predicted to fit it; alerts near it")
    p.add_argument("--plan", action="append", help="one plan: tokens joined by '+', e.g. fp16+checkpoint, or auto: the fastest predicted to fit (default baseline)")
    p.add_argument("--data", default=None, metavar="FILE.py:FN",
                   help="your own batches: a function returning a list or Dataset of batch dicts (or examples), or a "
                        "DataLoader -- what train(model, data=...) takes (default: colabkit's own text, byte ids 0-255)")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write crash-safe checkpoints here (every 10 min of wall time and at the end, unless "
                        "--checkpoint-every / --checkpoint-minutes say otherwise)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="a checkpoint every K optimizer steps")
    p.add_argument("--checkpoint-minutes", type=float, default=None, metavar="M",
                   help="a checkpoint every M minutes of wall time (default 10 when --checkpoint-every is not given)")
    p.add_argument("--resume", nargs="?", const="auto", default=False, choices=["auto", "must"],
                   help="continue from the newest valid checkpoint in --checkpoint-dir when there is one, start fresh "
                        "otherwise (saying which); '--resume must' fails when there is none")
    p.add_argument("--no-track", action="store_true", help="no memory tracker (faster on the CPU; no OOM post-mortem)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept: the newest N (default %(default)s)")
    p.add_argument("--on-oom", default="stop", choices=["stop", "shrink"],
                   help="on out-of-memory: halve the micro-batch and retry (shrink), or checkpoint and stop")
    p.add_argument("--log", default=None, help="tensorboard, wandb and/or csv (comma-separated): memory per step")
    p.add_argument("--log-dir", default=None, help="where --log writes (default runs/colabkit)")


def _train_line(r: dict) -> str:
    loss = "(not recorded)" if r.get("loss") is None else f"{r['loss']:.4f}"
    head = "run complete, nothing to train: " if r.get("complete") else ""
    peak = "" if r.get("peak_bytes") is None else f"  peak {fmt_bytes(r['peak_bytes'])} (measured)"
    budget = "" if r.get("budget_bytes") is None else f" of a {fmt_bytes(r['budget_bytes'])} budget"
    return (f"{head}step {r['step']}  loss {loss}{peak}{budget if peak else ''}  "
            f"weights sha256 {(r.get('weights_sha256') or '-')[:16]}")


@subcommand("train", "a real training run with checkpoints and exact resume", _train_args, _train_line)
def _train(args: argparse.Namespace) -> dict:
    from .train import check_sizes, train

    if args.plan and len(args.plan) > 1:
        raise ValueError(f"train takes one --plan (got {len(args.plan)}): join tokens with '+'; to compare plans use bench")
    check_sizes(args.batch, args.seq, args.steps)
    det = _deterministic(args)
    _no_offload_sim_on_ranks(args)
    if args.t4:
        emulate_t4()
    from .distributed import torchrun_world

    if args.world_size > 1 or torchrun_world():  # --world-size N spawns the ranks; torchrun started them
        from .distributed import train_sharded

        if args.data is not None:
            raise ValueError("--data with --world-size: sharded runs train on colabkit's own text for now (each rank "
                             "its rows of the same batches); drop --world-size to train on your batches")

        return train_sharded(args.model, (args.plan or ["baseline"])[0], world_size=args.world_size, steps=args.steps,
                             batch=args.batch, seq=args.seq, seed=args.seed, device=args.device, lr=args.lr,
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                             resume=bool(args.resume))
    out = train(model_arg(args.model), data=data_arg(args.data), plan=(args.plan or ["baseline"])[0], steps=args.steps,
                batch=args.batch, seq=args.seq,
                seed=args.seed, device=args.device, lr=args.lr, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every, checkpoint_minutes=args.checkpoint_minutes,
                resume=args.resume, progress=sys.stderr.isatty(), keep=args.keep, on_oom=args.on_oom,
                track=not args.no_track, log=args.log, log_dir=args.log_dir, offload_sim=args.offload_sim,
                deterministic=det, budget_bytes=args.budget_bytes)
    keys = ("step", "loss", "weights_sha256", "complete", "losses", "accum", "oom_shrinks", "resumed_from", "simulated")
    # the tracker's measured peak of the steps this command trained (none with --no-track, or when none was left)
    report = (out.get("report") or {}) if not out.get("complete") else {}
    return {"plan": out.get("plan"), **{k: out[k] for k in keys}, "peak_bytes": report.get("peak_bytes"),
            "budget_bytes": args.budget_bytes}


LIBRARY_LOGGERS = ("transformers", "peft", "accelerate", "bitsandbytes", "torchao", "huggingface_hub", "torch")


@contextlib.contextmanager
def _quiet_libraries():
    """Other libraries' warnings and log lines stay out of the CLI's output (colabkit's own warnings are
    shown); ``-W`` / ``PYTHONWARNINGS`` given by the user take precedence."""
    if sys.warnoptions:
        yield
        return
    loggers = [logging.getLogger(n) for n in LIBRARY_LOGGERS]
    levels = [lg.level for lg in loggers]
    plain = warnings.formatwarning

    def said(message, category, filename, lineno, line=None):  # a command has no line of the user's to show
        if issubclass(category, ColabkitWarning):
            return f"{category.__name__}: {message}\n"
        return plain(message, category, filename, lineno, line)
    with warnings.catch_warnings():
        warnings.formatwarning = said
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", module=r"colabkit(\.|$)")
        warnings.filterwarnings("default", category=ColabkitWarning)  # attributed to a caller's line
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            warnings.formatwarning = plain
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand, those other modules register included."""
    from . import techniques  # noqa: F401  (registers plan tokens and subcommands)
    from .estimate.cli import register_cli; register_cli(subcommand)  # noqa: E702  (estimate, plan, largest)
    from .structured import register_cli as structured_cli; structured_cli(subcommand)  # noqa: E702  (structured)
    from .selftest import register_cli as selftest_cli; selftest_cli(subcommand)  # noqa: E702  (selftest)

    parser = argparse.ArgumentParser(prog="colabkit", description="GPU memory for training, measured. "
                                     "Every subcommand prints a table, or JSON with --json PATH ('-' for stdout).")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, _, _, help_) in _COMMANDS.items():
        sp = subs.add_parser(name, help=help_, description=help_)
        add_args(sp)
        sp.add_argument("--json", metavar="PATH", default=None, help="write JSON to PATH ('-' for stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _, run, printer, _ = _COMMANDS[args.command]
    from .plan import PlanError
    from .distributed import torchrun_world
    from .train import check_device

    torchrun_rank = int(os.environ["RANK"]) if torchrun_world() else 0  # one rank of a torchrun launch

    # with --json - stdout carries the JSON only: progress and messages go to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext()
    try:
        with quiet, _quiet_libraries():
            check_device(getattr(args, "device", None))
            if args.command in ("estimate", "plan", "bench") and getattr(args, "world_size", 1) == 1:
                args.model = model_arg(args.model)  # FILE.py:FN / package.module:FN: your own model, as train takes it
            result = run(args)
    except (PlanError, ValueError, ImportError, OSError) as e:  # a user mistake: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if torchrun_rank != 0:
        return 0  # a torchrun rank other than 0: rank 0 prints the run's result
    emit(result, args.json, printer)
    if isinstance(result, dict) and (result.get("ok") is False
                                     or any(not r.get("ok", True) for r in result.get("results", []))):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

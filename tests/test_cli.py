"""The command line as a newcomer meets it (issue 26): the README's own train line on a fresh folder, run
twice; the default checkpoint cadence; `largest` when nothing fits; offline hub ids, a missing GPU and bad
sizes as one-line errors; output without other libraries' noise; --help for every flag; the console script
and the repository's hygiene."""
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import warnings

import pytest
import torch

from colabkit.__main__ import build_parser, main
from colabkit.checkpoints import list_checkpoints
from colabkit.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _cli(*args, env=None, timeout=300):
    return subprocess.Popen([sys.executable, "-m", "colabkit", *args], env=env or ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _readme_train_line() -> list[str]:
    """The README's `train ... --resume` command, as its arguments."""
    with open(os.path.join(ROOT, "README.md")) as f:
        m = re.search(r"python -m colabkit (train [^\n\\]*--resume)", f.read())
    assert m, "the README lost its train ... --resume line"
    return shlex.split(m.group(1))


# ----- items 1 and 2: --resume on a fresh folder, a finished run, --steps below the newest checkpoint ---------
def test_readme_train_line_on_a_fresh_folder_twice(tmp_path, monkeypatch, capsys):
    argv = _readme_train_line()
    assert "--checkpoint-dir" in argv and "--resume" in argv and "--batch" not in argv and "--seq" not in argv
    # the README's line with every flag it gives (steps, checkpoint folder and cadence, --resume); the batch shape it
    # leaves to the defaults (8 x 128) is made 2 x 16 here: the resume contract does not depend on it, the time does
    argv += ["--batch", "2", "--seq", "16"]
    monkeypatch.chdir(tmp_path)  # a fresh clone: no ckpt/ yet
    assert main(argv + ["--no-track"]) == 0  # the tracker changes no number; untracked is faster on a CPU
    first = capsys.readouterr()
    assert "nothing to resume in ckpt (the folder does not exist yet): starting a fresh run" in first.out
    step, loss, sha = re.search(r"^step (\d+)  loss ([\d.]+)  weights sha256 (\w+)$", first.out, re.M).groups()

    assert main(argv + ["--no-track"]) == 0  # run again: complete, nothing trained, the same numbers reported
    again = capsys.readouterr()
    assert f"is complete: step {step} of {step}, final loss {loss}, weights sha256 {sha}" in again.out
    assert re.search(rf"^run complete, nothing to train: step {step}  loss {loss}  weights sha256 {sha}$", again.out, re.M)

    assert main(argv[:argv.index("--steps") + 1] + ["50"] + argv[argv.index("--steps") + 2:]) == 2
    below = capsys.readouterr()
    assert below.err.count("\n") == 1 and below.err.startswith("error: steps=50 is below the newest checkpoint in ckpt")
    assert f"step {step})" in below.err and "another checkpoint folder" in below.err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_resume_must_wants_a_checkpoint(tmp_path, capsys):
    assert main(["train", "--model", "gpt:2x64", "--steps", "1", "--batch", "2", "--seq", "16", "--no-track",
                 "--checkpoint-dir", str(tmp_path / "none"), "--resume", "must"]) == 2
    assert "resume folder" in capsys.readouterr().err and not os.path.exists(tmp_path / "none")


# ----- item 5: only --checkpoint-dir: a checkpoint every 10 minutes of wall time, said at the start ---------
def test_default_cadence_is_by_wall_time(tmp_path, monkeypatch, capsys):
    now = [0.0]

    def clock():  # each reading is 4 minutes later: the 10-minute checkpoint falls after step 3
        now[0] += 240.0
        return now[0]

    def killed(info):  # the runtime dies after step 5, before any end-of-run checkpoint
        if info["step"] == 5:
            raise KeyboardInterrupt

    kw = dict(batch=2, seq=16, seed=1, device="cpu", progress=False, track=False)
    monkeypatch.setattr(sys.modules["colabkit.train"], "_clock", clock)  # the module: colabkit.train is the function
    with pytest.raises(KeyboardInterrupt):
        train("gpt:2x64", steps=8, checkpoint_dir=str(tmp_path), callbacks=[killed], **kw)
    assert "every 10 min of wall time and at the end" in capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3]
    monkeypatch.undo()
    resumed = train("gpt:2x64", steps=8, checkpoint_dir=str(tmp_path), resume=True, **kw)
    assert resumed["resumed_from"].endswith("ckpt-00000003.ckpt")
    assert resumed["weights_sha256"] == train("gpt:2x64", steps=8, **kw)["weights_sha256"]
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 8]  # and one at the end


# ----- item 4 and the tables: largest with nothing that fits, largest's verdict, plan's header --------------
def test_largest_nothing_fits_says_what_would(monkeypatch, capsys, tmp_path):
    cli = sys.modules["colabkit.estimate.cli"]

    seen, real = {}, cli.largest

    def remembered(plan, **kw):
        key = (plan, tuple(sorted(kw.items())))
        seen[key] = seen.get(key) or real(plan, **kw)
        return dict(seen[key])

    monkeypatch.setattr(cli, "largest", remembered)
    out = str(tmp_path / "l.json")
    assert main(["largest", "--plan", "baseline", "--seq", "100000", "--gpu", "t4"]) == 1
    text = capsys.readouterr().out
    assert text.startswith("nothing fits plan baseline on t4, seq 100000, batch 1: even the smallest GPT (gpt:")
    m = re.search(r"^  --seq (\d+) with plan baseline: up to (gpt:\S+) \(([\d.]+) B parameters\)$", text, re.M)
    assert m and int(m[1]) < 100000, text
    assert main(["largest", "--plan", "baseline", "--seq", m[1], "--gpu", "t4", "--json", out]) == 0  # remembered
    r = json.load(open(out))
    assert r["model"] == m[2] and r["ok"] and r["verdict"] in ("fits", "tight")
    assert main(["largest", "--plan", "baseline", "--seq", m[1], "--gpu", "t4"]) == 0
    header, row, note = capsys.readouterr().out.splitlines()[-3:]
    assert header.split() == ["plan", "largest", "model", "parameters", "device", "need", "+-", "uncertainty", "verdict"]
    assert re.fullmatch(rf"baseline +{re.escape(m[2])} +{m[3]} B +[\d.]+ [KMG]iB \+- [\d.]+ [KMG]iB +{r['verdict']}", row)
    assert "'tight' fits only inside the overheads' uncertainty" in note


def test_largest_given_a_model_says_which_command_asks_about_it(capsys, monkeypatch):
    """largest searches model shapes: a --model is answered with the commands that ask about that model, in one
    line, before any search runs (argparse said only "unrecognized arguments", under the top-level usage)."""
    cli = sys.modules["colabkit.estimate.cli"]
    monkeypatch.setattr(cli, "largest", lambda *a, **k: pytest.fail("searched"))
    assert main(["largest", "--model", "gpt2-124m", "--plan", "checkpoint", "--seq", "256", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: largest takes no --model") and err.count("\n") == 1, err
    same = "--model gpt2-124m --batch 1 --seq 256 --device cpu"  # the user's options kept
    assert f"python -m colabkit plan {same} (" in err and f"python -m colabkit estimate {same} --plan checkpoint" in err


def test_plan_table_has_a_header_and_says_what_its_percentage_means(monkeypatch, capsys):
    cli = sys.modules["colabkit.estimate.cli"]

    real = cli.plans
    monkeypatch.setattr(cli, "plans", lambda *a: real(*a, candidates=["baseline", "checkpoint"]))
    assert main(["plan", "--model", "gpt-tiny", "--batch", "2", "--seq", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["verdict", "tensors", "peak", "device", "need", "+-", "uncertainty", "step", "time",
                                "s/step", "tokens/s", "plan"]
    assert re.fullmatch(r"fits +[\d.]+ [KMG]?i?B +[\d.]+ [KMG]iB \+-[\d.]+ [KMG]iB +\+0% +[\d.e-]+ +[\d,]+  baseline", lines[1])
    assert re.fullmatch(r"fits .* +\+\d+% +[\d.e-]+ +[\d,]+  checkpoint", lines[2])
    assert "relative to baseline's (+33% = a third slower" in lines[3]


# ----- item 6: an unreachable hub, no GPU, bad sizes: one line, exit 2, in seconds --------------------------
def _check_hub_offline_error(rc: int, err: str, took: float) -> None:
    assert rc == 2, err[-2000:]
    assert err.count("\n") == 1 and err.startswith("error: hf:nonexistent/xyz is not in this machine's Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in err and "HF_HUB_ETAG_TIMEOUT" in err and "shipped_hub_ids()" in err
    assert took < 30, f"{took:.0f} s"  # before: 5 retries with back-off per lookup (74 s here), then a traceback


def test_hf_id_offline_fails_in_seconds_in_process(monkeypatch, capsys):
    """Fast twin of test_hf_id_offline_fails_in_seconds_with_what_to_do: the same command through ``main``, the hub
    at the same dead address (huggingface_hub's endpoint, which HF_ENDPOINT sets when it is imported) and the hub's
    answer forgotten (colabkit asks once per process). Negative control: with HF_HUB_OFFLINE set the same error
    gives that reason instead of asking the address."""
    import colabkit.models as models
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the hub cannot be reached
    monkeypatch.setattr(models, "_HUB_STATUS", {})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = main(["train", "--model", "hf:nonexistent/xyz", "--steps", "1"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    _check_hub_offline_error(rc, err, took)
    assert "http://127.0.0.1:9 did not answer within" in err  # it asked the dead address, and said so
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "--model", "hf:nonexistent/xyz", "--steps", "1"]) == 2
    offline = capsys.readouterr().err
    assert "(HF_HUB_OFFLINE is set)" in offline and "127.0.0.1:9" not in offline


@pytest.mark.slow  # fast twin: test_hf_id_offline_fails_in_seconds_in_process
def test_hf_id_offline_fails_in_seconds_with_what_to_do():
    env = {**ENV, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there: the hub cannot be reached
    env.pop("HF_HUB_OFFLINE", None)
    t0 = time.monotonic()
    p = _cli("train", "--model", "hf:nonexistent/xyz", "--steps", "1", env=env)
    out, err = p.communicate(timeout=120)
    took = time.monotonic() - t0
    _check_hub_offline_error(p.returncode, err, took)


def test_shipped_config_works_offline(monkeypatch):
    import colabkit.models as models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set"
    assert models.hub_config("Qwen/Qwen2.5-0.5B").hidden_size == 896  # shipped: no hub needed
    with pytest.raises(models.HubError, match=r"cannot be reached \(HF_HUB_OFFLINE is set\)"):
        models.hub_config("nonexistent/xyz")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("cmd", ["train", "bench"])
def test_device_cuda_without_gpu_is_one_line(cmd, capsys):
    assert main([cmd, "--model", "gpt:2x64", "--steps", "1", "--batch", "2", "--seq", "16", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: device 'cuda': torch sees no CUDA GPU on this machine")
    assert "Runtime -> Change runtime type -> T4 GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("cmd", ["train", "bench"])
def test_bad_sizes_refused_alike(cmd, capsys):
    assert main([cmd, "--model", "gpt:2x64", "--batch", "-4", "--seq", "16", "--steps", "1"]) == 2
    assert capsys.readouterr().err == "error: batch must be a positive whole number of sequences per step, got -4\n"


# ----- item 7: output a reader can use, nothing from other libraries ----------------------------------------
def _clean_runs(tmp_path) -> dict[str, list[str]]:
    return {
        "env": ["env"],
        "bench": ["bench", "--model", "gpt:2x64", "--steps", "1", "--batch", "2", "--seq", "16", "--plan", "galore:4",
                  "--plan", "qlora:4", "--plan", "adam-mini"],
        "train": ["train", "--model", "gpt:2x64", "--steps", "2", "--batch", "2", "--seq", "16", "--plan", "lora:4",
                  "--checkpoint-dir", str(tmp_path / "c"), "--log", "csv", "--log-dir", str(tmp_path / "log")],
        "estimate": ["estimate", "--model", "gpt:2x64", "--plan", "qlora:4", "--seq", "64"],
        "estimate hf": ["estimate", "--model", "hf:openai-community/gpt2", "--plan", "qlora:8", "--seq", "128"],
        "structured": ["structured", "--n", "128", "--rank", "4"],
    }


def _check_clean_output(outs: dict[str, tuple[str, str]]) -> None:
    est = outs["estimate"][0]
    assert not re.search(r"\d{1,3}(,\d{3})+ B", est) and "stand-in" not in est
    assert re.search(r"the trace ran lora with 16-bit frozen weights \([\d.]+ [KMG]iB\); params counts them as the run "
                     r"stores them \([\d.]+ [KMG]iB\), [\d.]+ [KMG]iB less", est), est
    assert "each category: its own peak; step s: seconds per optimizer step" in outs["bench"][0]


_ONE_PROCESS = """import json, sys
from colabkit.__main__ import main
for name, args in json.loads(sys.argv[1]).items():
    print(f"=== {name}", flush=True)
    print(f"=== {name}", file=sys.stderr, flush=True)
    print(f"=== rc {main(args)}", flush=True)
"""


def _python_default_warning_filters() -> None:
    """The warning filters a fresh ``python`` starts with (no -W, no PYTHONWARNINGS), in place of pytest's."""
    warnings.resetwarnings()  # the default action for the rest: "default" (shown once per place)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def _run_quiet(args: list[str], capfd, caplog) -> tuple[int, str, str]:
    """``main(args)`` with what a fresh process would show on its stderr: what reached the process's file
    descriptors 1 and 2 (capfd), every warning the command's filters let through (here recorded instead of
    printed: pytest's own warning filters replaced by Python's defaults) and every log record of level WARNING or
    above (in a process without logging set up, Python prints those to stderr), after stderr's text."""
    capfd.readouterr()
    caplog.clear()
    with warnings.catch_warnings(record=True) as shown:
        _python_default_warning_filters()
        rc = main(args)
    out, err = capfd.readouterr()
    err += "".join(f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}\n" for w in shown)
    err += "".join(f"{r.name}: {r.levelname}: {r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
    return rc, out, err


def test_cli_output_is_clean_in_process(tmp_path, monkeypatch, capfd, caplog):
    """Fast twin of test_cli_output_is_clean_in_one_process: the same six
    commands through the same ``main``, in this process; for each, what it wrote to stdout and stderr, the warnings
    it let through and its log records at WARNING and above (what a process would print on stderr) must be none.
    (What a library prints when it is first imported, and a fresh interpreter, are the real-process tests'.)
    Negative controls: a command that writes an error to stderr is seen, and so is a warning raised by colabkit."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = _clean_runs(tmp_path)
    outs = {}
    for k, args in runs.items():
        rc, out, err = _run_quiet(args, capfd, caplog)
        assert rc == 0, (k, err[-2000:])
        assert err == "", f"{k} wrote to stderr: {err[:2000]}"  # no warnings, no 'Failed to load'
        outs[k] = (out, err)
    _check_clean_output(outs)
    # negative controls: an error on stderr, and a warning of colabkit's own (the CLI shows those) raised in a command
    rc, _, err = _run_quiet(["estimate", "--model", "gpt:2x64", "--plan", "no-such-token"], capfd, caplog)
    assert rc != 0 and "no-such-token" in err, err
    cli, real_env = sys.modules["colabkit.__main__"], sys.modules["colabkit.__main__"].env

    def warning_env():  # stacklevel 2: the warning is the caller's, colabkit.__main__'s
        warnings.warn("a warning of colabkit's", UserWarning, stacklevel=2)
        return real_env()

    monkeypatch.setattr(cli, "env", warning_env)
    rc, _, err = _run_quiet(["env"], capfd, caplog)
    assert rc == 0 and "UserWarning: a warning of colabkit's" in err, err


@pytest.mark.slow  # fast twin: test_cli_output_is_clean_in_process
def test_cli_output_is_clean_in_one_process(tmp_path):
    """The six commands as a user runs them, through the same ``main``, one after another in one fresh process
    (one interpreter start and one set of imports; six processes took 27 s of the suite for the same check):
    a library's import noise or a warning shows on stderr as it does there (a warning repeated at the same
    place is printed once per process, so the first command to raise it fails). Negative control: a
    command that writes to stderr is seen, and attributed to its command."""
    runs = _clean_runs(tmp_path)
    runs["noisy"] = ["estimate", "--model", "gpt:2x64", "--plan", "no-such-token"]
    p = subprocess.run([sys.executable, "-c", _ONE_PROCESS, json.dumps(runs)], env={**ENV, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = {k: (o, rc) for k, o, rc in re.findall(r"^=== (?!rc )(.+?)\n(.*?)^=== rc (-?\d+)$", p.stdout, re.S | re.M)}
    err = dict(re.findall(r"^=== (.+?)\n(.*?)(?=^=== |\Z)", p.stderr, re.S | re.M))
    assert list(out) == list(err) == list(runs), (p.stdout[-2000:], p.stderr[-2000:])
    for k in runs:
        if k != "noisy":
            assert out[k][1] == "0", (k, err[k][-2000:])
            assert err[k] == "", f"{k} wrote to stderr: {err[k][:2000]}"  # no warnings, no 'Failed to load'
    assert out["noisy"][1] != "0" and "no-such-token" in err["noisy"], err["noisy"]  # negative control
    _check_clean_output(out)


# ----- item 8: --help for every flag of every subcommand ----------------------------------------------------
def test_every_flag_of_every_subcommand_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command")
    assert {"env", "bench", "train", "estimate", "plan", "largest", "calibrate", "structured"} <= set(subs.choices)
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, sp in subs.choices.items() for a in sp._actions
               if a.dest != "help" and not (a.help or "").strip()]
    assert missing == []
    assert all(sp.description for sp in subs.choices.values())
    train_plan = next(a for a in subs.choices["train"]._actions if a.dest == "plan")
    assert train_plan.help.startswith("one plan") and "repeat" not in train_plan.help


# ----- item 9: the console script, .gitignore, a self-contained CONTRIBUTING.md -----------------------------
def test_console_script_entry_point(capsys):
    from importlib.metadata import EntryPoint

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        value = tomllib.load(f)["project"]["scripts"]["colabkit"]
    entry = EntryPoint(name="colabkit", value=value, group="console_scripts").load()
    assert entry is main
    with pytest.raises(SystemExit) as e:
        entry(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: colabkit ")


def test_what_runs_leave_behind_is_ignored():
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    names = [".venv/", "ckpt/", "runs/", "report/", "colabkit-oom-snapshot.json", "notebooks/memory_snapshot.json"]
    p = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=ROOT, capture_output=True, text=True)
    assert sorted(p.stdout.split()) == sorted(names)


def test_contributing_is_self_contained():
    with open(os.path.join(ROOT, "CONTRIBUTING.md")) as f:
        text = f.read()
    assert "../" not in text and "DESIGN.md" not in text  # nothing outside the repository
    for must in ("python -m pytest", "make test", "## Layout", "## Adding a technique", "## Adding a notebook"):
        assert must in text, must
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    for tool in re.findall(r"`(nbstripout|ruff|black|flake8|mypy)\b", text):  # every tool it names is installed
        assert any(d.startswith(tool) for d in dev), tool


def test_json_to_a_reader_that_left_is_not_a_traceback():
    """`colabkit ... --json - | head`: the reader closed the pipe before the JSON was written; the command says
    nothing on stderr and exits 0 (was: BrokenPipeError traceback). Negative control: stdout read, same JSON."""
    p = _cli("env", "--json", "-")
    p.stdout.close()  # the reader is gone before anything is written
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    p = _cli("env", "--json", "-")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "platform" in json.loads(out)

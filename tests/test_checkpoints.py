"""Streaming, validated checkpoints: exact resume after SIGKILL (CLI), fallback past a damaged newest
checkpoint, refusal of another model/plan, every optimizer kind, and the host memory a save costs.
Loading never runs code (issue 28): a manifest that carries a pickle is skipped, a value that is not data
is refused when saving, no torch.load/pickle in colabkit un-pickles, memory snapshots are read as data."""
import base64
import contextlib
import json
import os
import pickle
import struct
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from colabkit.checkpoints import MAGIC, CheckpointError, list_checkpoints, read_checkpoint, read_latest, write_checkpoint
from colabkit.plan import PlanError
from colabkit.train import train
from forking import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "colabkit", "train", "--model", "gpt:4x128", "--plan", "adamw8bit", "--steps", "40",
       "--batch", "4", "--seq", "64", "--seed", "7", "--device", "cpu", "--json", "-",
       "--no-track"]  # the tracker's dispatch mode makes CPU steps ~6x slower; it changes no number


@contextlib.contextmanager
def one_thread():
    """In-process references for the CLI (ENV: one thread): a CPU matmul sums in another order with
    another thread count, so weights are bit-identical only at the same count (``make test`` has 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cli(*extra, check=True):
    p = subprocess.run(CLI + list(extra), env=ENV, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def _sha(p):
    return json.loads(p.stdout[p.stdout.index("{"):])["weights_sha256"]


@pytest.mark.slow  # fast twin: test_cli_killed_run_resumes_and_falls_back_in_process
def test_cli_sigkill_resume_and_fallback(tmp_path):
    d = str(tmp_path / "ckpt")
    # the uninterrupted run, in-process through the function the CLI calls (untracked: faster, same numbers)
    with one_thread():
        reference = train("gpt:4x128", plan="adamw8bit", steps=40, batch=4, seq=64, seed=7, device="cpu",
                          progress=False, track=False)["weights_sha256"]
    proc = subprocess.Popen(CLI + ["--checkpoint-dir", d, "--checkpoint-every", "5"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if len(list_checkpoints(d)) >= 2:  # a few checkpoints written: kill it mid-run, no clean-up
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = list_checkpoints(d)[-1][0]
    assert 10 <= killed_at < 40
    resumed = _cli("--checkpoint-dir", d, "--checkpoint-every", "5", "--resume")
    assert json.loads(resumed.stdout[resumed.stdout.index("{"):])["resumed_from"].endswith(f"ckpt-{killed_at:08d}.ckpt")
    assert _sha(resumed) == reference  # bit-identical to the uninterrupted run
    # the newest checkpoint (step 40) cut short: --resume skips it, takes step 35 and finishes the same
    newest = list_checkpoints(d)[-1][1]
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    again = _cli("--checkpoint-dir", d, "--checkpoint-every", "5", "--resume")
    assert "skipped checkpoint ckpt-00000040.ckpt" in again.stderr
    assert json.loads(again.stdout[again.stdout.index("{"):])["resumed_from"].endswith("ckpt-00000035.ckpt")
    assert _sha(again) == reference
    names = sorted(os.listdir(d))
    assert names == ["ckpt-00000030.ckpt", "ckpt-00000035.ckpt", "ckpt-00000040.ckpt"]  # keep 3, no temp files


class _Killed(BaseException):
    """Stands for SIGKILL: no ``except Exception`` catches it, and ``train`` writes no end-of-run checkpoint."""


def test_cli_killed_run_resumes_and_falls_back_in_process(tmp_path, monkeypatch, capsys):
    """Fast twin of the SIGKILL test above, through the same CLI entry point in process: a run killed
    mid-way (step 8 of 12; checkpoints every 3) resumes from its newest checkpoint and ends bit-identical
    to the uninterrupted run; with the newest checkpoint cut short, --resume skips it, takes the one before
    and ends the same; 3 kept, no temp files."""
    from colabkit.__main__ import main
    train_mod = sys.modules["colabkit.train"]  # the module (colabkit.train is also the function's name)

    d = str(tmp_path / "ckpt")
    args = ["train", "--model", "gpt:2x64", "--plan", "adamw8bit", "--steps", "12", "--batch", "4", "--seq", "32",
            "--seed", "7", "--device", "cpu", "--json", "-", "--no-track", "--checkpoint-dir", d,
            "--checkpoint-every", "3"]
    reference = train("gpt:2x64", plan="adamw8bit", steps=12, batch=4, seq=32, seed=7, device="cpu",
                      progress=False, track=False)["weights_sha256"]

    def run(*extra):
        capsys.readouterr()
        assert main(args + list(extra)) == 0
        out = capsys.readouterr().out
        return json.loads(out[out.index("{"):])

    step = train_mod._step

    def killed_at_8(trainer, *a, **k):
        if trainer.step_count == 8:
            raise _Killed
        return step(trainer, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(train_mod, "_step", killed_at_8)
        with pytest.raises(_Killed):
            main(args)
    assert [s for s, _ in list_checkpoints(d)] == [3, 6]  # killed: nothing written after step 6
    resumed = run("--resume")
    assert resumed["resumed_from"].endswith("ckpt-00000006.ckpt")
    assert resumed["weights_sha256"] == reference  # bit-identical to the uninterrupted run
    newest = list_checkpoints(d)[-1][1]
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000012.ckpt"):
        again = run("--resume")
    assert again["resumed_from"].endswith("ckpt-00000009.ckpt")
    assert again["weights_sha256"] == reference
    assert sorted(os.listdir(d)) == ["ckpt-00000006.ckpt", "ckpt-00000009.ckpt", "ckpt-00000012.ckpt"]


@pytest.mark.parametrize("plan", ["adamw8bit", "adamw4bit", "fused-step", "sgd:0.9+accum:2", "lion8bit", "adafactor",
                                  "adam-mini", "fp16+checkpoint+adamw4bit", "lora:4", "qlora:4"])
def test_exact_resume_every_optimizer_kind(tmp_path, plan):
    kw = dict(plan=plan, batch=4, seq=32, seed=3, device="cpu", progress=False, track=False)
    full = train("gpt:2x64", steps=6, **kw)
    d = str(tmp_path)
    train("gpt:2x64", steps=3, checkpoint_dir=d, checkpoint_every=3, **kw)
    resumed = train("gpt:2x64", steps=6, checkpoint_dir=d, resume=True, **kw)
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["weights_sha256"] == full["weights_sha256"]


def test_resume_without_optimizer_state_differs(tmp_path, monkeypatch):
    """Negative control: the exact-resume check above detects a checkpoint that loses the optimizer state."""
    kw = dict(plan="adamw8bit", batch=4, seq=32, seed=3, device="cpu", progress=False, track=False)
    full = train("gpt:2x64", steps=6, **kw)
    train("gpt:2x64", steps=3, checkpoint_dir=str(tmp_path), checkpoint_every=3, **kw)
    # on a CPU the adamw8bit token is colabkit's AdamW8bit (bitsandbytes' kernel is the CUDA one)
    monkeypatch.setattr("colabkit.techniques.optimizers.AdamW8bit.load_state_dict", lambda self, sd: None)
    resumed = train("gpt:2x64", steps=6, checkpoint_dir=str(tmp_path), resume=True, **kw)
    assert resumed["weights_sha256"] != full["weights_sha256"]


def test_fallback_names_skipped_checkpoint(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3, 4):
        write_checkpoint({"w": torch.full((1000,), float(step)), "step": step}, d, step, keep=3)
    assert [s for s, _ in list_checkpoints(d)] == [2, 3, 4]
    newest = list_checkpoints(d)[-1][1]
    with open(newest, "r+b") as f:  # flip one byte of the tensor data: only the checksum can tell
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 0"):
        read_checkpoint(newest)
    with open(list_checkpoints(d)[-2][1], "r+b") as f:
        f.truncate(3000)
    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000004.ckpt: checksum"):
        state, path, skipped = read_latest(d)
    assert state["step"] == 2 and float(state["w"][0]) == 2.0
    assert [n for n, _ in skipped] == ["ckpt-00000004.ckpt", "ckpt-00000003.ckpt"]
    assert "truncated" in skipped[1][1]


def test_refuses_another_model_or_plan(tmp_path):
    d = str(tmp_path)
    kw = dict(steps=1, batch=2, seq=16, device="cpu", progress=False, track=False)
    train("gpt:2x64", plan="baseline", checkpoint_dir=d, **kw)
    with pytest.raises(PlanError, match="plan: checkpoint 'baseline', this run 'adamw8bit'"):
        train("gpt:2x64", plan="adamw8bit", checkpoint_dir=d, resume=True, **kw)
    with pytest.raises(PlanError, match=r"model: checkpoint 'gpt:2x64', this run 'gpt:2x32'.*n_embd=64 vs 32"):
        train("gpt:2x32", plan="baseline", checkpoint_dir=d, resume=True, **kw)


RSS_SCRIPT = textwrap.dedent("""
    import gc, json, sys, threading, time, io
    import psutil, torch
    from colabkit import build_model
    from colabkit.checkpoints import write_checkpoint

    model = build_model(sys.argv[2])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW state: exp_avg, exp_avg_sq for every parameter
    opt.zero_grad(set_to_none=True)
    gc.collect()
    proc = psutil.Process()

    def peak_during(fn):
        # free heap pages back to the OS first (glibc): a forked child inherits its parent's freed arenas, which an
        # allocation could reuse without growing RSS -- the control's in-memory save once showed 1 MB of 53
        gc.collect()
        try:
            __import__("ctypes").CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        base, peak, stop = proc.memory_info().rss, [0], threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)
        th = threading.Thread(target=sample); th.start()
        try:
            out = fn()
        finally:
            stop.set(); th.join()
        return max(peak[0], proc.memory_info().rss) - base, out

    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    delta, path = peak_during(lambda: write_checkpoint(state, sys.argv[1], 1))
    size = __import__("os").path.getsize(path)
    def old_way():  # what save_checkpoint did before: the checkpoint built in memory (the weights part here)
        buf = io.BytesIO(); torch.save(state["model"], buf); return buf.tell()
    old_delta, old_size = peak_during(old_way)
    print(json.dumps({"delta": delta, "size": size, "old_delta": old_delta, "old_size": old_size}))
""")


def _save_peak(tmp_path, model: str) -> dict:
    """RSS_SCRIPT in a forked child of this process (tests/forking.py): the count starts from the child's
    own RSS, without a fresh interpreter's imports (~5 s CPU)."""
    pytest.importorskip("psutil")
    out = run_script(RSS_SCRIPT, [str(tmp_path), model])
    r = json.loads(out.strip().splitlines()[-1])
    print(r)
    return r


def test_save_peak_host_memory_is_small_gpt_4x512(tmp_path):
    """Fast twin of the test below at 1/11 of its size: gpt:4x512 with AdamW state (~13M params, 0.16 GB),
    the same bounds (<= 10% of the checkpoint; the negative control ~ its size). Measured: the save 1 MB,
    torch.save into memory 53 MB (CPU, 2026-11-26). Run in a fork of the test process, as the slow test is."""
    r = _save_peak(tmp_path, "gpt:4x512")
    assert r["size"] > 0.15e9  # ~13M params x (4 + 8) bytes
    assert r["delta"] <= 0.10 * r["size"]
    assert r["old_delta"] >= 0.8 * r["old_size"]  # the sampling sees a save that holds the bytes in memory


@pytest.mark.slow  # fast twin: test_save_peak_host_memory_is_small_gpt_4x512
def test_save_peak_host_memory_is_small(tmp_path):
    """gpt:12x1024 with AdamW state: the save raises RSS by <= 10% of the checkpoint (psutil sampling
    around the save only, after the model and state exist); torch.save into memory, the negative control,
    raises it by about the checkpoint's size. In a forked child like its twin: the count is a rise over the
    child's own RSS just before the save, so a fresh interpreter's imports (~3 s of CPU) buy nothing."""
    r = _save_peak(tmp_path, "gpt:12x1024")
    assert r["size"] > 1.5e9  # ~151M params x (4 + 8) bytes
    assert r["delta"] <= 0.10 * r["size"]
    assert r["old_delta"] >= 0.8 * r["old_size"]  # the sampling sees a save that holds the bytes in memory


def test_drive_dir_local(tmp_path, monkeypatch, capsys):
    from colabkit.drive import drive_dir

    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.chdir(tmp_path)
    d = drive_dir("runs/local")
    assert d == str(tmp_path / "runs" / "local") and os.path.isdir(d)
    assert "in a local folder: not in Colab" in capsys.readouterr().out


def test_drive_dir_colab_mounts_once(tmp_path, monkeypatch, capsys):
    import types

    import colabkit.drive

    calls = []

    def mount(where):  # google.colab.drive.mount makes <where>/MyDrive appear
        calls.append(where)
        os.makedirs(os.path.join(where, "MyDrive"))

    fake = types.ModuleType("google.colab")
    fake.drive = types.SimpleNamespace(mount=mount)
    monkeypatch.setitem(sys.modules, "google.colab", fake)
    monkeypatch.setattr(colabkit.drive, "MOUNT_POINT", str(tmp_path / "drive"))
    d = colabkit.drive.drive_dir("runs/r1")
    assert calls == [str(tmp_path / "drive")]
    assert d == str(tmp_path / "drive" / "MyDrive" / "runs" / "r1") and os.path.isdir(d)
    assert "on Google Drive" in capsys.readouterr().out
    colabkit.drive.drive_dir("runs/r2")  # already mounted: no second mount
    assert len(calls) == 1


def _trained_and_resumed(make, data, folder: str):
    """``a = make(0)`` trained 3 steps and checkpointed into ``folder``; ``b = make(1)`` (other initial weights:
    everything must come from the checkpoint) loaded from it."""
    from colabkit.checkpoints import load_trainer, save_trainer

    a = make(0)
    for s in range(3):
        a.step(*data.batch(4, 32, step=s))
    save_trainer(a, folder)
    b = make(1)
    load_trainer(b, folder)
    return a, b


def test_exact_resume_offloaded_optimizer(tmp_path):
    """offload:optimizer's HostOptimizer (CPU, unpinned: the arithmetic the GPU path runs) resumes exactly."""
    from colabkit import TextData, Trainer, build_model, weights_sha256
    from colabkit.plan import param_groups
    from colabkit.techniques.offload import HostOptimizer

    def make(seed):
        torch.manual_seed(seed)
        t = Trainer(build_model("gpt:2x64"), "baseline", device="cpu")
        t.optimizer = HostOptimizer(param_groups(t.model, 0.1), lambda g: torch.optim.AdamW(g, lr=1e-3))  # CPU pair: unpinned
        return t

    data = TextData()
    a, b = _trained_and_resumed(make, data, str(tmp_path))
    for s in range(3, 6):
        a.step(*data.batch(4, 32, step=s))
        b.step(*data.batch(4, 32, step=s))
    assert weights_sha256(b.model) == weights_sha256(a.model)


def test_exact_resume_restores_the_grad_scaler(tmp_path):
    """fp16's GradScaler resumes with its scale and growth tracker: the scale (doubling every step here) sets how
    fp16 gradients round, so a resume that restarted the scaler would step differently (the negative control)."""
    from colabkit import TextData, Trainer, build_model, weights_sha256
    from colabkit.checkpoints import load_trainer

    def make(seed):
        torch.manual_seed(seed)
        t = Trainer(build_model("gpt:2x64"), "fp16", device="cpu")
        t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        return t

    data = TextData()
    a, b = _trained_and_resumed(make, data, str(tmp_path))
    fresh = make(1)
    load_trainer(fresh, str(tmp_path))
    fresh.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    assert b.scaler.state_dict() == a.scaler.state_dict() and a.scaler.get_scale() == 2.0 ** 13
    for s in range(3, 6):
        for t in (a, b, fresh):
            t.step(*data.batch(4, 32, step=s))
    assert weights_sha256(b.model) == weights_sha256(a.model) != weights_sha256(fresh.model)


# ----- loading never runs code (issue 28) --------------------------------------------------------------------
def plant_pickle(path: str, keys: tuple, value) -> None:
    """Replace the manifest value at ``keys`` (dict keys from the top of the state) with ``value`` and
    rewrite the manifest and its length; the tensor bytes and their checksums stay as they were."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 8 - len(MAGIC))
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(size - 8 - len(MAGIC) - n)
        man = json.loads(f.read(n))
        node = man["state"]
        for k in keys[:-1]:
            node = next(v for kk, v in node["__d__"] if kk == k)
        pair = next(p for p in node["__d__"] if p[0] == keys[-1])
        pair[1] = value
        text = json.dumps(man).encode()
        f.seek(size - 8 - len(MAGIC) - n)
        f.write(text + struct.pack("<Q", len(text)) + MAGIC)
        f.truncate()


class _CreatesFile:
    """Un-pickled, it calls open(path, "w"): the file appearing proves code from the checkpoint ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_pickled_callable_in_the_manifest_runs_nothing(tmp_path, capsys):
    d, marker = str(tmp_path / "ckpt"), tmp_path / "code-ran"
    kw = dict(plan="adamw8bit", batch=4, seq=32, seed=7, device="cpu", progress=False, track=False)
    reference = train("gpt:2x64", steps=6, **kw)["weights_sha256"]
    train("gpt:2x64", steps=4, checkpoint_dir=d, checkpoint_every=2, **kw)
    payload = pickle.dumps(_CreatesFile(str(marker)))
    control = tmp_path / "control"  # negative control: un-pickled as before, this payload does create its file
    pickle.loads(pickle.dumps(_CreatesFile(str(control))))
    assert control.exists()
    plant_pickle(list_checkpoints(d)[-1][1], ("versions", "torch"), {"__pickle__": base64.b64encode(payload).decode()})

    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000004.ckpt: refused for safety: the manifest "
                                            "holds a pickled Python object"):
        state, path, skipped = read_latest(d)
    assert not marker.exists()
    assert path.endswith("ckpt-00000002.ckpt") and state["step"] == 2 and "could run code" in skipped[0][1]

    # the CLI's resume, in process (the CLI entry point, as `python -m colabkit train ...` runs it)
    from colabkit.__main__ import main
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000004.ckpt: refused for safety"):
        assert main(CLI[3:] + ["--checkpoint-dir", d, "--checkpoint-every", "2", "--steps", "6", "--resume",
                    "--model", "gpt:2x64", "--seq", "32"]) == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    assert json.loads(out)["resumed_from"].endswith("ckpt-00000002.ckpt")  # --json -: stdout is JSON only
    assert json.loads(out)["weights_sha256"] == reference


def test_a_value_that_is_not_data_is_refused_when_saving(tmp_path):
    class Hook:
        pass

    with pytest.raises(CheckpointError, match=r"cannot save state\['optimizer'\]\['state'\]\[0\]\['hooks'\]\[1\]: a "
                                              r"test_checkpoints\.\S*Hook is not data"):
        write_checkpoint({"optimizer": {"state": {0: {"hooks": [1, Hook()]}}}}, str(tmp_path / "d"), 1)
    assert not os.path.exists(tmp_path / "d")  # refused before any file


def test_every_value_kind_is_encoded_explicitly(tmp_path):
    import numpy as np
    from galore_torch.galore_projector import GaLoreProjector

    proj = GaLoreProjector(4, update_proj_gap=7, scale=0.25)
    proj.ortho_matrix = torch.randn(4, 8)
    state = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "array": np.arange(5, dtype=np.uint32),
             "i64": np.int64(7), "f64": np.float64(0.5), "nan": float("nan"), "size": torch.Size([2, 3]),
             3: (1, "a", None, True), "projector": proj, "t": torch.arange(4, dtype=torch.int16)}
    out = read_checkpoint(write_checkpoint(state, str(tmp_path), 1))
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu") and out[3] == (1, "a", None, True)
    assert out["array"].dtype == np.uint32 and out["array"].tolist() == [0, 1, 2, 3, 4]
    assert type(out["i64"]) is np.int64 and out["i64"] == 7 and out["f64"] == 0.5 and out["nan"] != out["nan"]
    assert out["size"] == (2, 3) and torch.equal(out["t"], state["t"])
    p = out["projector"]
    assert type(p) is GaLoreProjector and (p.rank, p.update_proj_gap, p.scale, p.proj_type) == (4, 7, 0.25, "std")
    assert torch.equal(p.ortho_matrix, proj.ortho_matrix)
    # a manifest that names a class colabkit never writes, or a dtype that is not one, is refused
    for value, why in (({"__obj__": "subprocess.Popen", "attrs": {"__d__": []}}, "class 'subprocess.Popen'"),
                       ({"__dtype__": "load"}, "unknown dtype 'load'")):
        write_checkpoint({"x": 1}, str(tmp_path / "bad"), 1)
        plant_pickle(list_checkpoints(str(tmp_path / "bad"))[-1][1], ("x",), value)
        with pytest.raises(CheckpointError, match=why):
            read_checkpoint(list_checkpoints(str(tmp_path / "bad"))[-1][1])


def test_nothing_in_colabkit_unpickles():
    """The issue's check: `grep -rn "pickle.loads\\|weights_only=False" colabkit` finds nothing."""
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "colabkit")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    hits += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                             if "pickle.loads" in line or "weights_only=False" in line]
    assert hits == []


def test_memory_snapshot_is_read_as_data(tmp_path):
    from colabkit.memory import show_snapshot

    plain = tmp_path / "plain.pickle"
    plain.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    assert "<" in str(getattr(show_snapshot(str(plain)), "data", ""))  # CUDA's trace viewer got plain data
    marker, evil = tmp_path / "code-ran", tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [_CreatesFile(str(marker))]}))
    with pytest.raises(ValueError, match=r"refused: this snapshot asks to load .*open; a memory snapshot holds plain data"):
        show_snapshot(str(evil))
    assert not marker.exists()


def test_sharded_checkpoint_metadata_runs_nothing(tmp_path, monkeypatch):
    """ZeRO runs resume through torch.distributed.checkpoint, which un-pickles the folder's .metadata: colabkit
    reads it as data first, so a .metadata that would call open() is refused by consolidate and load_sharded."""
    import shutil
    import warnings
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from colabkit.distributed import consolidate, load_sharded

    model = torch.nn.Linear(4, 4)
    good = tmp_path / "good"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...: assuming a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(good / "dcp"), no_dist=True)
    assert torch.equal(consolidate(str(good))["weight"], model.weight)  # a genuine checkpoint loads
    for name in ("evil", "control"):
        shutil.copytree(good, tmp_path / name)
        (tmp_path / name / "dcp" / ".metadata").write_bytes(pickle.dumps(_CreatesFile(str(tmp_path / f"{name}-ran"))))
    with pytest.raises(BaseException):  # negative control: torch's own loader runs the planted call (then fails)
        dcp_to_torch_save(str(tmp_path / "control" / "dcp"), str(tmp_path / "out.pt"))
    assert (tmp_path / "control-ran").exists()

    with pytest.raises(CheckpointError, match=r"refused for safety: .*asks to load io\.open"):
        consolidate(str(tmp_path / "evil"))
    torch.save({}, tmp_path / "evil" / "rank0.pt")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    with pytest.raises(CheckpointError, match="refused for safety"):
        load_sharded(SimpleNamespace(plan="zero:3"), str(tmp_path / "evil"))
    assert not (tmp_path / "evil-ran").exists()


# ----- issue 34 item 9: a checkpoint of a 2xT4 run resumed on one T4 ------------------------------------------
def _one_gpu(monkeypatch):
    """torch.cuda as one GPU sees it: ``set_rng_state_all`` sets device i's state for the i-th entry, as
    torch's does, so an entry past the last device fails (the error a 2xT4 state gives on one T4)."""
    restored = {}

    def set_rng_state_all(states):
        for i, s in enumerate(states):
            if i >= torch.cuda.device_count():
                raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
            restored[i] = s
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    return restored


def test_two_gpu_rng_state_restores_on_one_gpu(monkeypatch):
    from colabkit.checkpoints import rng_state, set_rng_state
    from colabkit.models import build_model
    from colabkit.trainer import Trainer

    trainer = Trainer(build_model("gpt-tiny"), "baseline", device="cpu")
    state = {**trainer.state_dict(), "rng_cuda": [torch.full((16,), 1, dtype=torch.uint8),
                                                  torch.full((16,), 2, dtype=torch.uint8)]}
    saved = {**rng_state(), "cuda": state["rng_cuda"]}
    restored = _one_gpu(monkeypatch)
    with pytest.raises(RuntimeError, match="invalid device ordinal 1"):  # negative control: the stand-in refuses
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    restored.clear()
    trainer.load_state_dict(state)  # Trainer's own state (trainer.py): failed before the slice
    assert list(restored) == [0] and torch.equal(restored[0], state["rng_cuda"][0])
    restored.clear()
    set_rng_state(saved)  # a checkpoint's (checkpoints.py)
    assert list(restored) == [0] and torch.equal(restored[0], state["rng_cuda"][0])

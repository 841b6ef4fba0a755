"""Streaming, validated checkpoints: exact resume after SIGKILL (CLI), fallback past a damaged newest
checkpoint, refusal of another model/plan, every optimizer kind, and the host memory a save costs."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from colabkit.checkpoints import CheckpointError, list_checkpoints, read_checkpoint, read_latest, write_checkpoint
from colabkit.plan import PlanError
from colabkit.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "colabkit", "train", "--model", "gpt:4x128", "--plan", "adamw8bit", "--steps", "40",
       "--batch", "4", "--seq", "64", "--seed", "7", "--device", "cpu", "--json", "-",
       "--no-track"]  # the tracker's dispatch mode makes CPU steps ~6x slower; it changes no number


def _cli(*extra, check=True):
    p = subprocess.run(CLI + list(extra), env=ENV, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def _sha(p):
    return json.loads(p.stdout[p.stdout.index("{"):])["weights_sha256"]


def test_cli_sigkill_resume_and_fallback(tmp_path):
    d = str(tmp_path / "ckpt")
    # the uninterrupted run, in-process through the function the CLI calls (untracked: faster, same numbers)
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


@pytest.mark.parametrize("plan", ["adamw8bit", "adamw4bit", "fused-step", "sgd:0.9+accum:2"])
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
    monkeypatch.setattr("bitsandbytes.optim.optimizer.Optimizer8bit.load_state_dict", lambda self, sd: None)
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

    model = build_model("gpt:12x1024")
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW state: exp_avg, exp_avg_sq for every parameter
    opt.zero_grad(set_to_none=True)
    gc.collect()
    proc = psutil.Process()

    def peak_during(fn):
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


def test_save_peak_host_memory_is_small(tmp_path):
    """gpt:12x1024 with AdamW state: the save raises RSS by <= 10% of the checkpoint (psutil sampling
    around the save only, after the model and state exist); torch.save into memory, the negative control,
    raises it by about the checkpoint's size."""
    pytest.importorskip("psutil")
    p = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path)], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(r)
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


def test_exact_resume_offloaded_optimizer(tmp_path):
    """offload:optimizer's HostOptimizer (CPU, unpinned: the arithmetic the GPU path runs) resumes exactly."""
    from colabkit import TextData, Trainer, build_model, weights_sha256
    from colabkit.checkpoints import load_trainer, save_trainer
    from colabkit.plan import param_groups
    from colabkit.techniques.offload import HostOptimizer

    def make(seed):
        torch.manual_seed(seed)
        t = Trainer(build_model("gpt:2x64"), "baseline", device="cpu")
        t.optimizer = HostOptimizer(param_groups(t.model, 0.1), lambda g: torch.optim.AdamW(g, lr=1e-3))  # CPU pair: unpinned
        return t

    data = TextData()
    a = make(0)
    for s in range(3):
        a.step(*data.batch(4, 32, step=s))
    save_trainer(a, str(tmp_path))
    b = make(1)  # other initial weights: everything must come from the checkpoint
    load_trainer(b, str(tmp_path))
    for s in range(3, 6):
        a.step(*data.batch(4, 32, step=s))
        b.step(*data.batch(4, 32, step=s))
    assert weights_sha256(b.model) == weights_sha256(a.model)

"""The multi-GPU paths proven on CPU ranks: NCCL's device rule enforced on gloo (strict collectives),
FSDP2 on a meta-built model (no rank ever holds the whole model), fp16 with sharded gradients,
sharded checkpoints that restore the loss scaler, ranks that die with their parent, and torchrun.
One spawn runs every in-rank check, next to a second one at the same time (two launches at once must
each meet in their own group); process start is the slow part. The real SIGKILL and torchrun runs are
``slow``: their fast twins run the same rank entry and torchrun path without starting a Python."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
import torch.distributed as dist

from colabkit import build_model, weights_sha256
from colabkit.collectives import STRICT_ENV, collective, install_strict, rank_tensor, uninstall_strict
from colabkit.distributed import RankData, _entry, global_mean, launch, load_sharded, save_sharded, train_ranks
from colabkit.memory import MemoryTracker
from colabkit.plan import PlanError
from colabkit.trainer import Trainer, load_model
from forking import fork

WORLD = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the real processes' environment: ROOT for colabkit and ``tests.test_distributed``, tests/ for the helpers that
# module imports (forking)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), OMP_NUM_THREADS="1")


# ----- 1. NCCL's rule under gloo --------------------------------------------------------------
OLD_GLOBAL_MEAN = '''
def global_mean(x):  # colabkit 0.x before the fix: a CPU tensor made ad hoc, all-reduced directly
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
'''


def test_strict_collectives_reject_what_nccl_would(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    install_strict()
    try:
        assert global_mean(2.5) == 2.5  # the fixed path: rank_tensor + collective
        assert collective("all_reduce", rank_tensor([3]), reduce="max").item() == 3
        with pytest.raises(RuntimeError, match="made ad hoc"):  # a plain CPU tensor: a CPU tensor under nccl
            collective("all_reduce", torch.tensor([1.0]))
        old = {"__name__": "colabkit.distributed", "torch": torch, "dist": dist}
        exec(OLD_GLOBAL_MEAN, old)  # the code before the fix, as if it were colabkit's module
        with pytest.raises(RuntimeError, match="called directly from colabkit.distributed"):
            old["global_mean"](2.5)
        dist.all_reduce(torch.tensor([1.0]))  # torch's engines and user code keep plain torch.distributed
    finally:
        uninstall_strict()
        dist.destroy_process_group()


# ----- 2-4. in the ranks: meta build, fp16 sharding, scaler resume -------------------------------
META_MODEL = "gpt:4x128"  # vocab 256: the blocks, not the embeddings, are most of the model


def _meta_build() -> dict:
    """zero:3 built from the meta device, under a tracker that sees every storage created."""
    torch.manual_seed(0)
    with MemoryTracker() as mt:
        model = load_model(META_MODEL, "zero:3", seq=16, device="cpu")
        on_meta = all(p.is_meta for p in model.parameters())
        trainer = Trainer(model, "zero:3", device="cpu")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"on_meta": on_meta, "peak": mt.report()["peak_bytes"], "full": full,
            "local": sum(p.to_local().nbytes for p in trainer.model.parameters())}


def _found_inf_agreed() -> dict:
    """zero:2+fp16: an inf in rank 0's gradient shard only; both ranks must skip the step."""
    torch.manual_seed(0)
    t = Trainer(load_model("gpt:2x64", "zero:2+fp16", seq=16, device="cpu"), "zero:2+fp16", device="cpu")
    x, y = RankData().batch(2, 16, step=0)
    with t.forward_context():
        loss = t.loss(x, y, y.numel() * WORLD)
    t.scaler.scale(loss)  # starts the scaler; then a scale at which no gradient overflows by itself
    t.scaler.update(1.0)
    t.scaler.scale(loss).backward()
    if dist.get_rank() == 0:
        next(iter(t.model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    before = [p.to_local().clone() for p in t.model.parameters()]
    scale = t.scaler.get_scale()
    t.scaler.step(t.optimizer)
    t.scaler.update()
    same = all(torch.equal(a, p.to_local()) for a, p in zip(before, t.model.parameters()))
    return {"skipped": same, "scale_before": scale, "scale_after": t.scaler.get_scale()}


def _fp16_run(directory: str, steps: int, save_at: int, resume: bool) -> dict:
    """zero:1+fp16 from a loss scale of 2**18: this model's gradients overflow at 2**17-2**18, so the
    scaler skips steps and backs off during the first steps, as an fp16 run does when it starts."""
    torch.manual_seed(0)
    t = Trainer(load_model("gpt:2x64", "zero:1+fp16", seq=16, device="cpu"), "zero:1+fp16", device="cpu")
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 18)
    if resume:
        assert load_sharded(t, directory)
    losses, data = [], RankData()
    for step in range(t.step_count, steps):
        losses.append(global_mean(t.step(*data.batch(2, 16, step=step))))
        if step + 1 == save_at:
            save_sharded(t, directory)
    flat = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    return {"losses": losses, "scale": t.scaler.get_scale(), "weights": flat}


def _ranks(directory: str) -> dict:
    out = {"group": summed_rank(10.0), "meta": _meta_build(), "inf": _found_inf_agreed()}
    out["fp16"] = [_fp16_run(directory, 5, 0, False), _fp16_run(directory, 2, 2, False),
                   _fp16_run(directory, 5, 0, True)]
    from colabkit.__main__ import build_parser

    a = build_parser().parse_args(TRAIN)  # what train --world-size 2 runs in each spawned rank
    out["spawned"] = train_ranks(a.model, a.plan[0], a.steps, a.batch, a.seq, a.seed, a.device, a.lr, None, 0, False)
    out["torchrun"] = _as_torchrun_rank(TRAIN)
    return out


STRUCTURED_N, STRUCTURED_R = 256, 8


def _structured_ranks() -> dict:
    """The second launch: a SemiseparableMatrix's factors split across its two ranks (rows 0:128, 128:256),
    its product against the dense matrix materialised here from the parts, with and without the all-reduce."""
    from colabkit.structured import SemiseparableMatrix, ShardedSemiseparable, relative_error

    S = SemiseparableMatrix.random(STRUCTURED_N, STRUCTURED_R, seed=0)  # the same matrix on every rank
    shard = ShardedSemiseparable(S, dist.get_rank(), dist.get_world_size())
    d = lambda t: t.double()  # noqa: E731  (the dense reference without SemiseparableMatrix code)
    dense = torch.diag(d(S.diag)) + torch.diag(d(S.sup), 1) + torch.diag(d(S.sub), -1) + d(S.U) @ d(S.V).T
    del S  # this rank keeps only its shard
    x = torch.randn(STRUCTURED_N, 4, generator=torch.Generator().manual_seed(1))
    ref = dense @ x.double()
    return {"group": summed_rank(100.0), "rank": dist.get_rank(), "bytes": shard.nbytes(), "rows": shard.stop - shard.start,
            "error": relative_error(shard @ x, ref), "error_without_allreduce": relative_error(shard.matmul(x, reduce=False), ref)}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Two launches at the same time, as two test workers or two notebooks start them: this file's rank
    checks, and the structured factors' ranks."""
    # spawned ranks (fn imported anew) started from a thread, while the main thread forks the others (this
    # process's imports: 2-3 s of CPU less per rank; forked from the pool's thread, _ranks' ranks exited with
    # status 1 -- not pinned down, so forks here come from the main thread)
    with ThreadPoolExecutor(1) as pool:
        spawned = pool.submit(launch, _structured_ranks, WORLD, device="cpu")
        forked = launch(_ranks, WORLD, str(tmp_path_factory.mktemp("fp16ckpt")), device="cpu", start_method="fork")
        return [forked, spawned.result(timeout=300)]


@pytest.fixture(scope="module")
def ranks(launches):
    return launches[0]


def test_meta_build_shards_before_weights_exist(ranks):
    torch.manual_seed(0)
    ref = build_model(META_MODEL, seq=16)  # a plain single-process build, same seed
    total = sum(p.nbytes for p in ref.parameters())
    block = sum(p.nbytes for p in ref.blocks[0].parameters())
    for r in ranks:
        m = r["meta"]
        assert m["on_meta"]  # load_model gave a model without memory
        assert m["local"] <= total / WORLD + block
        assert m["peak"] <= total / WORLD + block, (m["peak"], total, block)  # the whole build, tracked
        assert m["peak"] < total  # negative control of the bound: building it whole first would exceed it
    full, want = ranks[0]["meta"]["full"], ref.state_dict()
    assert set(full) == set(want)
    assert all(torch.allclose(full[k], want[k], rtol=0, atol=1e-7) for k in want)
    torch.manual_seed(1)
    other = build_model(META_MODEL, seq=16).state_dict()  # negative control: another seed differs
    assert not all(torch.allclose(full[k], other[k], rtol=0, atol=1e-7) for k in want)


def test_fp16_sharded_grads_agree_on_skipping(ranks):
    for r in ranks:  # the inf was in rank 0's shard only: without the all-reduce rank 1 would step
        assert r["inf"]["skipped"] and r["inf"]["scale_after"] == r["inf"]["scale_before"] / 2


def test_fp16_resume_restores_scaler_and_is_exact(ranks):
    full, first, rest = ranks[0]["fp16"]
    assert first["scale"] < 2.0 ** 18  # the scale moved before the checkpoint (else the test proves nothing)
    assert rest["scale"] == full["scale"]
    assert rest["losses"] == full["losses"][2:]
    assert torch.equal(rest["weights"], full["weights"])
    assert not torch.equal(first["weights"], full["weights"])  # negative control


def test_launch_spawns_unless_told_and_never_forks_after_cuda(monkeypatch):
    """Spawn is the default (a forked rank cannot use CUDA once the parent has); fork is refused, before any
    process starts, in a process whose CUDA is initialised."""
    import colabkit.distributed as d
    assert d.START_METHOD == "spawn"
    started = []
    monkeypatch.setattr(d.mp, "start_processes", lambda *a, **k: started.append(k["start_method"]))
    monkeypatch.setattr(d.torch, "load", lambda *a, **k: None)
    assert launch(summed_rank, 2, 1.0, device="cpu") == [None, None] and started == ["spawn"]
    launch(summed_rank, 2, 1.0, device="cpu", start_method="fork")  # gloo, CUDA untouched: fork allowed
    assert started == ["spawn", "fork"]
    # nccl: CUDA was queried (is_available, device_count) but not initialised -- a forked rank still dies
    monkeypatch.setattr(d, "backend_for", lambda device, world_size: "nccl")
    assert not d.torch.cuda.is_initialized()
    with pytest.raises(PlanError, match="NCCL ranks use CUDA.*start_method='spawn'"):
        launch(summed_rank, 2, 1.0, device="cuda", start_method="fork")
    assert started == ["spawn", "fork"]  # nothing started
    launch(summed_rank, 2, 1.0, device="cuda")  # control: spawn still allowed
    monkeypatch.setattr(d, "backend_for", lambda device, world_size: "gloo")
    monkeypatch.setattr(d.torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(PlanError, match="CUDA was initialised.*start_method='spawn'"):
        launch(summed_rank, 2, 1.0, device="cpu", start_method="fork")
    assert started == ["spawn", "fork", "spawn"]  # nothing started
    launch(summed_rank, 2, 1.0, device="cpu")  # control: spawn still allowed
    assert started == ["spawn", "fork", "spawn", "spawn"]


def aborting_rank(word: str) -> float:
    """Rank 1 says something on its standard error, as C++ does before an abort, then dies by SIGABRT."""
    if dist.get_rank() == 1:
        import faulthandler

        faulthandler.disable()  # pytest's dump of the abort would go to the test's own output
        os.write(2, f"terminate called: {word}\n".encode())
        os.abort()
    return 1.0


def test_a_rank_killed_by_a_signal_is_reported_with_its_last_output(capfd):
    """A rank that dies by a signal leaves no Python traceback (torch only says "terminated with signal
    SIGABRT"): launch reports what it last wrote on its standard error (notebook 11 once lost a rank so, cause
    unknown). Control: a rank that lives passes its standard error on, after it ends."""
    with pytest.raises(RuntimeError, match=r"(?s)SIGABRT.*rank 1's last output.*terminate called: gloo-says-bye"):
        launch(aborting_rank, 2, "gloo-says-bye", device="cpu", start_method="fork")
    assert launch(warning_rank, 2, device="cpu", start_method="fork") == [0, 1]
    assert capfd.readouterr().err.count("a rank's warning") == 2


def warning_rank() -> int:
    os.write(2, b"a rank's warning\n")
    return dist.get_rank()


def trained_then_watched() -> dict:
    """A zero:3 run in a rank, with the collector off (it would run at any allocation otherwise); what the rank
    still holds of it when the process group is destroyed is written into the result it returns."""
    import gc
    import weakref

    gc.disable()
    t = Trainer(load_model("gpt:2x64", "zero:3", seq=16, device="cpu"), "zero:3", device="cpu")
    t.step(*RankData().batch(2, 16, step=0))
    model, out, destroy = weakref.ref(t.model), {"rank": dist.get_rank()}, dist.destroy_process_group

    def watched(*a, **k):
        out["model_alive_at_destroy"] = model() is not None
        return destroy(*a, **k)
    dist.destroy_process_group = watched
    return out


def test_a_rank_frees_its_run_before_the_group_ends():
    """The run's FSDP2 model sits in reference cycles; left to interpreter shutdown, a gloo worker thread that
    drops the last reference to one of its tensors needs the GIL of a finalizing interpreter and aborts the rank
    (pytorch/pytorch#179291; a rank died so at the end of a torchrun run in CI). So each rank collects its run
    before the group ends. Control: without that collection the model is still alive there."""
    got = launch(trained_then_watched, WORLD, device="cpu", start_method="fork")
    assert [r["model_alive_at_destroy"] for r in got] == [False, False], got
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("colabkit.distributed.gc.collect", lambda *a: 0)  # the forked ranks inherit the patch
        got = launch(trained_then_watched, WORLD, device="cpu", start_method="fork")
    assert [r["model_alive_at_destroy"] for r in got] == [True, True], got


# ----- launches at once --------------------------------------------------------------------------
def summed_rank(value: float) -> float:
    """This launch's ranks each add ``value`` (+ their rank): the sum says which group they met in."""
    t = rank_tensor([value + dist.get_rank()])
    collective("all_reduce", t)
    return float(t)


def test_launches_at_once_each_meet_in_their_own_group(launches):
    """Two launches running at the same time (two test workers, two notebooks) each form their own group:
    the ranks meet through a file in the launch's own folder. They used to meet on a TCP port picked
    beforehand, and a rank that joined the other launch's store died with SIGABRT (CI, 2026-11-26).
    (The two launches are this file's: its rank checks and the structured factors', started together.)"""
    first, second = launches
    assert [r["group"] for r in first] == [21.0, 21.0]  # 10+0 + 10+1: no rank crossed over
    assert [r["group"] for r in second] == [201.0, 201.0]  # 100+0 + 100+1


def test_structured_factors_split_across_two_gloo_ranks(launches):
    """The fast twin of test_structured.py::test_factors_split_across_two_gloo_processes, in this file's launch."""
    from colabkit.structured import SemiseparableMatrix, sharded_bytes

    full = SemiseparableMatrix.random(STRUCTURED_N, STRUCTURED_R).nbytes()
    ranks = launches[1]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["error"] <= 1e-5
        assert r["error_without_allreduce"] > 0.1  # negative control: each rank alone is wrong
        assert r["bytes"] == sharded_bytes(STRUCTURED_N, STRUCTURED_R, 2) < full
        assert r["rows"] == 128


# ----- 5. ranks die with their parent -----------------------------------------------------------
def stubborn_rank() -> None:
    """A rank that handles Ctrl-C itself (as a run that checkpoints on interrupt would) and works on:
    torch's own spawn asks the kernel for SIGINT at the parent's death, which such a rank survives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        time.sleep(0.1)


def _connected(p: psutil.Process) -> bool:
    try:
        return any(c.status == psutil.CONN_ESTABLISHED for c in p.net_connections(kind="tcp"))
    except psutil.Error:
        return False


def _kill_parent_and_watch(cmd: list[str], timeout: float) -> list[int]:
    """Start ``cmd`` (which launches 2 ranks), SIGKILL it once both ranks are in the process group, and
    return the pids of ranks still running ``timeout`` seconds later."""
    parent = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[psutil.Process] = []
    family: list[psutil.Process] = []  # everything the parent started (ranks, its resource tracker)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (len(ranks) == WORLD and all(_connected(r) for r in ranks)):
            time.sleep(0.5)  # until both ranks are in the process group (a TCP connection each)
            try:
                family = psutil.Process(parent.pid).children(recursive=True)
                ranks = [c for c in family if c.ppid() == parent.pid and "spawn" in " ".join(c.cmdline())]
            except psutil.Error:  # a process that ended between the listing and the look
                continue
        assert len(ranks) == WORLD and all(_connected(r) for r in ranks), "the ranks did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        return [p.pid for p in _running_after(ranks, timeout)]
    finally:  # never leave anything of this test behind
        if parent.poll() is None:
            parent.kill()
        for p in family:
            if p.is_running():
                p.kill()


@pytest.mark.slow  # fast twin: test_sigkill_of_a_forked_parent_ends_stubborn_ranks_of_the_launch_entry
def test_sigkill_of_parent_ends_even_stubborn_ranks():
    code = "from colabkit.distributed import launch; from tests.test_distributed import stubborn_rank; " \
           "launch(stubborn_rank, 2, device='cpu')"
    assert _kill_parent_and_watch([sys.executable, "-c", code], timeout=5) == []


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie waits only for its reaping: it runs nothing)."""
    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [p for p in procs if running(p)]


def _running_after(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those still running ``timeout`` seconds from now, or sooner once none is."""
    deadline = time.time() + timeout
    while time.time() < deadline and _running(procs):
        time.sleep(0.05)
    return _running(procs)


def _forked_parent(out: str) -> None:
    """The parent: two ranks through launch's own rank entry (die_with_parent, the group through a file in the
    launch folder, strict collectives) running stubborn_rank, and two stubborn children with torch spawn's rule
    only (the kernel's SIGINT at the parent's death); their pids go to ``out/pids.json``."""
    me = os.getpid()
    ranks = [fork(lambda r=r: _entry(r, WORLD, "gloo", out, me, stubborn_rank, ())) for r in range(WORLD)]
    controls = [fork(lambda: (torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGINT), stubborn_rank()))
                for _ in range(WORLD)]
    with open(os.path.join(out, "pids.tmp"), "w") as f:
        json.dump({"ranks": ranks, "controls": controls}, f)
    os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids.json"))
    while True:
        time.sleep(1)


def test_sigkill_of_a_forked_parent_ends_stubborn_ranks_of_the_launch_entry(tmp_path):
    """The fast twin of the SIGKILL tests above: the same ranks (launch's rank entry running stubborn_rank),
    forked from a forked parent instead of spawned by a new Python; SIGKILL the parent once both ranks are in
    their process group. Negative control: stubborn children with torch spawn's own rule only live on."""
    parent = fork(lambda: _forked_parent(str(tmp_path)))
    family: list[psutil.Process] = []
    try:
        deadline, pids = time.time() + 90, tmp_path / "pids.json"
        while time.time() < deadline and not pids.exists():
            time.sleep(0.05)
        started = json.loads(pids.read_text())
        ranks, controls = ([psutil.Process(p) for p in started[k]] for k in ("ranks", "controls"))
        family = ranks + controls
        while time.time() < deadline and not all(_connected(r) for r in ranks):
            time.sleep(0.05)  # until both ranks are in the process group (a TCP connection each)
        assert all(_connected(r) for r in ranks), "the ranks did not start"
        os.kill(parent, signal.SIGKILL)
        os.waitpid(parent, 0)
        assert _running_after(ranks, 5) == []
        time.sleep(0.3)  # the parent is gone: the controls' SIGINT came, and was ignored
        assert _running(controls) == controls
    finally:  # never leave anything of this test behind
        try:
            os.kill(parent, signal.SIGKILL)
            os.waitpid(parent, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.mark.slow  # fast twin: test_sigkill_of_a_forked_parent_ends_stubborn_ranks_of_the_launch_entry
def test_sigkill_of_train_world_size_two_ends_its_ranks():
    cmd = [sys.executable, "-m", "colabkit", "train", "--model", "gpt:2x64", "--device", "cpu", "--no-track",
           "--batch", "4", "--seq", "16", "--plan", "zero:1", "--steps", "100000", "--world-size", "2"]
    assert _kill_parent_and_watch(cmd, timeout=5) == []


# ----- 6. torchrun ------------------------------------------------------------------------------
TRAIN = ["train", "--model", "gpt:4x128", "--plan", "zero:3", "--steps", "4", "--device", "cpu", "--batch", "4",
         "--seq", "16", "--no-track", "--json", "-"]


@pytest.mark.slow  # fast twin: test_torchrun_path_equals_the_spawned_ranks
def test_torchrun_equals_world_size_two():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "colabkit"]
    runs = [subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cmd in (torchrun + TRAIN, [sys.executable, "-m", "colabkit", *TRAIN, "--world-size", "2"])]
    (by_torchrun, err), (spawned, err2) = (p.communicate(timeout=300) for p in runs)
    # a rank's own last words (a C++ "terminate called ..." before an abort) come before torchrun's summary
    said = [ln for ln in (err + err2).splitlines() if re.search(r"terminate|Error|Exception|abort|gloo", ln)]
    assert [p.returncode for p in runs] == [0, 0], "\n".join(said[:40]) + "\n...\n" + err[-2000:] + err2[-1000:]
    result, spawned = json.loads(by_torchrun), json.loads(spawned)  # torchrun: rank 0 printed, rank 1 nothing
    assert result["losses"] == spawned["losses"] and result["weights_sha256"] == spawned["weights_sha256"]
    torch.manual_seed(0)
    assert weights_sha256(build_model("gpt:4x128", seq=16)) != result["weights_sha256"]  # negative control: it trained


def _as_torchrun_rank(argv: list[str]) -> dict:
    """In a launched rank: the CLI as torchrun starts it -- out of this launch's group, torchrun's variables
    set (RANK, LOCAL_RANK, WORLD_SIZE are already: launch's rank entry sets them), the rendezvous store
    hosted by rank 0 as torchrun's agent hosts it -- then back in a group for the launch's closing barrier."""
    from colabkit.__main__ import main

    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = rank_tensor([store.port if store else 0])  # the port the system gave rank 0's store
    collective("broadcast", port)
    store = store or dist.TCPStore("127.0.0.1", int(port), WORLD, is_master=False)
    dist.destroy_process_group()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port)), LOCAL_WORLD_SIZE=str(WORLD),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(argv)
    finally:
        for k in env:
            del os.environ[k]
    dist.init_process_group("gloo", store=dist.PrefixStore("back", store), rank=rank, world_size=WORLD)
    return {"code": code, "stdout": out.getvalue()}


def test_torchrun_path_equals_the_spawned_ranks(ranks):
    """The fast twin of test_torchrun_equals_world_size_two, in this file's launch: the same CLI run as
    torchrun's two ranks (run_here: the group from env://, rank 0 prints) against what --world-size 2's
    spawned ranks run (train_ranks with the CLI's arguments, in the launch's group)."""
    (first, second), spawned = (r["torchrun"] for r in ranks), ranks[0]["spawned"]
    assert (first["code"], second["code"]) == (0, 0), first["stdout"][-2000:]
    assert second["stdout"] == ""  # torchrun: rank 0 prints, rank 1 nothing
    result = json.loads(first["stdout"])
    assert result["losses"] == spawned["losses"] and result["weights_sha256"] == spawned["weights_sha256"]
    torch.manual_seed(0)
    assert weights_sha256(build_model("gpt:4x128", seq=16)) != result["weights_sha256"]  # negative control: it trained

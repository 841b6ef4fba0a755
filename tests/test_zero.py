"""ZeRO 1/2/3 on 2 CPU ranks (gloo), in the style of PyTorch's FSDP tests: loss parity with one
process, per-rank parameter/gradient/optimizer bytes against the ZeRO formulas, exact resume of a
sharded checkpoint, and clear refusals. One spawn runs every plan and the resume runs (process start is the
slow part)."""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch

from colabkit import build_model, measure, weights_sha256
from colabkit.distributed import backend_for, bench_sharded, consolidate, launch, per_rank_batch, train_ranks
from colabkit.estimate import estimate
from colabkit.models import blocks_of
from colabkit.plan import REGISTRY, Context, Plan, PlanError

MODEL, BATCH, SEQ, STEPS, WORLD = "gpt:2x128", 8, 32, 5, 2


def _bench_and_resume(fn, args: tuple, directory: str) -> dict:
    """In each rank: bench_sharded's own rank function, then the resume runs (one spawn for both)."""
    return {"bench": fn(*args), "resume": _resume_ranks(directory)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """``bench --world-size 2`` through bench_sharded's own code, whose launch also runs the resume runs in
    the same ranks: one spawn for the whole file (process start is the slow part)."""
    directory, resumed = tmp_path_factory.mktemp("resume"), []

    def launch_with_resume(fn, world_size, *args, device=None):
        ranks = launch(_bench_and_resume, world_size, fn, args, str(directory), device=device)
        resumed.append(ranks[0]["resume"])
        return [r["bench"] for r in ranks]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("colabkit.distributed.launch", launch_with_resume)
        mp.setattr("colabkit.distributed.START_METHOD", "fork")  # no imports per rank; spawn: test_distributed
        sharded = bench_sharded(MODEL, ["zero:1", "zero:2", "zero:3", COMPOSED, *FP16], world_size=WORLD, batch=BATCH,
                                seq=SEQ, steps=STEPS, device="cpu")
    return {r["plan"]: r for r in sharded}, resumed[0], directory


@pytest.fixture(scope="module")
def runs(request):
    single = measure(MODEL, "baseline", batch=BATCH, seq=SEQ, steps=STEPS, device="cpu")  # first, as it always was
    return single, request.getfixturevalue("spawned")[0]


COMPOSED = "zero:3+checkpoint+compress:int8+accum:2"
FP16 = ("zero:1+fp16", "zero:3+fp16")  # zero:3: fp16 compute copies, fp32 reduce and master shards


def test_fp16_sharded_loss_matches_zero1_fp16(runs):
    # zero:1+fp16 is autocast on full fp32 weights; zero:3+fp16 gathers fp16 copies of the shards
    # (MixedPrecisionPolicy) and reduce-scatters in fp32: the same step to within fp16 rounding
    single, sharded = runs
    z1, z3 = sharded["zero:1+fp16"], sharded["zero:3+fp16"]
    assert z1["ok"] and z3["ok"], (z1["error"], z3["error"])
    assert abs(z3["loss"] - z1["loss"]) / z1["loss"] < 1e-4
    assert abs(z3["loss"] - single["loss"]) / single["loss"] < 1e-4
    # negative control as below: a rank's own half of the batch is more than twice the tolerance away


def test_composes_with_checkpoint_compress_accum(runs):
    _, sharded = runs
    alone = measure(MODEL, COMPOSED.partition("+")[2], batch=BATCH, seq=SEQ, steps=STEPS, device="cpu")
    r = sharded[COMPOSED]
    assert r["ok"], r["error"]
    assert abs(r["loss"] - alone["loss"]) / alone["loss"] < 1e-4


def test_loss_parity_after_five_steps(runs):
    single, sharded = runs
    for plan, r in sharded.items():
        if plan == COMPOSED or plan in FP16:
            continue
        assert r["ok"], r["error"]
        assert len(r["per_rank"]) == WORLD
        assert abs(r["loss"] - single["loss"]) / single["loss"] < 1e-4, plan
    # negative control: a rank's own half of the batch (no all-reduce) is far from the global loss
    half = measure(MODEL, "baseline", batch=BATCH // WORLD, seq=SEQ, steps=STEPS, device="cpu")
    assert abs(half["loss"] - single["loss"]) / single["loss"] > 2e-4  # twice the tolerance above


def _shard_bytes(model: torch.nn.Module, world: int) -> int:
    """FSDP2's largest rank: dim-0 chunks of ceil(d0 / N) rows (the first rank holds a full chunk)."""
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())


def test_per_rank_bytes_follow_zero_formulas(runs):
    single, sharded = runs
    model = build_model(MODEL)
    psi = sum(p.numel() for p in model.parameters())  # independent of the tracker
    assert single["breakdown"]["params"] == 4 * psi and single["breakdown"]["optimizer"] >= 8 * psi
    shard = _shard_bytes(model, WORLD)
    steps = 4 * len(list(model.parameters()))  # AdamW keeps a float32 "step" scalar per tensor
    b1, b2, b3 = (sharded[f"zero:{s}"]["breakdown"] for s in (1, 2, 3))
    # zero:1: full fp32 parameters, AdamW's 8 bytes/param split over ranks (whole tensors per rank: uneven)
    assert b1["params"] == 4 * psi
    assert 8 * psi / WORLD <= b1["optimizer"] <= 1.1 * 8 * psi / WORLD
    # zero:2 (FSDP2, reshard_after_forward=False): gradient + optimizer shards; shard + gathered params
    assert b2["grads"] == shard and b2["optimizer"] == 2 * shard + steps
    assert b2["params"] == 4 * psi + shard
    # zero:3: everything sharded
    assert b3["params"] == shard and b3["grads"] == shard and b3["optimizer"] == 2 * shard + steps
    ppo = lambda b: b["params"] + b["grads"] + b["optimizer"]  # noqa: E731
    assert ppo(b3) <= 0.55 * ppo(single["breakdown"]) and b1["optimizer"] <= 0.55 * single["breakdown"]["optimizer"]


def test_estimate_world_size_matches_measurement(runs):
    # the per-rank peak of each stage, predicted from one single-process trace, against bench --world-size 2
    # (the tracker sees FSDP2 free and re-gather parameters with storage.resize_); the engines' extras:
    # zero:1 DDP's buckets, zero:2 the last block's all-gather output FSDP2 keeps to the end of forward,
    # zero:3 that too plus the root unit and one block (forward) / two blocks with prefetch (backward)
    _, sharded = runs
    model = build_model(MODEL)
    full = 4 * sum(p.numel() for p in model.parameters())
    last = 4 * sum(p.numel() for p in blocks_of(model)[-1].parameters())
    est = {s: estimate(MODEL, f"zero:{s}", batch=BATCH, seq=SEQ, device="cpu", gpu=None, world_size=WORLD) for s in (1, 2, 3)}
    for stage, e in est.items():
        m = sharded[f"zero:{stage}"]
        for c in ("params", "grads", "optimizer"):  # zero:1's grads: DDP's buckets + the largest fresh gradient
            assert abs(e["breakdown"][c] - m["breakdown"][c]) <= 0.05 * m["breakdown"][c], (stage, c, e["breakdown"][c], m["breakdown"][c])
        # zero:2/3: gloo's worker thread may free an all-gather / reduce-scatter buffer after the step moved on,
        # so a rank's peak is that much higher in some runs (CI saw +0.93 MB on zero:3): the estimate names it
        # as uncertainty, two copies of the largest unit, counted here from the model itself
        slack = e["resources"]["device"]["uncertainty"]
        assert slack == (2 * max(last, full - 2 * last) if stage > 1 else 0), (stage, slack)
        assert e.get("collective_slack_bytes", 0) == slack  # named on its own (the CLI's table shows it)
        assert e["peak_bytes"] - m["peak_bytes"] <= 0.05 * m["peak_bytes"], (stage, e["peak_bytes"], m["peak_bytes"])
        assert m["peak_bytes"] - e["peak_bytes"] <= 0.05 * m["peak_bytes"] + slack, (stage, e["peak_bytes"], m["peak_bytes"])
    # negative controls: without the gathered copies the prediction is more than 5% low
    p2 = est[2]["phase_peaks"]  # forward: the last block's all-gather output kept; backward: the gathered units
    bare2 = max(p2["forward"]["peak"] - last, p2["backward"]["peak"] - (p2["backward"]["at_peak"]["params"]
                                                                        - _shard_bytes(model, WORLD)))
    assert bare2 < 0.95 * sharded["zero:2"]["peak_bytes"], (bare2, sharded["zero:2"]["peak_bytes"])
    bare3 = est[3]["peak_bytes"] - full  # (2 blocks: root + both blocks are the whole model in backward)
    assert est[3]["peak_phase"] == "backward" and len(blocks_of(model)) == 2
    assert bare3 < 0.95 * sharded["zero:3"]["peak_bytes"], (bare3, sharded["zero:3"]["peak_bytes"])


def _largest_grad(name: str) -> int:
    return max(p.numel() * p.element_size() for p in build_model(name).parameters())


def test_zero1_gradients_are_ddp_buckets_counted_once(runs):
    # the all-reduce buckets *are* the gradients (gradient_as_bucket_view) and count as grads; autograd's
    # fresh gradient of one parameter lives next to them until DDP copies it into its bucket
    single, sharded = runs
    b1, b0 = sharded["zero:1"]["breakdown"], single["breakdown"]
    assert b1["grads"] == b0["grads"] + _largest_grad(MODEL)
    assert b1["other"] < 0.5 * b0["grads"]  # negative control: buckets beside the grads would be >= 4Ψ here


def _resume_ranks(directory: str):
    """In each rank (one spawn for every stage): 4 steps straight; 2 steps + checkpoint; resume to 4."""
    out = {}
    for stage in (1, 2, 3):
        d = os.path.join(directory, f"zero{stage}")
        run = lambda steps, ckpt, resume: train_ranks("gpt-tiny", f"zero:{stage}", steps, 4, 16, 0, "cpu",  # noqa: E731
                                                      3e-4, ckpt, 2 if ckpt else 0, resume)
        out[stage] = run(4, None, False), run(2, d, False), run(4, d, True)
    return out


def test_sharded_resume_is_exact_and_consolidates(spawned):
    """zero:1 (ZeroRedundancyOptimizer shards in each rank's file), zero:2 and zero:3 (FSDP2 through DCP)."""
    _, runs, directory = spawned
    for stage, (full, first, rest) in runs.items():
        assert rest["weights_sha256"] == full["weights_sha256"] != first["weights_sha256"], stage  # negative control
        assert rest["losses"] == full["losses"][2:], stage
        model = build_model("gpt-tiny")
        model.load_state_dict(consolidate(str(directory / f"zero{stage}")))  # one process, no process group
        assert weights_sha256(model) == full["weights_sha256"], stage


def test_clear_refusals():
    with pytest.raises(PlanError, match="does not split"):
        per_rank_batch(7, 2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(PlanError, match="needs 2 GPUs"):
            backend_for("cuda", 2)
    ctx = Context(device=torch.device("cpu"))
    with pytest.raises(PlanError, match="one process per rank"):
        Plan.parse("zero:2").check(ctx)
    for plan, why in (("zero:1+fused-step", "fused-step"), ("zero:3+adamw8bit", "adamw8bit"),
                      ("zero:1+offload:optimizer", "only zero:3"),
                      ("zero:3+offload:activations", "only zero:3")):
        with pytest.raises(PlanError, match=why):  # zero's own check (offload refuses CPU runs first)
            REGISTRY["zero"].check(Plan.parse(plan), ctx)
    with pytest.raises(PlanError, match="appears twice"):
        Plan.parse("zero:1+zero:3")
    with pytest.raises(PlanError, match="no zero:N token"):
        bench_sharded(MODEL, ["baseline"], world_size=2, batch=8, device="cpu")
    with pytest.raises(PlanError, match="world_size >= 2"):
        estimate(MODEL, "zero:3", batch=8, seq=SEQ, device="cpu", gpu=None)
    with pytest.raises(PlanError, match="adamw8bit"):  # the estimate refuses what the sharded run refuses
        estimate(MODEL, "zero:3+adamw8bit", batch=8, seq=SEQ, device="cpu", gpu=None, world_size=2)


def test_cli_world_size_refuses_before_spawning(capsys):
    from colabkit.__main__ import main

    assert main(["bench", "--model", MODEL, "--plan", "zero:1", "--batch", "7", "--world-size", "2",
                 "--device", "cpu"]) == 2
    assert "does not split over 2 ranks" in capsys.readouterr().err


def test_zero3_offload_pairs_get_true_reasons(capsys):
    """zero:3's offload is FSDP2's CPUOffloadPolicy, not colabkit's block streamer: the streamer's refusals
    (offload:params recomputes each block, so no checkpoint) are false there and do not apply; on a CPU the
    ranks' shards would stay in CPU memory, the device itself, so offload is refused saying so -- and
    --offload-sim, which the ranks cannot honour, is refused with --world-size instead of being dropped.
    Controls: the streamer's refusal still holds without zero; a single-process --offload-sim still runs."""
    from colabkit.__main__ import main

    gpu = Context(device=torch.device("cuda"))  # the check alone: no tensor is made on it
    REGISTRY["offload"].check(Plan.parse("zero:3+offload:params+checkpoint"), gpu)
    with pytest.raises(PlanError, match="already recomputes each block"):
        REGISTRY["offload"].check(Plan.parse("offload:params+checkpoint"), gpu)
    with pytest.raises(PlanError, match="CPUOffloadPolicy.*device itself"):
        REGISTRY["offload"].check(Plan.parse("zero:3+offload:params+checkpoint"), Context(device=torch.device("cpu")))
    with pytest.raises(PlanError, match="only zero:3"):  # zero:1's own reason, not the CPU one
        Plan.parse("zero:1+offload:optimizer").check(Context(device=torch.device("cpu"), offload_sim=True))
    args = ["--model", MODEL, "--plan", "zero:3+offload:optimizer", "--batch", "8", "--seq", str(SEQ),
            "--world-size", "2", "--device", "cpu", "--offload-sim"]
    assert main(["bench", *args]) == 2 and "--offload-sim with --world-size" in capsys.readouterr().err
    assert main(["train", *args, "--steps", "1"]) == 2 and "--offload-sim with --world-size" in capsys.readouterr().err
    assert main(["bench", "--model", MODEL, "--plan", "offload:optimizer", "--batch", "2", "--seq", str(SEQ),
                 "--device", "cpu", "--offload-sim", "--steps", "1"]) == 0


# ----- the per-rank estimate at depth: FSDP2 gathers the root unit, the current block and the next one ------
# fast: one plan per term of the estimate that a plain zero:N does not reach (at gpt:4x64 the other terms are
# within 5% either way: their controls run at the issue's sizes, in the slow twin)
DEEP_PLANS = ("zero:1+checkpoint", "zero:2+bf16", "zero:3", "zero:3+bf16+checkpoint")
MATRIX = tuple(f"zero:{s}{p}{c}" for s in (1, 2, 3) for p in ("", "+bf16") for c in ("", "+checkpoint"))


def _sharded_at(models: tuple[str, ...], plans: tuple[str, ...], batch: int, seq: int) -> dict[str, dict[str, dict]]:
    """bench --world-size 2 of every (model, plan) in one launch (forked ranks): {model: {plan: record}}."""
    from colabkit import distributed as D

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "START_METHOD", "fork")
        ranks = D.launch(_bench_models, WORLD, models, plans, batch, seq)
    return {m: {p: D._merge([r[m][i] for r in ranks]) for i, p in enumerate(plans)} for m in models}


def _bench_models(models, plans, batch, seq):
    from colabkit.distributed import bench_ranks

    return {m: bench_ranks(m, list(plans), batch, seq, 2, "cpu") for m in models}


def _estimate_matches(measured: dict[str, dict], model: str, batch: int, seq: int,
                      slack: bool = False) -> dict[str, float]:
    """Each plan's relative error of ``estimate --world-size 2`` against the measured per-rank peak; with
    ``slack``, a measured peak above the estimate by at most the estimate's uncertainty (a collective's
    buffer that gloo's worker thread freed late, see test_estimate_world_size_matches_measurement) counts
    as the estimate itself, and one beyond it only by what exceeds it."""
    err = {}
    for plan, m in measured.items():
        assert m["ok"], (model, plan, m["error"])
        e = estimate(model, plan, batch=batch, seq=seq, device="cpu", gpu=None, world_size=WORLD)
        late = e["resources"]["device"]["uncertainty"] if slack else 0
        over = max(0, m["peak_bytes"] - e["peak_bytes"])
        err[plan] = (e["peak_bytes"] - m["peak_bytes"] + min(over, late)) / m["peak_bytes"]
    return err


def _whole_model_gathered(monkeypatch):
    """The bug this guards: the depth extrapolation lost each block's bytes, so shard_trace counted the whole
    model as one gathered unit (zero:2 and zero:3 predicted alike)."""
    import importlib

    trace_mod = importlib.import_module("colabkit.estimate.trace")
    real = trace_mod._affine
    monkeypatch.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())
    monkeypatch.setattr(trace_mod, "_affine", lambda *a, **k: {**real(*a, **k), "block_bytes": []})


def _old_cast_of_parameter(t: torch.Tensor) -> bool:
    fn = t.grad_fn  # the cast itself only: F.linear saves weight.t(), a view of it, which this misses
    if fn is None or not type(fn).__name__.startswith("ToCopyBackward") or not fn.next_functions:
        return False
    nxt = fn.next_functions[0][0]
    return nxt is not None and type(nxt).__name__ == "AccumulateGrad"


OLD_TERMS = {  # each term of the per-rank estimate put back as it was before it was fixed
    "fresh": ("ddp_fresh", lambda grads, largest: grads),  # every gradient of the trace's peak beside the buckets
    "view": ("_cast_of_parameter", _old_cast_of_parameter),  # autocast's saved weight copies kept (bf16)
    "cast-in": ("cast_block_inputs", lambda module, args, blocks: None),  # fp32 residual stream in the blocks
    "backward": ("fsdp_backward", lambda *a, **k: None),  # the single trace's backward peak, sharded
}


def _errors_with_old(term: str, measured: dict[str, dict], model: str, batch: int, seq: int) -> dict[str, float]:
    """:func:`_estimate_matches` with one term of the estimate put back as it was (:data:`OLD_TERMS`)."""
    import importlib

    name, old = OLD_TERMS[term]
    if term in ("fresh", "backward"):  # applied to the trace afterwards (shard_trace): the cached traces serve
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(importlib.import_module("colabkit.estimate.zero"), name, old)
            return _estimate_matches(measured, model, batch, seq)
    trace_mod = importlib.import_module("colabkit.estimate.trace")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_mod, "_CACHE", trace_mod.OrderedDict())  # traces made with the new term
        mp.setattr(importlib.import_module("colabkit.estimate.zero"), name, old)
        err = _estimate_matches(measured, model, batch, seq)
    trace_mod._CACHE.clear()  # and none made with the old one stays behind
    return err


def _loss_and_head_moments() -> None:
    """zero:3 where backward peaks before the blocks (gpt:2x64, batch 8 x 64: the logits and their gradient beside
    every saved activation): in the loss's backward FSDP2 holds nothing gathered (the root resharded after
    forward), and from the logits' gradient on the root unit and the one block it prefetched, not two.
    Within 2% of the measured per-rank peak (late collectives allowed). Controls, deterministic (each from the
    same trace as the estimate): the loss's and the head's backward taken as one moment with the root and a
    block gathered predicts at least 4% more (+5.9% on 2026-11-27), and the backward modelled without its
    segments at all (two blocks beside the logits' gradient) more again (+10.4%)."""
    model, batch, seq = "gpt:2x64", 8, 64
    measured = _sharded_at((model,), ("zero:3",), batch, seq)[model]
    assert abs(_estimate_matches(measured, model, batch, seq, slack=True)["zero:3"]) <= 0.02
    new = _estimate_matches(measured, model, batch, seq)["zero:3"]
    merged = _errors_from_single_peak(measured, model, batch, seq, keep=("pre", "bN", "bmid", "b0", "post"))["zero:3"]
    none = _errors_from_single_peak(measured, model, batch, seq)["zero:3"]
    assert merged - new >= 0.04 and none - merged >= 0.03, (new, merged, none)


def _errors_from_single_peak(measured: dict[str, dict], model: str, batch: int, seq: int,
                             keep: tuple[str, ...] = ()) -> dict[str, float]:
    """:func:`_estimate_matches` with FSDP2's backward modelled from the single trace's backward peak alone, as it
    was before its segments (loss, head, blocks, embedding) were modelled apart -- or from the segments in ``keep``."""
    import importlib

    zero_mod = importlib.import_module("colabkit.estimate.zero")
    real = zero_mod.fsdp_backward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zero_mod, "fsdp_backward", lambda single, *a: real(
            {**single, "segments": {g: v for g, v in single["segments"].items() if g in keep}}, *a))
        return _estimate_matches(measured, model, batch, seq)


def test_estimate_world_size_at_depth(monkeypatch):
    """gpt:4x64 (four blocks: the estimate extrapolates in depth): zero:1 with checkpoint (DDP's fresh gradient),
    zero:2 with bf16 (FSDP2 gathers bf16 copies: no autocast copy saved), zero:3 and zero:3+bf16+checkpoint
    within 5% of the measured per-rank peak; and gpt:2x64's zero:3 (:func:`_loss_and_head_moments`). Controls:
    each of those terms put back as it was, and the whole model counted as gathered, miss by more than 5%."""
    model, batch, seq = "gpt:4x64", 8, 32
    measured = _sharded_at((model,), DEEP_PLANS, batch, seq)[model]
    _loss_and_head_moments()
    err = _estimate_matches(measured, model, batch, seq, slack=True)
    assert all(abs(v) <= 0.05 for v in err.values()), err
    for term, plan in (("fresh", "zero:1+checkpoint"), ("view", "zero:2+bf16")):
        old = _errors_with_old(term, {plan: measured[plan]}, model, batch, seq)[plan]
        assert abs(old) > 0.05, (term, plan, old)
    _whole_model_gathered(monkeypatch)
    assert abs(_estimate_matches({"zero:3": measured["zero:3"]}, model, batch, seq)["zero:3"]) > 0.05


@pytest.mark.slow  # fast twin: test_estimate_world_size_at_depth
def test_estimate_world_size_at_issue_sizes():
    """The issue's sizes: every plan of {zero:1, zero:2, zero:3} x {fp32, bf16} x {-, checkpoint} at gpt:4x256
    and gpt:12x128, batch 8, seq 64 -- one launch for both. Controls: each term of the estimate put back as it
    was misses at least one plan by more than 5% (measured 2026-11-27: fresh +17%, view +17%, cast-in +8%,
    backward -12% at gpt:4x256)."""
    measured = _sharded_at(("gpt:4x256", "gpt:12x128"), MATRIX, 8, 64)
    for model, by_plan in measured.items():
        err = _estimate_matches(by_plan, model, 8, 64, slack=True)
        assert all(abs(v) <= 0.05 for v in err.values()), (model, err)
    for term, plans in (("fresh", ("zero:1+checkpoint",)), ("view", ("zero:2+bf16", "zero:3+bf16")),
                        ("cast-in", ("zero:2+bf16+checkpoint", "zero:3+bf16+checkpoint")),
                        ("backward", ("zero:3+bf16", "zero:2+bf16+checkpoint"))):
        for model in measured:
            old = _errors_with_old(term, {p: measured[model][p] for p in plans}, model, 8, 64)
            assert max(abs(v) for v in old.values()) > 0.05, (term, model, old)


def test_zero3_below_zero2_at_gpt2_depth(monkeypatch):
    """gpt2-124m on t4x2: zero:2 keeps the whole gathered model through backward, zero:3 the root unit and two
    blocks (the current and the prefetched next); the predicted peaks differ by that, within 5% (the
    parameter bytes counted here on the meta device). Control: the whole model gathered makes them equal."""
    with torch.device("meta"):
        model = build_model("gpt2-124m")
    full = 4 * sum(p.numel() for p in model.parameters())
    block = 4 * sum(p.numel() for p in blocks_of(model)[0].parameters())
    root = full - len(blocks_of(model)) * block
    z2, z3 = (estimate("gpt2-124m", f"zero:{s}", batch=8, seq=128, gpu="t4x2", world_size=2)["peak_bytes"] for s in (2, 3))
    assert z3 < z2
    assert abs((z2 - z3) - (full - root - 2 * block)) <= 0.05 * (full - root - 2 * block), (z2, z3)
    _whole_model_gathered(monkeypatch)
    z2, z3 = (estimate("gpt2-124m", f"zero:{s}", batch=8, seq=128, gpu="t4x2", world_size=2)["peak_bytes"] for s in (2, 3))
    assert abs(z2 - z3) < 0.05 * (full - root - 2 * block)


@pytest.mark.slow  # ~25 s, two ranks of a 124M model; fast twin: test_estimate_world_size_at_depth (gpt:2x64)
def test_zero2_zero3_estimates_at_gpt2_size():
    """gpt2-124m, two gloo ranks, batch 2 x seq 64: zero:2 and zero:3 within 2% of the measured per-rank peak.
    Backward's moments are modelled apart -- the loss's (nothing gathered), the head's (the logits' gradient, with
    the root and one prefetched block gathered), each block's (its own temporaries, without the logits), the
    embedding's. Control: the
    backward modelled from its single peak (the logits' gradient counted beside the gathered blocks at every
    block) over-predicts zero:2 by more than 8% (+12.9% here, zero:3 +2.3%; at batch 8 x 128 +14% and +17.5%,
    where the new model is within 0.01% of both; CPU, 2026-11-27)."""
    model, batch, seq = "gpt2-124m", 2, 64
    measured = _sharded_at((model,), ("zero:2", "zero:3"), batch, seq)[model]
    err = _estimate_matches(measured, model, batch, seq, slack=True)
    assert all(abs(v) <= 0.02 for v in err.values()), err
    old = _errors_from_single_peak(measured, model, batch, seq)
    assert old["zero:2"] > 0.08, old


def _activations(model: str, plan: str, **kw) -> int:
    return estimate(model, plan, world_size=8 if "70B" in model else 2, **kw)["breakdown"]["activations"]


def test_bf16_zero3_activations_are_not_a_bf16_model_copy(monkeypatch):
    """24 blocks: bf16 zero:3 gathers bf16 copies (half the bytes of fp32's), so its activations are below
    the fp32 plan's, within 1.5x. Control: a trace that keeps autocast's bf16 copy of every weight (what a
    single process does) is several times over."""
    kw = dict(batch=2, seq=32, device="cpu", gpu=None)
    fp32 = _activations("gpt:24x256", "zero:3+checkpoint", **kw)
    assert _activations("gpt:24x256", "bf16+zero:3+checkpoint", **kw) <= 1.5 * fp32
    import contextlib
    import importlib

    monkeypatch.setattr(importlib.import_module("colabkit.estimate.predict"), "gathered_in_half",
                        lambda on=True: contextlib.nullcontext())
    assert _activations("gpt:24x256", "bf16+zero:3+checkpoint", **kw) > 3 * fp32


@pytest.mark.slow  # fast twin: test_bf16_zero3_activations_are_not_a_bf16_model_copy
def test_bf16_zero3_activations_at_70b():
    kw = dict(batch=1, seq=4096, gpu="h100")
    model = "hf:meta-llama/Llama-3.1-70B"
    assert _activations(model, "bf16+zero:3+checkpoint", **kw) <= 1.5 * _activations(model, "zero:3+checkpoint", **kw)


def _cpu_offload_host(model: torch.nn.Module, world: int) -> int:
    """FSDP2's CPUOffloadPolicy ("offloads parameters, gradients, and optimizer states to CPU"), per rank, from the
    model's own parameters: each dim-0 shard (rows padded to a multiple of N) fp32 and its gradient shard, pinned
    (CUDA's host allocator rounds each up to a power of two), and AdamW's two fp32 moments and fp32 step."""
    shards = [4 * math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.parameters()]
    return 2 * sum(1 << (s - 1).bit_length() for s in shards) + 2 * sum(shards) + 4 * len(shards)


def test_zero3_offload_is_fsdp2_cpu_offload_policy():
    """zero:3 with offload:optimizer (or offload:params: techniques/zero.py gives both CPUOffloadPolicy) keeps each
    rank's parameter, gradient and optimizer shards in its host RAM -- within 1% of the formula (the traced
    optimizer state carries the GPU allocator's 512-B rounding) -- and none of them on the GPU: the device peak is
    zero:3's less the shards it holds at that moment. Controls: zero:3 without offload holds the shards on the
    GPU; the host at 4 ranks is not the host at 2 (per rank, not the whole model's)."""
    model, kw = build_model("gpt:4x256"), dict(batch=8, seq=64, gpu="t4")
    z3 = estimate("gpt:4x256", "zero:3", world_size=2, **kw)
    for ws in (2, 4):
        for plan in ("zero:3+offload:optimizer", "zero:3+offload:params") if ws == 2 else ("zero:3+offload:optimizer",):
            e = estimate("gpt:4x256", plan, world_size=ws, **kw)
            ref = _cpu_offload_host(model, ws)
            assert abs(e["host_bytes"] - ref) <= 0.01 * ref, (ws, plan, e["host_bytes"], ref)
            assert e["breakdown"]["params"] == e["breakdown"]["grads"] == e["breakdown"]["optimizer"] == 0, e["breakdown"]
            if ws == 2:
                assert e["peak_phase"] == z3["peak_phase"]
                shards = sum(z3["at_peak"][c] for c in ("params", "grads", "optimizer"))
                assert e["peak_bytes"] == z3["peak_bytes"] - shards > 0
    assert z3["breakdown"]["params"] >= 4 * sum(p.numel() for p in model.parameters()) // 2  # control: on the GPU
    assert abs(_cpu_offload_host(model, 4) - _cpu_offload_host(model, 2)) > 0.3 * _cpu_offload_host(model, 2)


def test_communication_per_step_is_the_zero_papers(monkeypatch):
    """Bytes each rank moves per optimizer step (2 steps, gpt:2x64, gloo), in Ψ = the fp32 weights' bytes: DDP's
    all-reduce 2Ψ plus zero:1's broadcast of the updated shards Ψ; zero:2 2Ψ; zero:3 3Ψ (Rajbhandari et al. 2020,
    section 7). The weights' broadcast before the first step (DDP's setup, Ψ) is counted apart: it was folded into
    the steps' count until 2026-11-27 (zero:1's broadcast read 1.5Ψ at 2 steps, 2Ψ at 1)."""
    model = "gpt:2x64"
    psi = 4 * sum(p.numel() for p in build_model(model).parameters())
    runs = _sharded_at((model,), ("zero:1", "zero:2", "zero:3"), 8, 32)[model]
    per_step = {p: sum(r["comm_bytes"].values()) / psi for p, r in runs.items()}
    assert runs["zero:1"]["comm_bytes"]["broadcast_"] / psi == pytest.approx(1.0, abs=0.01)
    assert per_step == pytest.approx({"zero:1": 3.0, "zero:2": 2.0, "zero:3": 3.0}, abs=0.05), per_step
    assert sum(runs["zero:1"]["comm_setup_bytes"].values()) / psi == pytest.approx(1.0, abs=0.01)
    # on CUDA measure times 2 more steps untracked: they communicate too, and count as steps (they were not,
    # so zero:2 read 4Ψ a step); forked ranks inherit measure with CUDA's default
    from colabkit import distributed as D

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "measure", functools.partial(D.measure, timing_steps=2))
        timed = _sharded_at((model,), ("zero:2",), 8, 32)[model]["zero:2"]
    assert timed["timing_steps"] == 2 and sum(timed["comm_bytes"].values()) / psi == pytest.approx(2.0, abs=0.05)


def test_qlora_with_a_zero_stage_points_to_what_works():
    """qlora with zero:3 used to say "use zero:1 or zero:2", which zero's own check refuses with qlora too: the advice
    led to another refusal. Now it names what works -- qlora on one GPU, lora:R with zero:N -- and those are refused by
    neither check (only for want of ranks here). Control: zero:1 and zero:2 with qlora are refused, so the old advice
    was false."""
    ctx = Context(device=torch.device("cpu"))
    with pytest.raises(PlanError, match=r"train qlora on one GPU, or lora:R with zero:N") as e:
        REGISTRY["lora"].check(Plan.parse("qlora:8+zero:3"), ctx)
    assert "use zero:1 or zero:2" not in str(e.value)
    for stage in (1, 2, 3):
        REGISTRY["lora"].check(Plan.parse(f"lora:8+zero:{stage}"), ctx)  # the adapters' check takes it
        with pytest.raises(PlanError, match="one process per rank"):  # zero's: only the ranks are missing
            REGISTRY["zero"].check(Plan.parse(f"lora:8+zero:{stage}"), ctx)
    for stage in (1, 2):
        with pytest.raises(PlanError, match="4-bit bitsandbytes weights cannot be sharded"):
            REGISTRY["zero"].check(Plan.parse(f"qlora:8+zero:{stage}"), ctx)


def test_the_estimate_table_shows_the_late_collectives_in_its_uncertainty():
    """The CLI's overhead table: its +- column adds up to the device's uncertainty, the late collectives'
    row included (without that row the column would not add up for zero:2/3). Control: zero:1 has no row."""
    from colabkit.estimate.cli import _table

    for plan in ("zero:3", "zero:1"):
        r = estimate("gpt:2x128", plan, batch=8, seq=32, gpu="t4x2", world_size=WORLD)
        rows = {ln[:20].strip(): ln for ln in _table(r).splitlines()}
        assert ("late collectives" in rows) == (plan == "zero:3"), rows.keys()
        terms = sum(t["uncertainty"] for t in r["overhead_terms"].values())
        assert r["resources"]["device"]["uncertainty"] == terms + r.get("collective_slack_bytes", 0)
        assert (r.get("collective_slack_bytes", 0) > 0) == (plan == "zero:3")


def test_backward_segments_are_extrapolated_in_depth():
    """zero:2/3's backward is modelled from the single trace's backward segments (loss, head, last, middle and first
    block, embedding), so a deep model's trace carries them out to its depth: at gpt:6x64 each one extrapolated
    from the 2- and 3-layer traces equals the whole 6-layer trace's own within 0.5% (reference: the full trace,
    every block run). Control: the 3-layer trace's segments as they are (not extrapolated) miss the deep head's
    by more than 10% (three more blocks' saved activations)."""
    import importlib

    depth = importlib.import_module("colabkit.estimate.depth")
    trace_mod = importlib.import_module("colabkit.estimate.trace")
    t2, t3 = (trace_mod.trace(f"gpt:{d}x64", "baseline", 4, 32) for d in (2, 3))
    with trace_mod.full_trace():
        full = trace_mod.trace("gpt:6x64", "baseline", 4, 32)["segment_peaks"]["backward"]
    got = depth._affine(t2, t3, 6)["segment_peaks"]["backward"]
    assert set(got) == set(full) == {"pre", "head", "bN", "bmid", "b0", "post"}
    for g in full:
        assert abs(got[g]["peak"] - full[g]["peak"]) <= 0.005 * full[g]["peak"], (g, got[g], full[g])
    near = t3["segment_peaks"]["backward"]
    assert all(full[g]["peak"] - near[g]["peak"] > 0.10 * full[g]["peak"] for g in full)


def test_a_sharded_estimate_says_it_is_per_rank(capsys):
    """estimate --world-size N: the figures are one rank's, the header gives the global and per-rank batch, and a
    batch smaller than the ranks (which train refuses) is said to be estimated at one sequence per rank. Control:
    a one-process estimate says none of it."""
    from colabkit.__main__ import main

    r = estimate("gpt:2x64", "zero:3", batch=1, seq=32, device="cpu", gpu=None, world_size=2)
    assert (r["batch"], r["global_batch"], r["per_rank"]) == (1, 2, True)
    assert any("batch 1 is less than the 2 ranks" in n for n in r["notes"]), r["notes"]
    plain = estimate("gpt:2x64", "baseline", batch=2, seq=32, device="cpu", gpu=None)
    assert (plain["global_batch"], plain["per_rank"]) == (2, False) and not any("ranks" in n for n in plain["notes"])
    assert main(["estimate", "--model", "gpt:2x64", "--plan", "zero:3", "--world-size", "2", "--batch", "8",
                 "--seq", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "batch 8 (4 per rank)" in out and "each of 2 ranks" in out and "predicted peak per rank" in out, out

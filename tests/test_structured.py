"""Structured (tridiagonal + low-rank, HODLR) matrices against their dense materialisation: products,
gradients, exact recovery, storage formulas, the GPT mixing layer, sharded and offloaded factors, and
the CLI's done-when figures. Each equivalence has a negative control it must detect."""
import json
import math

import pytest
import torch

from colabkit import MemoryTracker, TextData, Trainer
from colabkit.__main__ import main
from colabkit.structured import (HODLRMatrix, best_time, OffloadedSemiseparable, SemiseparableMatrix, SemiseparableMixing, hodlr_bytes,
                                 relative_error, scaling, sharded_bytes, sharded_run, storage_bytes, structured_gpt)


def _close(a, ref, rtol=1e-5):
    """fp32 result against a float64 reference: relative 1e-5, absolute 1e-5 of the largest entry."""
    ref = ref.double()
    return torch.allclose(a.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def _dense64(S):
    """Materialised in float64 from the parts, without SemiseparableMatrix code."""
    d = lambda t: t.detach().double()  # noqa: E731
    return torch.diag(d(S.diag)) + torch.diag(d(S.sup), 1) + torch.diag(d(S.sub), -1) + d(S.U) @ d(S.V).T


def test_products_equal_dense_and_a_perturbed_tridiagonal_is_detected():
    S = SemiseparableMatrix.random(200, 8, seed=3)
    x, X = torch.randn(200), torch.randn(200, 5)
    A = _dense64(S)
    assert _close(S @ x, A @ x.double()) and _close(S @ X, A @ X.double())
    assert _close(S.to_dense(), A)
    bad = SemiseparableMatrix(S.sub, S.diag, S.sup.clone(), S.U, S.V)
    bad.sup[100] += 1e-2  # one off-by-a-little tridiagonal entry
    assert not _close(bad @ X, A @ X.double())
    swapped = SemiseparableMatrix(S.sup, S.diag, S.sub, S.U, S.V)  # the transpose's band
    assert not _close(swapped @ X, A @ X.double())


def test_gradients_equal_autograd_through_the_dense_matrix():
    S = SemiseparableMatrix.random(96, 4, seed=1)
    for t in S.tensors():
        t.requires_grad_(True)
    X, W = torch.randn(96, 3), torch.randn(96, 3)
    (S @ X * W).sum().backward()
    ours = [t.grad.clone() for t in S.tensors()]
    for t in S.tensors():
        t.grad = None
    dense = torch.diag(S.diag) + torch.diag(S.sup, 1) + torch.diag(S.sub, -1) + S.U @ S.V.T
    (dense @ X * W).sum().backward()
    for g, t in zip(ours, S.tensors()):
        assert torch.allclose(g, t.grad, rtol=1e-5, atol=1e-5 * t.grad.abs().max().item())
    # orientation control: the gradient of the sub-diagonal is not the super-diagonal's
    assert not torch.allclose(ours[0], S.sup.grad, rtol=1e-3, atol=1e-3)


def test_exact_recovery_and_its_negative_controls():
    S = SemiseparableMatrix.random(512, 16, seed=2)
    A = S.to_dense()
    R = SemiseparableMatrix.from_dense(A, 16)
    assert R.error(A) <= 1e-5
    for got, want in ((R.sub, S.sub), (R.diag, S.diag), (R.sup, S.sup), (R.U @ R.V.T, S.U @ S.V.T)):
        assert relative_error(got, want) < 1e-4
    # a rank too small cannot represent it
    assert SemiseparableMatrix.from_dense(A, 8, refine=2).error(A) > 0.1
    # a perturbed tridiagonal entry is found exactly where it was put (and nowhere else)
    A2 = A.clone()
    A2[300, 301] += 0.5
    R2 = SemiseparableMatrix.from_dense(A2, 16)
    diff = R2.sup - S.sup
    assert abs(diff[300].item() - 0.5) < 1e-4 and diff.abs().argmax().item() == 300
    with pytest.raises(ValueError, match="rank"):
        SemiseparableMatrix.from_dense(A, 0)


def test_exact_recovery_at_the_issues_size_needs_no_full_svd(monkeypatch):
    """At the issue's N=2048, r=16 an exact T + UVᵀ comes back from the band recovery and its rank-r sketch
    alone, within from_dense's tol: no N×N SVD (each ~4 s on a CPU core). Was: the sketch, in float32, left
    a relative error of 1.0e-6, just above tol=1e-6, and three full SVDs ran whose results were all
    discarded (the refinement stalled at 1.4e-6). Control: the counter sees from_dense's full SVDs of a
    dense matrix that is not tridiagonal + low rank (64 x 64)."""
    full = []
    svd = torch.linalg.svd

    def counted(A, *a, **k):
        full.extend([tuple(A.shape)] * (A.shape[0] == A.shape[1] == n))
        return svd(A, *a, **k)
    monkeypatch.setattr(torch.linalg, "svd", counted)
    n = 2048
    S = SemiseparableMatrix.random(n, 16, seed=0)
    A = S.to_dense()
    R = SemiseparableMatrix.from_dense(A, 16)
    assert full == [] and R.error(A) <= 1e-6
    assert relative_error(torch.cat([R.sub, R.diag, R.sup]), torch.cat([S.sub, S.diag, S.sup])) < 1e-5
    n = 64  # the control: a dense matrix that only full SVDs fit
    SemiseparableMatrix.from_dense(torch.randn(n, n, generator=torch.Generator().manual_seed(0)), 4, refine=1)
    assert full and all(s == (n, n) for s in full)


def test_storage_is_the_formula_and_fp16_factors_cost_precision():
    S = SemiseparableMatrix.random(2048, 16)
    dense_bytes = 2048 * 2048 * 4
    assert S.nbytes() == storage_bytes(2048, 16) == (3 * 2048 - 2) * 4 + 2 * 2048 * 16 * 4
    assert S.nbytes() / dense_bytes <= 0.02
    half = S.with_factors(torch.float16)
    assert half.nbytes() == storage_bytes(2048, 16, factor_bytes=2) and half.diag.dtype == torch.float32
    x = torch.randn(2048)
    err16, err32 = relative_error(half @ x, _dense64(S) @ x.double()), relative_error(S @ x, _dense64(S) @ x.double())
    assert err32 < 1e-5 < err16 < 2e-3  # fp16 rounding (unit roundoff 4.9e-4) is visible, and bounded


def test_hodlr_products_recovery_and_storage_growth():
    H = HODLRMatrix.random(256, 4, levels=3, seed=0)
    A, X = H.to_dense(), torch.randn(256, 3)
    assert _close(H @ X, A.double() @ X.double())
    assert HODLRMatrix.from_dense(A, 4, 3).error(A) <= 1e-5
    assert HODLRMatrix.from_dense(A, 2, 3).error(A) > 0.1  # rank too small
    assert H.nbytes() == hodlr_bytes(256, 4, 3)
    # fixed leaves of 32 rows: levels = log2(N/32); storage grows like N log N, faster than N log log N
    sizes = {n: HODLRMatrix.random(n, 8, levels=int(math.log2(n // 32))).nbytes() for n in (1024, 8192)}
    growth = sizes[8192] / sizes[1024]
    assert growth > 8 * math.log2(math.log2(8192)) / math.log2(math.log2(1024)) * 1.2
    assert growth == pytest.approx(hodlr_bytes(8192, 8, 8) / hodlr_bytes(1024, 8, 5))


def test_real_kernel_matrix_hierarchical_beats_tridiagonal_plus_low_rank():
    i = torch.arange(256.0)
    K = torch.exp(-(i[:, None] - i[None]).abs() / 16)  # full rank, but every off-diagonal block is rank 1
    assert HODLRMatrix.from_dense(K, 1, 4).error(K) < 1e-5
    errors = [SemiseparableMatrix.from_dense(K, r, refine=3).error(K) for r in (2, 8, 32)]
    assert errors[0] > errors[1] > errors[2] > 0.01  # improves with rank, never exact


def test_mixing_layer_equals_its_dense_causal_matrix():
    torch.manual_seed(0)
    mix = SemiseparableMixing(n=48, d=16, n_head=2, rank=3)
    with torch.no_grad():
        mix.diag.normal_()
        mix.sub.normal_()
    v = torch.randn(2, 2, 40, 8, requires_grad=True)
    y = mix.mix(v)
    dense = mix.matrix(40) @ v
    assert _close(y, dense.detach())
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, (v, mix.U_hat, mix.V, mix.diag, mix.sub), g)
    ref = torch.autograd.grad(dense, (v, mix.U_hat, mix.V, mix.diag, mix.sub), g)
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
    # causal: position t never sees t+1 (the full, untriangled U Vᵀ would)
    assert torch.count_nonzero(torch.triu(mix.matrix(40), 1)) == 0
    v2 = v.detach().clone()
    v2[:, :, 30:] += 1.0
    assert torch.equal(mix.mix(v2)[:, :, :30], y.detach()[:, :, :30])
    full = mix.U[:, :40] @ mix.V[:, :40].transpose(1, 2)  # without tril: the future leaks in
    assert not torch.allclose((full @ v2)[:, :, :30], (full @ v.detach())[:, :, :30])


def test_structured_gpt_trains():
    torch.manual_seed(0)
    model = structured_gpt("gpt-tiny", rank=4)
    assert all(type(b.attn) is SemiseparableMixing for b in model.blocks)
    assert not any(hasattr(b.attn, "qkv") for b in model.blocks)
    before = model.blocks[0].attn.U_hat.detach().clone()
    trainer, data = Trainer(model, "baseline", lr=1e-2, device="cpu"), TextData()
    losses = [trainer.step(*data.batch(8, 64, step=i)) for i in range(25)]
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses  # 5.5 (uniform over 256 bytes) falls below 3.5
    assert not torch.allclose(model.blocks[0].attn.U_hat, before)  # the mixing itself was trained


@pytest.mark.slow  # fast twin: test_distributed.py::test_structured_factors_split_across_two_gloo_ranks (in its launch)
def test_factors_split_across_two_gloo_processes():
    ranks = sharded_run(world=2, n=256, rank=8)
    full = SemiseparableMatrix.random(256, 8).nbytes()
    for r in ranks:
        assert r["error"] <= 1e-5
        assert r["error_without_allreduce"] > 0.1  # negative control: each rank alone is wrong
        assert r["bytes"] == sharded_bytes(256, 8, 2) < full
        assert r["rows"] == 128


def test_offloaded_factors_are_copied_in_per_product():
    S = SemiseparableMatrix.random(512, 8)
    off = OffloadedSemiseparable(S, "cpu")
    assert all(h.data_ptr() != t.data_ptr() for h, t in zip(off.host, (S.U, S.V)))  # a distinct host set
    x = torch.randn(512, 2)
    assert torch.equal(off @ x, S @ x)
    assert off.device_bytes() == (3 * 512 - 2) * 4 and off.host_bytes() == 2 * 512 * 8 * 4
    with MemoryTracker(device="cpu", alert_at=None) as mt:
        off @ x
    assert mt.report()["peak_bytes"] >= off.host_bytes()  # the per-product copy is real memory


def _cli_figures(tmp_path, monkeypatch, n: int, rank: int) -> None:
    path = tmp_path / "s.json"
    assert main(["structured", "--n", str(n), "--rank", str(rank), "--reps", "3", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert set(r) >= {"n", "rank", "dense_bytes", "structured_bytes", "storage_ratio", "recovery_error", "matvec_error",
                      "matvec_time_ratio"}
    assert r["dense_bytes"] == n * n * 4 and r["structured_bytes"] == storage_bytes(n, rank) == r["tracked_bytes"]
    assert r["storage_ratio"] <= 0.02 and r["recovery_error"] <= 1e-5 and r["matvec_error"] <= 1e-5
    assert r["matvec_time_ratio"] < 1
    assert main(["structured", "--n", "40", "--rank", "16"]) == 2  # too small for exact recovery: a clear error
    assert main(["structured", "--n", "64", "--rank", "-3"]) == 2  # was a raw "negative dimension" traceback
    with pytest.raises(ValueError, match="rank ≥ 1"):
        structured_gpt("gpt-tiny", rank=0)                          # was an IndexError deep in __init__
    # a laptop with 1 GiB free: N=8192 needs 2 GiB of dense references -> a clear error, not the OOM killer
    monkeypatch.setattr("colabkit.structured.report.host_ram", lambda: {"available": 2 ** 30})
    assert main(["structured", "--n", "8192", "--rank", "16"]) == 2
    assert main(["structured", "--n", "512", "--rank", "16", "--reps", "1"]) == 0   # control: small N still runs
    with pytest.raises(ValueError, match="1 ≤ rank < N"):
        SemiseparableMatrix.random(8, 8)


@pytest.mark.slow  # fast twin: test_cli_meets_the_done_when_figures_at_rank_8
def test_cli_meets_the_done_when_figures(tmp_path, monkeypatch):
    _cli_figures(tmp_path, monkeypatch, 2048, 16)  # the issue's N and r (exact recovery: no full SVD, see above)


def test_cli_meets_the_done_when_figures_at_rank_8(tmp_path, monkeypatch):
    """The same N, a rank of 8: recovered exactly without the refinements (whole-matrix SVDs of 2048 x 2048)."""
    _cli_figures(tmp_path, monkeypatch, 2048, 8)


def test_matvec_time_grows_linearly():
    """8x N: 8x time in theory, dense 64x. Timed in interleaved pairs (a busy 2-core CI machine slows both
    sizes alike) and the median pair kept; measured 8-16x here under load, so < 32 (half of dense's 64x)."""
    import statistics

    S1, S8 = SemiseparableMatrix.random(1024, 16), SemiseparableMatrix.random(8192, 16)
    x1, x8 = torch.randn(1024, 16), torch.randn(8192, 16)
    ratios = [best_time(lambda: S8 @ x8, 3) / best_time(lambda: S1 @ x1, 3) for _ in range(5)]
    assert statistics.median(ratios) < 32, ratios
    row = scaling([256], rank=16, k=4, dense_max=256, reps=1)[0]      # the notebook's table: bytes = formulas
    assert row["semi_bytes"] == storage_bytes(256, 16) and row["hodlr_bytes"] == row["hodlr_formula"] and row["dense_s"]

"""Adam-mini (adam-mini package) against a textbook implementation of the paper's algorithm; GaLore
(galore-torch) against AdamW's loss and its state formula; the issue's bench figures for both plus
offload:disk. Each comparison has a negative control it must detect."""
import copy

import pytest
import torch

import colabkit
from colabkit.techniques.adam_mini import make_adam_mini
from colabkit.techniques.galore import galore_state_bytes, projected

LR, WD, B1, B2, EPS = 1e-3, 0.1, 0.9, 0.999, 1e-8


def blocks_of(name, p, heads, per_head=True):
    """Adam-mini's partition (Zhang et al. 2024, sec. 2.3) as a (n_blocks, -1) view of p: one second
    moment per attention head for q/k (here the fused qkv, per head), per output neuron (row) for
    embeddings, projections and the MLP, per element for biases (plain Adam), one per other tensor."""
    if "bias" in name:
        return p.view(-1, 1)
    if "attn.qkv" in name and per_head:
        d = p.shape[1]
        return p.view(-1, d * d // heads)
    if any(k in name for k in ("wte", "attn.proj", "fc")) and per_head:
        return p.view(p.shape[0], -1)
    return p.view(1, -1)


class ReferenceAdamMini:
    """The paper's update with that partition, written from the formulas (not from the package)."""

    def __init__(self, model, heads, per_head=True):
        self.items = [(n, p, torch.zeros_like(p), torch.zeros(blocks_of(n, p, heads, per_head).shape[0], 1))
                      for n, p in model.named_parameters()]
        self.heads, self.per_head, self.t = heads, per_head, 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for name, p, m, v in self.items:
            g = p.grad
            m.mul_(B1).add_(g, alpha=1 - B1)
            v.mul_(B2).add_((blocks_of(name, g, self.heads, self.per_head) ** 2).mean(1, keepdim=True), alpha=1 - B2)
            if not any(k in name for k in ("norm", "ln", "bias")):
                p.mul_(1 - LR * WD)
            denom = (v / (1 - B2 ** self.t)).sqrt() + EPS   # (n_blocks, 1), broadcast over each block
            upd = blocks_of(name, m, self.heads, self.per_head) / denom / (1 - B1 ** self.t)
            p.sub_(LR * upd.view_as(p))


def _train(model, opt, steps=20):
    data = colabkit.TextData()
    for s in range(steps):
        x, y = data.batch(4, 32, step=s)
        logits = colabkit.models.logits_of(model(x))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_adam_mini_package_matches_the_paper_over_20_steps():
    torch.manual_seed(0)
    model = colabkit.build_model("gpt:2x64")
    heads = model.config.n_head
    ref_model, neg_model = copy.deepcopy(model), copy.deepcopy(model)
    got = _train(model, make_adam_mini(model, lr=LR, weight_decay=WD))
    ref = _train(ref_model, ReferenceAdamMini(ref_model, heads))
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    assert worst < 2e-5, worst   # fp32 rounding of two orderings of the same formula over 20 steps (~1e-5)
    # negative control: one block per tensor (not per head/neuron) -- detected by the same comparison
    neg = _train(neg_model, ReferenceAdamMini(neg_model, heads, per_head=False))
    assert max(float((a - b).abs().max()) for a, b in zip(got, neg)) > 100 * worst


def _optimizer_bytes(model, plan):
    """The tracker's optimizer bytes after one Trainer step of ``plan`` on ``model``."""
    tracker = colabkit.MemoryTracker(device="cpu")
    with tracker:
        colabkit.Trainer(model, plan, device="cpu", tracker=tracker).step(*colabkit.TextData().batch(2, 16, step=0))
    return tracker.report()["breakdown"]["optimizer"]


def test_adam_mini_state_is_the_first_moment_plus_one_value_per_block():
    model = colabkit.build_model("gpt:2x64")
    measured = _optimizer_bytes(model, "adam-mini")
    heads = model.config.n_head
    blocks = sum(blocks_of(n, p, heads).shape[0] for n, p in model.named_parameters())
    expected = 4 * colabkit.count_params(model) + 4 * blocks   # m per element, v per block (biases: per element)
    assert measured == expected
    # negative control: one v per tensor (no head/neuron partition) would be a different byte count
    per_tensor = sum(blocks_of(n, p, heads, per_head=False).shape[0] for n, p in model.named_parameters())
    assert 4 * colabkit.count_params(model) + 4 * per_tensor != expected


def test_galore_state_bytes_equal_the_formula():
    model = colabkit.build_model("gpt:2x128")
    measured = _optimizer_bytes(model, "galore:16")
    proj = projected(model, 16)
    assert len(proj) == 4 * model.config.n_layer              # qkv, proj, fc, fc_proj of every block
    formula = sum(galore_state_bytes(tuple(p.shape), 16) if id(p) in proj else 8 * p.numel()
                  for p in model.parameters())
    assert measured == formula
    wrong = sum(galore_state_bytes(tuple(p.shape), 17) if id(p) in proj else 8 * p.numel() for p in model.parameters())
    assert wrong != formula                                   # the comparison can tell ranks apart


def test_galore_torch_alone_keeps_whole_svd_factors():
    """The package without colabkit's compaction: each projector keeps a min(m,n)^2 SVD factor alive."""
    from galore_torch import GaLoreAdamW

    from colabkit.techniques.galore import compact_projectors

    model = colabkit.build_model("gpt:2x128")
    proj = [p for p in model.parameters() if id(p) in projected(model, 16)]
    opt = GaLoreAdamW([{"params": proj, "rank": 16, "update_proj_gap": 200, "scale": 1.0, "proj_type": "std"}],
                      lr=1e-3, no_deprecation_warning=True)
    x, y = colabkit.TextData().batch(2, 16, step=0)
    torch.nn.functional.cross_entropy(colabkit.models.logits_of(model(x)).flatten(0, 1), y.flatten()).backward()
    opt.step()
    extra = sum(4 * (min(p.shape) ** 2 - 16 * min(p.shape)) for p in proj)
    assert compact_projectors(opt) == extra == 458752


def test_galore_loss_within_5_percent_of_adamw_over_20_steps():
    kw = dict(steps=20, batch=4, seq=64, seed=1, progress=False, track=False)
    adamw = colabkit.train("gpt:4x128", plan="baseline", **kw)["losses"]
    galore = colabkit.train("gpt:4x128", plan="galore:16", **kw)["losses"]
    assert galore[-1] < galore[0] - 0.5                       # it trains
    assert abs(galore[-1] - adamw[-1]) / adamw[-1] < 0.05     # the stated tolerance (measured ~2%)
    sgd = colabkit.train("gpt:4x128", plan="sgd", **kw)["losses"]
    assert abs(sgd[-1] - adamw[-1]) / adamw[-1] > 0.05        # negative control: the tolerance separates


def test_issue16_bench(tmp_path, monkeypatch):
    """bench gpt:8x256, 2 steps: offload:disk <= 5% of AdamW's optimizer bytes in RAM, loss equal to 1e-6;
    adam-mini <= 0.55x; galore:32 <= 0.35x; every loss within 5% of baseline. The issue ran batch 8 x seq 128;
    optimizer bytes are a function of the weights alone, so batch 2 x seq 32 (4x less compute) checks the same."""
    monkeypatch.setenv("COLABKIT_OFFLOAD_DIR", str(tmp_path))
    recs = {r["plan"]: r for r in colabkit.compare("gpt:8x256", ["baseline", "offload:disk", "adam-mini", "galore:32"],
                                                    batch=2, seq=32, steps=2, device="cpu")}
    assert all(r["ok"] for r in recs.values()), {p: r["error"] for p, r in recs.items()}
    base = recs["baseline"]
    opt = {p: r["breakdown"]["optimizer"] / base["breakdown"]["optimizer"] for p, r in recs.items()}
    assert opt["offload:disk"] <= 0.05 and opt["adam-mini"] <= 0.55 and opt["galore:32"] <= 0.35, opt
    assert abs(recs["offload:disk"]["loss"] - base["loss"]) <= 1e-6 * base["loss"]
    assert all(abs(r["loss"] - base["loss"]) / base["loss"] < 0.05 for r in recs.values())


@pytest.mark.parametrize("plan, words", [("galore:0", "whole numbers"), ("galore", "needs a rank"),
                                          ("galore:8+lora:4", "keep one"), ("adam-mini+qlora:8", "use adamw")])
def test_refusals(plan, words):
    with pytest.raises(colabkit.PlanError, match=words):
        colabkit.Plan.parse(plan).check(colabkit.Context(device=torch.device("cpu")))


def test_galore_rank_above_every_matrix_warns_that_it_is_plain_adamw():
    model = colabkit.build_model("gpt:2x64")                  # width 64: rank 64 projects nothing
    with pytest.warns(UserWarning, match="projects no weight"):
        colabkit.Trainer(model, "galore:64", device="cpu")
    import warnings

    with warnings.catch_warnings():                          # control: rank 32 projects, no warning
        warnings.simplefilter("error")
        colabkit.Trainer(colabkit.build_model("gpt:2x64"), "galore:32", device="cpu")

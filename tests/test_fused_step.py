"""fused-step: the per-parameter step inside backward equals the plain step, gradients never all
exist at once (measured), and what it cannot honour is refused."""
import io

import pytest
import torch

from colabkit.data import TextData
from colabkit.memory import MemoryTracker
from colabkit.models import build_model
from colabkit.plan import Context, Plan, PlanError
from colabkit.trainer import Trainer


MODEL = "gpt:2x64"


def _run(plan, steps=3, tracker=None):
    torch.manual_seed(0)
    t = Trainer(build_model(MODEL, seq=32), plan, device="cpu", tracker=tracker)
    data = TextData()
    losses = [t.step(*data.batch(4, 32, step=i)) for i in range(steps)]
    return t, losses


@pytest.mark.parametrize("opt", ["adamw", "adamw8bit", "adamw4bit", "lion"])
def test_weights_equal_plain_step(opt):
    pytest.importorskip("bitsandbytes")
    plain, l1 = _run(opt if opt != "adamw" else "baseline")
    fused, l2 = _run(f"fused-step+{opt}")
    assert fused.optimizer.steps_in_backward == 3 * len(list(fused.model.parameters()))
    assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-6)
    for (n, a), b in zip(plain.model.named_parameters(), fused.model.parameters()):
        # same elementwise math on each tensor; foreach vs per-tensor kernels may round differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_grads_never_coexist_measured():
    peaks = {}
    for plan in ("baseline", "fused-step"):
        torch.manual_seed(0)
        with MemoryTracker(device="cpu") as mt:
            t, _ = _run(plan, steps=2, tracker=mt)
        peaks[plan] = mt.report()["breakdown"]["grads"]
    params = list(t.model.parameters())
    full = 4 * sum(p.numel() for p in params)
    largest = 4 * max(p.numel() for p in params)
    assert peaks["baseline"] == full
    # theory: at most the largest gradient plus the one arriving while it is stepped
    assert peaks["fused-step"] <= 2 * largest < full
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("lr,ok", [(3e-4, True), (6e-4, False)], ids=["same", "other-lr"])
def test_state_dict_is_the_plain_optimizers(lr, ok):
    """fused-step's saved state equals an independently run plain AdamW's (moments after 2 steps), and a
    plain optimizer that loads it continues exactly as fused-step does. Negative control: fused-step taking
    its third step with another lr is detected by the same weight comparison."""
    fused, _ = _run("fused-step", steps=2)
    plain, _ = _run("baseline", steps=2)
    fused.optimizer.param_groups[0]["lr"] = lr  # only affects the negative control's next step
    state = fused.optimizer.state_dict()["state"]
    ref = plain.optimizer.state_dict()["state"]
    assert state.keys() == ref.keys()
    same = all(torch.allclose(state[k][n], ref[k][n], rtol=1e-5, atol=1e-9)
               for k in ref for n in ("exp_avg", "exp_avg_sq"))
    assert same  # two identical runs: the saved moments are the plain optimizer's
    # resume: a fresh plain Trainer loads fused's model + optimizer state, then both take a third step
    buf = io.BytesIO()
    torch.save({"model": fused.model.state_dict(), "opt": fused.optimizer.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    torch.manual_seed(0)
    resumed = Trainer(build_model(MODEL, seq=32), "baseline", device="cpu")
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["opt"])
    resumed.optimizer.param_groups[0]["lr"] = resumed.optimizer.param_groups[1]["lr"] = 3e-4
    x, y = TextData().batch(4, 32, step=2)
    fused.step(x, y)
    resumed.step(x, y)
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                for a, b in zip(resumed.model.parameters(), fused.model.parameters()))
    assert close == ok


@pytest.mark.parametrize("plan,kw,match", [
    ("fused-step+accum:2", {}, "accum"),
    ("fused-step", {"max_grad_norm": 1.0}, "global gradient norm"),
    ("fused-step+fp16", {}, "GradScaler|fp16"),
])
def test_refusals(plan, kw, match):
    ctx = Context(device=torch.device("cpu"), **kw)
    with pytest.raises(PlanError, match=match):
        Plan.parse(plan).check(ctx)


# ----- O(N) hooks; a real torch.optim.Optimizer: schedulers, Hugging Face's Trainer, resume ------------
class _CountingAdamW(torch.optim.AdamW):
    """torch's AdamW that counts the parameters each step() call walks through (its Python work)."""

    visited = 0

    def step(self, closure=None):
        self.visited += sum(len(g["params"]) for g in self.param_groups)
        return super().step(closure)


@pytest.mark.parametrize("n_layers", [8, 32])
def test_each_hook_updates_only_its_parameter(n_layers):
    """Per backward the wrapped step walks N parameters in all (O(N)), not N per hook (N², the old hook that
    ran a full step() for every parameter), and the weights equal one plain AdamW step bit for bit."""
    from colabkit.techniques.fused_step import FusedStepOptimizer

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n_layers)])
    fused_m, plain_m = model(), model()
    n = len(list(fused_m.parameters()))
    inner = _CountingAdamW(fused_m.parameters(), lr=1e-2)
    opt = FusedStepOptimizer(inner, fused_m)
    plain = torch.optim.AdamW(plain_m.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    for m in (fused_m, plain_m):
        m(x).square().mean().backward()
    plain.step()
    opt.step()
    assert opt.steps_in_backward == n and inner.visited == n  # old code: n * n
    for a, b in zip(fused_m.parameters(), plain_m.parameters()):
        assert torch.equal(a, b)


def _lm_loop(fused: bool, schedule, steps: int = 4, resume_at: int | None = None, load_sched: bool = True):
    """A plain loop on gpt:2x64 with torch AdamW (+ FusedStepOptimizer) and an LR scheduler; returns the
    model and the lr each step used. ``resume_at``: save model/optimizer/scheduler state there, rebuild
    everything fresh, load it (the scheduler's only if ``load_sched``) and go on."""
    import torch.nn.functional as F

    from colabkit.models import logits_of
    from colabkit.techniques.fused_step import FusedStepOptimizer

    def build():
        torch.manual_seed(0)
        m = build_model(MODEL, seq=32)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt = FusedStepOptimizer(opt, m) if fused else opt
        return m, opt, (schedule(opt) if schedule else None)
    m, opt, sched = build()
    data, lrs = TextData(), []
    for i in range(steps):
        if i == resume_at:
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            m, opt, sched = build()
            m.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            if load_sched:
                sched.load_state_dict(saved["sched"])
        x, y = data.batch(4, 32, step=i)
        lrs.append(opt.param_groups[0]["lr"])
        F.cross_entropy(logits_of(m(x)).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if sched:
            sched.step()
        opt.zero_grad()
    return m, lrs


def _warmup_lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _hf_linear(opt):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)


@pytest.mark.parametrize("schedule", [_warmup_lambda, _hf_linear], ids=["LambdaLR", "hf-linear-warmup"])
def test_lr_schedulers_drive_the_steps_inside_backward(schedule):
    """LambdaLR and transformers' get_linear_schedule_with_warmup accept FusedStepOptimizer (before: 'is not
    an Optimizer') and the lr they set is the one the hooks step with: weights equal an independent plain
    AdamW run with the same schedule (bit for bit here: single-tensor AdamW on the CPU both ways; the
    tolerance allowed is 1e-6 relative). Negative control: fused-step without the schedule is detected."""
    plain, lrs = _lm_loop(False, schedule)
    fused, fused_lrs = _lm_loop(True, schedule)
    assert fused_lrs == lrs and len(set(lrs)) >= 3  # the schedule really moves the lr
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    constant, _ = _lm_loop(True, None)
    assert not all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(plain.parameters(), constant.parameters()))


def test_resume_with_scheduler_is_exact():
    """model + FusedStepOptimizer + scheduler state_dicts (loaded weights_only) resume bit-exactly: 2 + 2
    steps equal 4 uninterrupted ones. Negative control: resuming without the scheduler's state differs."""
    straight, _ = _lm_loop(True, _hf_linear)
    resumed, _ = _lm_loop(True, _hf_linear, resume_at=2)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    no_sched, _ = _lm_loop(True, _hf_linear, resume_at=2, load_sched=False)
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), no_sched.parameters()))


def test_huggingface_trainer_accepts_it(tmp_path):
    """transformers.Trainer(optimizers=(FusedStepOptimizer, scheduler)) trains GPT-2 and ends with the weights
    of the same Trainer given a plain AdamW and the same schedule (bit for bit). Gradient accumulation, which
    fused-step cannot honour, is refused loudly instead of stepping on partial gradients (negative control).
    HF's max_grad_norm must be 0: gradients are gone before HF would clip them."""
    import copy

    import transformers as tf

    from colabkit.techniques.fused_step import FusedStepOptimizer
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = tf.GPT2LMHeadModel(cfg)
    ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (16, 32))]

    def run(fused, accum=1):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        opt = FusedStepOptimizer(opt, m) if fused else opt
        args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=accum, max_grad_norm=0.0, report_to=[],
                                    use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True)
        tf.Trainer(model=m, args=args, train_dataset=ds, optimizers=(opt, _hf_linear(opt))).train()
        return m, opt
    plain, _ = run(False)
    fused, opt = run(True)
    assert opt.steps_in_backward == 3 * len(list(base.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fused.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), base.parameters()))
    with pytest.raises(RuntimeError, match="gradients cannot accumulate"):
        run(True, accum=2)


def test_second_backward_before_step_is_refused():
    from colabkit.techniques.fused_step import FusedStepOptimizer
    m = torch.nn.Linear(4, 2)
    opt = FusedStepOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
    m(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="call optimizer.step\\(\\) after every backward"):
        m(torch.ones(1, 4)).sum().backward()
    opt.step()
    m(torch.ones(1, 4)).sum().backward()  # after step(): fine again
    assert opt.steps_in_backward == 4 and isinstance(opt, torch.optim.Optimizer)


# ----- bitsandbytes' device sync per parameter (issue 34 item 5) ----------------------------------------
@pytest.fixture
def bnb_syncs(monkeypatch):
    """A stand-in for bitsandbytes' device sync that counts its calls, with the compute-side parameters
    taken as CUDA ones (on this CPU the token would never pick bitsandbytes, whose sync is then a no-op)."""
    bnb_opt = pytest.importorskip("bitsandbytes.optim.optimizer")
    import colabkit.techniques.optimizers as O
    calls = []
    monkeypatch.setattr(bnb_opt, "sync_gpu", lambda t: calls.append(tuple(t.shape)))
    monkeypatch.setattr(O, "_on_device", lambda p: not getattr(p, "_colabkit_host", False))
    return calls


def _kernel(t):
    opt = t.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return type(opt).__module__.split(".")[0], type(opt).__name__


def test_adamw8bit_under_fused_step_never_syncs_per_parameter(bnb_syncs):
    from colabkit.techniques.optimizers import AdamW8bit
    plain, _ = _run("adamw8bit", steps=1)  # negative control: bitsandbytes' kernel syncs once per parameter
    n = sum(1 for p in plain.model.parameters() if p.requires_grad)
    assert _kernel(plain) == ("bitsandbytes", "AdamW8bit") and len(bnb_syncs) == n
    bnb_syncs.clear()
    fused, losses = _run("adamw8bit+fused-step", steps=2)
    assert _kernel(fused) == ("colabkit", "AdamW8bit") and bnb_syncs == [] and fused.optimizer.steps_in_backward == 2 * n
    # its numbers: colabkit's AdamW8bit stepped as one plain step (the fused wrapper changes nothing else)
    torch.manual_seed(0)
    ref = Trainer(build_model(MODEL, seq=32), "baseline", device="cpu")
    ref.optimizer = AdamW8bit(ref.optimizer.param_groups, lr=ref.ctx.lr, min_8bit_size=4096)
    ref_losses = [ref.step(*TextData().batch(4, 32, step=i)) for i in range(2)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_offload_params_gives_adamw8bit_one_kernel_for_both_sides(bnb_syncs):
    """offload:params puts block parameters on the host and the rest on the device: bitsandbytes would get
    both in one optimizer; colabkit's kernel runs each on its own side (no per-parameter sync)."""
    torch.manual_seed(0)
    t = Trainer(build_model(MODEL, seq=32), "adamw8bit+offload:params", device="cpu", offload_sim=True)
    sides = {getattr(p, "_colabkit_host", False) for g in t.optimizer.param_groups for p in g["params"]}
    assert sides == {True, False}  # the mix bitsandbytes was handed
    t.step(*TextData().batch(4, 32, step=0))
    assert _kernel(t) == ("colabkit", "AdamW8bit") and bnb_syncs == []


@pytest.mark.parametrize("opt", ["lion", "lion8bit", "paged-adamw8bit"])
def test_bitsandbytes_only_optimizers_with_fused_step_refused_on_a_gpu(opt):
    pytest.importorskip("bitsandbytes")
    with pytest.raises(PlanError, match=f"'fused-step' with '{opt}' on a GPU: bitsandbytes synchronizes the device"):
        Plan.parse(f"{opt}+fused-step").check(Context(device=torch.device("cuda")))
    Plan.parse(f"{opt}+fused-step" if opt != "paged-adamw8bit" else "adamw8bit+fused-step").check(
        Context(device=torch.device("cpu")))  # negative control: on the CPU its sync is a no-op
    Plan.parse("adamw8bit+fused-step").check(Context(device=torch.device("cuda")))  # colabkit's kernel there

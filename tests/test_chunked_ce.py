"""chunked-ce against the plain computation: loss and every gradient equal to the unchunked run (torch's
own F.cross_entropy over the full logits) on the GPT presets (tied head), llama:LxD, transformers'
GPT2LMHeadModel and an untied Llama, with accum, checkpoint, fp16 and lora (frozen head); the
activations it saves measured by MemoryTracker and predicted by the estimator. Each equivalence has
a negative control: one changed label among a thousand is detected by the same comparison."""
import contextlib

import pytest
import torch

from colabkit import IGNORE_INDEX, MemoryTracker, Plan, PlanError, Trainer, build_model
from colabkit.estimate import estimate
from colabkit.techniques.chunked_ce import ChunkedCrossEntropy, chunked_cross_entropy, logits_bytes


def _run(model_fn, plan, batch, y=None, tracker=False):
    """One Trainer step (AdamW); (loss, gradients by name as the optimizer step saw them, the tracker's
    report or None)."""
    torch.manual_seed(0)
    mt = MemoryTracker(device="cpu", alert_at=None) if tracker else None
    grads, calls = {}, []
    real = ChunkedCrossEntropy.forward
    ChunkedCrossEntropy.forward = staticmethod(lambda *a: calls.append(1) or real(*a))  # did it run chunked?
    try:
        with mt if mt is not None else contextlib.nullcontext():
            t = Trainer(model_fn(), plan, device="cpu", tracker=mt)
            named = list(t.model.named_parameters())
            t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
                {n: p.grad for n, p in named if p.grad is not None}))  # kept, not copied: AdamW reads them only
            loss = t.step(batch, y)
    finally:
        ChunkedCrossEntropy.forward = staticmethod(real)
    assert bool(calls) == ("chunked-ce" in Plan.parse(plan)), plan
    return loss, grads, (mt.report() if mt is not None else None)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _assert_same(ref, got, rel):
    (l0, g0), (l1, g1) = ref[:2], got[:2]
    assert l1 == pytest.approx(l0, rel=rel)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert _rel(g1[n], g0[n]) <= rel, (n, _rel(g1[n], g0[n]))


def _tokens(batch, seq, vocab, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    if pad:  # right padding of different lengths: ignored targets
        y[0, seq // 2:] = IGNORE_INDEX
        y[-1, -3:] = IGNORE_INDEX
    return x, y


def _miss_one_label(y, vocab):
    """The negative control: the same targets with one (of ~1000) changed."""
    y = y.clone()
    y[1, 5] = (y[1, 5] + 1) % vocab
    return y




def _equal_and_smaller(vocab, seq):
    """Batch 2 x ``seq``, vocabulary ``vocab`` (tied wte/lm_head): loss and gradients within 1e-5 of the
    unchunked run; activations <= 0.6x measured, smaller by the logits' formula; the estimator within 5%."""
    name = f"gpt:2x128:v{vocab}"
    model_fn = lambda: build_model(name, seq=seq)  # noqa: E731
    x, y = _tokens(2, seq, vocab)
    base = _run(model_fn, "baseline", x, y, tracker=True)
    chunk = _run(model_fn, "chunked-ce:128", x, y, tracker=True)
    _assert_same(base, chunk, rel=1e-5)
    assert "wte.weight" in chunk[1] and "lm_head.weight" not in chunk[1]  # tied: one gradient, both uses
    # negative control: one changed label of the counted tokens moves the head's gradient far beyond 1e-5
    wrong = _run(model_fn, "chunked-ce:128", x, _miss_one_label(y, vocab))
    assert _rel(wrong[1]["wte.weight"], base[1]["wte.weight"]) > 1e-3
    act0, act1 = base[2]["breakdown"]["activations"], chunk[2]["breakdown"]["activations"]
    assert act1 <= 0.6 * act0
    # the saving is the logits' formula (fp32: logits + log-softmax -> one chunk's logits + a lse per row)
    saved = logits_bytes(2 * seq, vocab) - logits_bytes(2 * seq, vocab, chunk=128)
    assert act0 - act1 == pytest.approx(saved, rel=0.02)
    est = estimate(name, "chunked-ce:128", batch=2, seq=seq, device="cpu", steps=1)
    assert est["breakdown"]["activations"] == pytest.approx(act1, rel=0.05)
    assert est["peak_bytes"] == pytest.approx(chunk[2]["peak_bytes"], rel=0.05)


@pytest.mark.slow  # fast twin: test_gpt_v8000_equal_to_unchunked_and_smaller
def test_gpt_v32000_equal_to_unchunked_and_smaller():
    """The issue's case: batch 2 x seq 512, vocabulary 32,000 (769 counted tokens)."""
    _equal_and_smaller(32000, 512)


def test_gpt_v8000_equal_to_unchunked_and_smaller():
    """Fast twin of the issue's case above, the same checks at a quarter of the vocabulary and half the
    sequence: batch 2 x seq 256, vocabulary 8,000."""
    _equal_and_smaller(8000, 256)


def test_function_against_cross_entropy_with_bias_and_frozen_weight():
    """The autograd function alone: with a bias, a partial last chunk and ignored rows; a frozen weight
    gets no gradient and none is computed."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w, b = torch.randn(50, 16, generator=g, requires_grad=True), torch.randn(50, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    y[::5] = IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), y, reduction="sum")
    got = chunked_cross_entropy(h, w, y, b, chunk=8)
    gr, gg = torch.autograd.grad(ref, (h, w, b)), torch.autograd.grad(got, (h, w, b))
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for a, c in zip(gr, gg):
        assert _rel(c, a) <= 1e-5
    w.requires_grad_(False)
    seen = []
    real = ChunkedCrossEntropy.backward
    ChunkedCrossEntropy.backward = staticmethod(lambda ctx, go: seen.append(real(ctx, go)) or seen[-1])
    try:
        chunked_cross_entropy(h, w, y, None, chunk=8).backward()
    finally:
        ChunkedCrossEntropy.backward = staticmethod(real)
    assert seen[0][1] is None and seen[0][0] is not None


@pytest.mark.parametrize("plan,ref", [("chunked-ce:16+accum:4", "baseline"),
                                      ("chunked-ce:16+checkpoint", "baseline"),
                                      ("chunked-ce", "baseline")])
def test_combines_with_accum_and_checkpoint(plan, ref):
    """accum:4 with chunks equals the un-accumulated, unchunked step (the window's token normalisation)."""
    model_fn = lambda: build_model("gpt:2x64:v1000")  # noqa: E731
    x, y = _tokens(8, 32, 1000)
    base = _run(model_fn, ref, x, y)
    _assert_same(base, _run(model_fn, plan, x, y), rel=1e-5)
    wrong = _run(model_fn, plan, x, _miss_one_label(y, 1000))
    assert _rel(wrong[1]["wte.weight"], base[1]["wte.weight"]) > 1e-3


def test_fp16_autocast():
    """Under fp16 autocast each chunk's logits are fp16 and the loss fp32, as the unchunked run computes
    them; the head's weight gradient sums chunks in fp32 (more exact than one fp16 matmul): 1e-3."""
    model_fn = lambda: build_model("gpt:2x64:v1000")  # noqa: E731
    x, y = _tokens(4, 32, 1000)
    _assert_same(_run(model_fn, "fp16", x, y), _run(model_fn, "fp16+chunked-ce:32", x, y), rel=1e-3)


def _hf_cases():
    tf = pytest.importorskip("transformers")
    from colabkit.hf import llama_config

    return {
        "llama:2x64:v3000": lambda: build_model("llama:2x64:v3000"),  # tied embeddings
        "llama-untied": lambda: tf.LlamaForCausalLM(llama_config("llama:1x64:v3000", tie_word_embeddings=False)),
        "gpt2-lmhead": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=3000,
                                                                n_positions=64)),
    }


@pytest.mark.parametrize("name", ["llama:2x64:v3000", "llama-untied", "gpt2-lmhead"])
def test_transformers_causal_lms(name):
    """transformers models through their lm_head, with a batch dict (unshifted labels, -100 padding):
    the model is not given the labels (it would compute its loss from full logits); the Trainer shifts."""
    model_fn = _hf_cases()[name]
    x, y = _tokens(2, 48, 3000)
    y[0, 30:] = IGNORE_INDEX
    batch = {"input_ids": x, "attention_mask": (y != IGNORE_INDEX).long() | 1, "labels": y}
    base = _run(model_fn, "baseline", batch)
    _assert_same(base, _run(model_fn, "chunked-ce:32", batch), rel=1e-5)
    head = "lm_head.weight" if "lm_head.weight" in base[1] else next(n for n in base[1] if "embed" in n or "wte" in n)
    wrong = _run(model_fn, "chunked-ce:32", {**batch, "labels": _miss_one_label(y, 3000)})
    assert _rel(wrong[1][head], base[1][head]) > 1e-3


def test_lora_frozen_head():
    """lora's frozen base (bf16 on the CPU): the adapters' gradients equal the unchunked run's (bf16
    matmuls: 1e-2), the head has no gradient and the function computes none."""
    pytest.importorskip("peft")
    model_fn = lambda: build_model("gpt:2x64:v1000")  # noqa: E731
    x, y = _tokens(4, 32, 1000)
    seen = []
    real = ChunkedCrossEntropy.backward
    ChunkedCrossEntropy.backward = staticmethod(lambda ctx, go: seen.append(real(ctx, go)) or seen[-1])
    try:
        got = _run(model_fn, "lora:4+chunked-ce:32", x, y)
    finally:
        ChunkedCrossEntropy.backward = staticmethod(real)
    base = _run(model_fn, "lora:4", x, y)
    _assert_same(base, got, rel=1e-2)
    assert got[1] and all("lora_" in n for n in got[1])
    assert seen and seen[0][1] is None  # no (V, D) weight gradient was made


def test_refusals_and_the_model_outside_training():
    """Refused where it cannot apply; outside the Trainer's forward the head computes plain logits."""
    x, y = _tokens(2, 8, 256, pad=False)
    with pytest.raises(PlanError, match="no LM head"):
        Trainer(torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)), "chunked-ce", device="cpu")
    with pytest.raises(PlanError, match="drop loss_fn="):
        Trainer(build_model("gpt-tiny"), "chunked-ce", device="cpu", loss_fn=lambda out, labels, n: out.sum())

    class Scaled(torch.nn.Linear):
        def forward(self, h):
            return super().forward(h) * 0.5

    m = build_model("gpt-tiny")
    m.lm_head = Scaled(64, 256, bias=False)
    with pytest.raises(PlanError, match="plain nn.Linear"):
        Trainer(m, "chunked-ce", device="cpu")
    with pytest.raises(PlanError, match="use zero:2 or zero:1 with chunked-ce"):  # measured: FSDP2 frees the head
        Trainer(build_model("gpt-tiny"), "zero:3+chunked-ce", device="cpu")     # weight before the recompute
    for bad in ("chunked-ce:0", "chunked-ce:x"):
        with pytest.raises(PlanError, match="positive whole number"):
            Plan.parse(bad)
    t = Trainer(build_model("gpt-tiny"), "chunked-ce", device="cpu")
    assert isinstance(t.step(x, y), float)
    assert t.model(x).shape == (2, 8, 256)  # generation and your own calls: logits as before


def test_transformers_trainer_through_hf_prepare_model(tmp_path, monkeypatch):
    """transformers' Trainer gives the labels to the model: hf.prepare_model makes it compute the chunked loss
    itself, divided by the window's num_items_in_batch; with padded micro-batches of different lengths and
    gradient accumulation the logged losses equal the unchunked run's (1e-5) over steps whose updates
    depend on the gradients. Negative control: dividing by each micro-batch's own count is detected."""
    tf = pytest.importorskip("transformers")
    import functools

    from colabkit import hf

    x, y = _tokens(8, 32, 3000)
    y[1, 5:], y[2, 20:], y[5, 9:] = IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX
    data = [{"input_ids": x[i], "labels": y[i]} for i in range(8)]

    def losses(plan):
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=3000, n_positions=64))
        model = hf.prepare_model(model, plan, device="cpu")
        args = hf.training_arguments(plan, output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=2,
                                     logging_steps=1, report_to="none", learning_rate=1e-2, save_strategy="no",
                                     disable_tqdm=True, use_cpu=True, seed=0)
        trainer = tf.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    base = losses("accum:2")
    calls = []
    real = ChunkedCrossEntropy.forward
    monkeypatch.setattr(ChunkedCrossEntropy, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
    assert losses("chunked-ce:16+accum:2") == pytest.approx(base, rel=1e-5) and calls
    wrap = hf.loss_in_forward

    def per_micro_mean(model, chunk):  # the control: each micro-batch divided by its own token count
        wrap(model, chunk)
        f = model.forward
        model.forward = functools.wraps(f)(lambda *a, **k: f(*a, **{n: v for n, v in k.items() if n != "num_items_in_batch"}))

    monkeypatch.setattr(hf, "loss_in_forward", per_micro_mean)
    wrong = losses("chunked-ce:16+accum:2")
    assert wrong != pytest.approx(base, rel=1e-3)


# ----- encoder-decoder models (T5, built offline from its config) ------------------------------------
def _t5():
    import transformers
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def _t5_batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(1, 128, (4, 12), generator=g), torch.randint(1, 128, (4, 6), generator=g)
    y[:, -2:] = IGNORE_INDEX
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y}


@pytest.mark.parametrize("plan", ["chunked-ce", "chunked-ce+accum:2"])
def test_t5_with_chunked_ce_equals_its_own_loss(plan):
    """T5 with chunked-ce (was: raw "You must specify exactly one of input_ids or inputs_embeds": the labels,
    kept from the model, were what T5 builds its decoder inputs from). Reference: T5 computing its own loss."""
    batch = _t5_batch()
    ref_t = Trainer(_t5(), "baseline", device="cpu")
    ref = [ref_t.step(batch) for _ in range(2)]
    t = Trainer(_t5(), plan, device="cpu")
    kinds = []
    t.model.lm_head.register_forward_hook(lambda m, i, o: kinds.append(type(o).__name__))
    got = [t.step(batch) for _ in range(2)]
    assert set(kinds) == {"ChunkedLogits"}  # the full (B, T, V) logits never existed
    for a, b in zip(got, ref):
        assert abs(a - b) / b < 1e-5, (got, ref)
    assert got[1] < got[0]


def test_t5_chunked_loss_in_forward_equals_its_own_loss():
    """transformers' Trainer path (labels given to the model): the wrapped forward builds the decoder inputs."""
    from colabkit.techniques.chunked_ce import loss_in_forward, prepare_head
    b = _t5_batch()
    ref = _t5().train()(**b).loss
    m = loss_in_forward(prepare_head(_t5()), chunk=8).train()
    out = m(**b)
    assert type(out.logits).__name__ == "ChunkedLogits"
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=0)


def test_encoder_decoder_without_a_label_shift_is_refused_clearly(monkeypatch):
    from colabkit.batches import add_decoder_inputs
    m = _t5()
    y = _t5_batch()["labels"]
    assert add_decoder_inputs(m, {}, y)["decoder_input_ids"][:, 1:].eq(y[:, :-1].clamp(min=0)).all()  # shifted right
    assert "decoder_input_ids" not in add_decoder_inputs(build_model("gpt-tiny"), {}, y)  # negative control
    monkeypatch.setattr(type(m), "prepare_decoder_input_ids_from_labels", None)
    with pytest.raises(PlanError, match="put 'decoder_input_ids' in the batch, or drop chunked-ce"):
        Trainer(m, "chunked-ce", device="cpu").step(_t5_batch())

"""transformers' heads in colabkit's own loop, with their own batches (a new user's review of 2026-11-27): a
model whose context is shorter than train's default seq, multiple-choice examples, single-label classes kept in a
column, and CTC models under accum:K. Each loss is compared with the model's own on the same batch (dropout off);
each fix has a control that puts the old behaviour back and must be caught.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import colabkit  # noqa: E402
from colabkit import PlanError, Trainer, batches  # noqa: E402
from colabkit.feed import feed  # noqa: E402

trainer_module = __import__("importlib").import_module("colabkit.trainer")

V = 100
BERT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_own_batches_keep_their_length_whatever_seq_says():
    """seq cuts colabkit's text windows; a GPT-2 with 64 positions trains on its own 8-token batches with train's
    default seq=128 (it was refused: "seq 128 is longer than the model's context"). Control: on colabkit's text,
    where seq is the window, the same model is refused."""
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    x = torch.randint(0, V, (4, 8))
    r = colabkit.train(transformers.GPT2LMHeadModel(cfg), data=[{"input_ids": x, "labels": x}], steps=2, device="cpu",
                       progress=False)
    assert len(r["losses"]) == 2
    with pytest.raises(ValueError, match=r"seq 128 is longer than the model's context \(64 positions\)"):
        colabkit.train(transformers.GPT2LMHeadModel(cfg), steps=1, device="cpu", progress=False)


def test_multiple_choice_examples_are_collated_not_taken_as_batches():
    """One multiple-choice example's ids are (choices, seq): train(batch=2) stacks two of them into (2, choices, seq)
    and the labels index the choices. Control: read as 1-D examples (the old rule), each example is taken as a
    batch of 4 -- and its 0-d label refused."""
    g = torch.Generator().manual_seed(0)
    ex = [{"input_ids": torch.randint(0, V, (4, 8), generator=g), "labels": torch.tensor(i % 4)} for i in range(4)]
    assert feed(ex, 2, 8, 0, example_dims=2).batch(0)["input_ids"].shape == (2, 4, 8)
    model = transformers.BertForMultipleChoice(transformers.BertConfig(**BERT))
    r = colabkit.train(model, data=ex, batch=2, steps=2, device="cpu", progress=False)
    assert len(r["losses"]) == 2
    assert feed(ex, 2, 8, 0, example_dims=1).batch(0)["input_ids"].shape == (4, 8)
    with pytest.raises(PlanError, match=r"labels have shape \(\)"):
        Trainer(model, "sgd", device="cpu").step(ex[0])


class _Classifier(torch.nn.Module):
    """A user's own classifier: mean-pooled embeddings to 3 logits, no loss of its own."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(V, 16), torch.nn.Linear(16, 3)

    def forward(self, input_ids):
        return self.out(self.emb(input_ids).mean(1))


def test_single_label_classes_in_a_column_train_as_transformers_takes_them():
    """Class ids shaped (B, 1) (each example's label a one-element list): transformers flattens them, and so does
    colabkit -- a BERT classifier's step equals its own loss, a plain module's equals torch's cross-entropy on the
    flattened ids. Controls: (B, 2) integer labels are still refused with the expected shapes; and the check that
    refused (B, 1) (ndim == 1 only) does refuse it."""
    ids, y = torch.randint(0, V, (4, 8)), torch.tensor([[0], [2], [1], [1]])
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, num_labels=3))
    with torch.no_grad():
        want = bert(input_ids=ids, labels=y).loss.item()
    assert Trainer(bert, "sgd", device="cpu").step({"input_ids": ids, "labels": y}) == pytest.approx(want, rel=1e-6)
    own = _Classifier()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(own(ids), y[:, 0]).item()
    assert Trainer(own, "sgd", device="cpu", task="sequence-classification").step(ids, y) == pytest.approx(want, rel=1e-6)
    with pytest.raises(PlanError, match=r"labels have shape \(4, 2\).*needs labels of shape \(4,\)"):
        Trainer(bert, "sgd", device="cpu").step({"input_ids": ids, "labels": torch.zeros(4, 2, dtype=torch.long)})
    b = batches.Batch((), {"input_ids": ids}, y)
    assert not (y.dtype == torch.long and y.ndim == 1)  # the old rule's verdict on this batch: refused
    batches.check_labels(bert, b, "sequence-classification")  # the new one takes it


def _ctc(reduction: str):
    cfg = transformers.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, ctc_loss_reduction=reduction)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(1, 20, (4, 6), generator=g)
    labels[1, 4:], labels[3, 3:] = -100, -100  # targets of different lengths, padded
    return transformers.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(4, 1600, generator=g), "labels": labels}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ctc_under_accumulation_equals_the_models_own_loss(reduction, monkeypatch):
    """A ...ForCTC model's own loss is a sum over examples (ctc_loss_reduction="sum", the default) or their mean:
    accum:2 adds the micro-batches' sums, or weights their means by examples -- the window's loss equals the
    model's on the whole batch, and so do the weights after the step (plain SGD on the whole batch). Control: read
    as a causal LM (the old rule: weights by shifted tokens) it is off by more than 0.1%."""
    model, batch = _ctc(reduction)
    ref_model, _ = _ctc(reduction)
    with torch.no_grad():
        want = model(**batch).loss.item()
    got = Trainer(model, "sgd+accum:2", device="cpu", lr=0.1, weight_decay=0.0).step(batch)
    assert got == pytest.approx(want, rel=1e-5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_model(**batch).loss.backward()
    ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), n
    monkeypatch.setitem(batches._SUFFIXES, "ctc", ("NoSuchHead",))
    model, batch = _ctc(reduction)
    old = Trainer(model, "sgd+accum:2", device="cpu").step(batch)
    assert abs(old / want - 1) > 1e-3, (old, want)  # 50% (sum), 0.7% (mean) here; the fixed path is within 1e-5


def _bert(cls, **kw):
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.BertConfig(**BERT, **kw))


def _uneven(labels: torch.Tensor) -> torch.Tensor:
    """Ignore (-100) most positions of the first half's rows and few of the second's: micro-batches of unequal
    token counts, where weighting by micro-batch instead of by token shows."""
    labels = labels.clone()
    labels[: len(labels) // 2, 2:] = -100
    labels[len(labels) // 2:, -1:] = -100
    return labels


def _head_cases():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (4, 8), generator=g)
    t5 = lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(  # noqa: E731
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))
    vit = lambda: transformers.ViTForImageClassification(transformers.ViTConfig(  # noqa: E731
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    return {  # name: (model factory, batch, plan, whether micro-batches' token counts differ)
        "masked-lm": (lambda: _bert("BertForMaskedLM"), {"input_ids": ids, "labels": _uneven(ids)}, "sgd+accum:2", True),
        "token-classification": (lambda: _bert("BertForTokenClassification", num_labels=5),
                                 {"input_ids": ids, "labels": _uneven(ids % 5)}, "sgd+accum:2", True),
        "seq2seq": (t5, {"input_ids": ids, "labels": _uneven(torch.randint(1, V, (4, 6), generator=g))},
                    "sgd+accum:2", True),
        "single-label": (lambda: _bert("BertForSequenceClassification", num_labels=3),
                         {"input_ids": ids, "labels": torch.tensor([0, 2, 1, 1])}, "sgd+accum:2", False),
        "regression": (lambda: _bert("BertForSequenceClassification", num_labels=1),
                       {"input_ids": ids, "labels": torch.randn(4, generator=g)}, "sgd+accum:2", False),
        "multi-label": (lambda: _bert("BertForSequenceClassification", num_labels=3,
                                      problem_type="multi_label_classification"),
                        {"input_ids": ids, "labels": (torch.rand(4, 3, generator=g) > 0.5).float()}, "sgd+accum:2", False),
        "question-answering": (lambda: _bert("BertForQuestionAnswering"),
                               {"input_ids": ids, "start_positions": torch.tensor([1, 2, 3, 0]),
                                "end_positions": torch.tensor([4, 5, 6, 7])}, "sgd", False),
        "image-classification": (vit, {"pixel_values": torch.randn(4, 3, 8, 8, generator=g),
                                       "labels": torch.tensor([0, 2, 1, 1])}, "sgd+accum:2", False),
    }


@pytest.mark.parametrize("name", list(_head_cases()))
def test_each_head_steps_on_the_models_own_loss(name, monkeypatch):
    """Each head's step (accum:2 where the targets are named 'labels'; question answering names its own, so accum:1)
    returns the model's own loss on the whole batch, within 1e-5. Control, where the micro-batches' token counts
    differ: counting every label position (ignored ones too) as the window's weight misses it."""
    factory, batch, plan, uneven = _head_cases()[name]
    make = lambda: (torch.manual_seed(0), factory())[1]  # noqa: E731  (the same weights each time)
    model = make()
    with torch.no_grad():
        want = model(**batch).loss.item()
    assert Trainer(model, plan, device="cpu").step(dict(batch)) == pytest.approx(want, rel=1e-5)
    if uneven:
        monkeypatch.setattr(trainer_module, "count", lambda labels, head, examples=1: labels.numel())
        old = Trainer(make(), plan, device="cpu").step(dict(batch))
        assert abs(old / want - 1) > 1e-3, (old, want)


def test_a_batch_longer_than_a_learned_position_table_is_refused():
    """Your batches keep their length, so one longer than a learned position table (GPT-2's wpe, BERT's) gets
    colabkit's error naming the truncation; a model with rotary positions (Llama) has no such table and trains on
    it. Control: without the check, torch's own IndexError (a device-side assert on a GPU)."""
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    x = torch.randint(0, V, (2, 40))
    with pytest.raises(PlanError, match=r"length 40, and GPT2LMHeadModel has a learned position table of 16 rows: "
                                        r"truncate your sequences to 16"):
        Trainer(transformers.GPT2LMHeadModel(cfg), "sgd", device="cpu").step({"input_ids": x, "labels": x})
    llama = colabkit.build_model("llama:2x64")
    assert batches.position_rows(llama) is None
    llama.config.max_position_embeddings = 32
    y = torch.randint(0, 256, (1, 48))  # past max_position_embeddings: rotary positions go on
    assert Trainer(llama, "sgd", device="cpu").step({"input_ids": y, "labels": y}) > 0
    with pytest.raises(IndexError, match="index out of range"):
        transformers.GPT2LMHeadModel(cfg)(input_ids=x)


def test_a_causal_lms_first_label_is_never_a_target():
    """transformers shifts a causal LM's labels: the first one is never a target, so an id past the vocabulary there
    trains to the same loss as -100 (it was refused). Control: the same id one position later is refused."""
    model = colabkit.build_model("llama:2x64")
    x = torch.randint(0, 256, (2, 8))
    y = x.clone()
    y[:, 0] = 300
    with torch.no_grad():
        want = model(input_ids=x, labels=torch.where(y >= 256, -100, y)).loss.item()
    assert Trainer(model, "sgd", device="cpu").step({"input_ids": x, "labels": y}) == pytest.approx(want, rel=1e-6)
    y[:, 1] = 300
    with pytest.raises(PlanError, match=r"labels hold 2 ids outside \[0, 256\) .*counted over the targets: the shift "
                                         r"drops each row's first label"):  # 4 set, 2 of them targets: says why
        Trainer(model, "sgd", device="cpu").step({"input_ids": x, "labels": y})


def test_estimate_says_to_describe_a_batch_it_did_not_guess():
    """estimate without inputs= feeds (batch, seq) token ids with labels alike: a multiple-choice model refuses those
    labels, and the message says they are estimate's default batch and how to describe yours, which then works."""
    model = transformers.BertForMultipleChoice(transformers.BertConfig(**BERT))
    with pytest.raises(PlanError, match=r"labels of estimate's default batch .* describe your batch with inputs="):
        colabkit.estimate(model, batch=4, seq=16, device="cpu", gpu=None)
    r = colabkit.estimate(model, inputs={"input_ids": ((4, 4, 16), torch.long), "labels": ((4,), torch.long)},
                          device="cpu", gpu=None)
    assert (r["batch"], r["seq"]) == (4, 64) and r["peak_bytes"] > 0


def test_a_seq2seq_config_without_a_decoder_start_token_is_refused_with_what_to_set():
    """A T5 config built by hand in transformers 5 has no decoder_start_token_id (it lives in generation_config):
    with labels and no decoder_input_ids the model's own shift raises a bare AttributeError. colabkit's loop says
    what to set; with it set, the same batch trains. Control: the model called directly raises the raw error."""
    make = lambda start: transformers.T5ForConditionalGeneration(transformers.T5Config(  # noqa: E731
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
        pad_token_id=0, **({} if start is None else {"decoder_start_token_id": start})))
    batch = {"input_ids": torch.randint(0, V, (2, 8)), "labels": torch.randint(1, V, (2, 6))}
    with pytest.raises(AttributeError, match="decoder_start_token_id"):
        make(None)(**batch)
    kw = dict(steps=1, batch=2, device="cpu", progress=False, track=False, plan="sgd")
    with pytest.raises(PlanError, match=r"set model.config.decoder_start_token_id"):
        colabkit.train(lambda: make(None), data=[batch], **kw)
    assert colabkit.train(lambda: make(0), data=[batch], **kw)["losses"][0] > 0

"""Every bad input gets a clear error before the first training step (the README's bad-input table):
one row per case, each checking the message says what is wrong and what to do."""
import importlib.util
import json
import math
import os
import re
import time

import pytest
import torch

from colabkit.__main__ import main
from colabkit.checkpoints import CheckpointError, list_checkpoints, write_checkpoint
from colabkit.models import build_model
from colabkit.plan import PlanError
from colabkit.techniques import attention
from colabkit.techniques.offload import host_ram_guard
from colabkit.env import t4_rules
from colabkit.train import measure, train
from tests.test_checkpoints import plant_pickle


def _no_step(info):  # any completed step means the error came too late
    raise AssertionError(f"training started (step {info['step']}) before the error")


def _train(model="gpt:2x64", **kw):
    args = dict(steps=2, batch=2, seq=16, device="cpu", progress=False, track=False, callbacks=[_no_step])
    return train(model, **{**args, **kw})


class _NoBlocks(torch.nn.Module):
    """A causal LM without a list of transformer blocks (embedding -> linear head)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256)

    def forward(self, x):
        return self.head(self.emb(x))


class _NoLinear(torch.nn.Module):
    """A causal LM without a single nn.Linear (an embedding straight to logits)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(256, 256)

    def forward(self, x):
        return self.emb(x)


def test_bf16_on_t4():
    with t4_rules(), pytest.raises(PlanError, match=r"bf16: .*T4 \(sm75\) has no native bf16.*use fp16"):
        _train(plan="bf16")


def test_flash_attention_on_t4(monkeypatch):
    # a T4's facts (sm75; SDPA backends math + efficient), as torch reports them on one
    monkeypatch.setattr(attention, "sdpa_backends", lambda dev: ["math", "efficient"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    monkeypatch.setattr(attention, "emulating_t4", lambda: True)
    why = attention.refusal("flash", "cuda")
    assert why.startswith("attention:flash needs sm80+") and "(sm75)" in why and "use attention:efficient" in why


def test_flash_attention_on_cpu():
    with pytest.raises(PlanError, match="attention:flash: on the CPU only attention:math can be forced"):
        _train(plan="fp16+attention:flash")


def test_unknown_token():
    with pytest.raises(PlanError, match=r"unknown plan token 'adamw9bit'.*Known tokens:"):
        _train(plan="adamw9bit")


def test_malformed_token():
    with pytest.raises(PlanError, match=r"'accum:two': ':two' is not a positive whole number"):
        _train(plan="accum:two")


def test_conflicting_tokens():
    with pytest.raises(PlanError, match=r"'adamw8bit' and 'adamw4bit' both choose the optimizer: keep one"):
        _train(plan="adamw8bit+adamw4bit")


def test_accum_not_dividing_batch():
    with pytest.raises(PlanError, match=r"accum:3 does not divide batch 4.*multiple of 3"):
        _train(plan="accum:3", batch=4)


@pytest.mark.parametrize("name,value", [("batch", 0), ("seq", -1), ("steps", 0)])
def test_non_positive_sizes(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a positive whole number .*got {value}"):
        _train(**{name: value})


def test_sequence_longer_than_context():
    model = build_model("gpt-tiny")  # 256 learned positions
    assert model.config.block_size == 256
    with pytest.raises(ValueError, match=r"seq 512 is longer than the model's context \(256 positions\): use seq <= 256"):
        _train(model, seq=512)


def test_offload_with_too_little_host_ram():
    with pytest.raises(PlanError, match=r"offloading optimizer state needs 6.0 GiB of host RAM but only 6.0 GiB "
                                        r"is available \(1.0 GiB kept in reserve\): offload less"):
        host_ram_guard(6 << 30, "optimizer state", available=6 << 30)


def test_offload_on_cpu_run():
    with pytest.raises(PlanError, match="on a CPU run: there is nothing to offload to"):
        _train(plan="offload:optimizer")


def test_checkpointing_without_blocks():
    with pytest.raises(PlanError, match=r"checkpoint: cannot find the transformer blocks of _NoBlocks; give the "
                                        r"model a ModuleList of blocks"):
        _train(_NoBlocks(), plan="checkpoint")


def test_qlora_without_linear_layers():
    with pytest.raises(PlanError, match=r"LoRA targets \['all'\] are not modules of this _NoLinear model"):
        _train(_NoLinear(), plan="qlora:8")


def test_missing_optional_dependency(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    # (adamw8bit runs colabkit's own AdamW8bit off CUDA: lion8bit is bitsandbytes' everywhere)
    with pytest.raises(PlanError, match=r"'lion8bit' needs bitsandbytes, which is not installed: pip install bitsandbytes"):
        _train(plan="lion8bit")


def test_resume_folder_missing(tmp_path):
    with pytest.raises(CheckpointError, match=r"resume folder '.*nowhere' does not exist: check the path"):
        _train(checkpoint_dir=str(tmp_path / "nowhere"), resume="must")


def test_resume_folder_without_valid_checkpoint(tmp_path):
    with open(tmp_path / "ckpt-00000005.ckpt", "wb") as f:
        f.write(b"half a checkpoint")
    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000005.ckpt: .*; it was the oldest: none is left"), \
            pytest.raises(CheckpointError, match=r"no valid checkpoint in .*ckpt-00000005.ckpt: no end marker.*start without resume"):
        _train(checkpoint_dir=str(tmp_path), resume="must")
    assert os.listdir(tmp_path) == ["ckpt-00000005.ckpt"]


def test_resume_starts_fresh_when_there_is_nothing_to_resume(tmp_path, capsys):
    """resume=True (the CLI's --resume) is resume="auto": a missing folder is a fresh start, said so."""
    out = train("gpt:2x64", steps=1, batch=2, seq=16, device="cpu", progress=False, track=False,
                checkpoint_dir=str(tmp_path / "new"), resume=True)
    assert "nothing to resume in" in capsys.readouterr().out and out["resumed_from"] is None
    assert [s for s, _ in list_checkpoints(str(tmp_path / "new"))] == [1]


def test_steps_below_the_newest_checkpoint(tmp_path):
    train("gpt:2x64", steps=3, batch=2, seq=16, device="cpu", progress=False, track=False, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"steps=2 is below the newest checkpoint in .* \(ckpt-00000003.ckpt, step 3\): "
                                         r"to continue that run ask for more than 3 steps"):
        _train(checkpoint_dir=str(tmp_path), resume=True)


def test_bad_resume_value():
    with pytest.raises(ValueError, match=r"resume='yes': use True or 'auto'"):
        _train(checkpoint_dir="x", resume="yes")


def test_preset_sequence_longer_than_context_on_every_path(capsys):
    """A preset is never widened to the sequence: train, bench (measure) and estimate/plan refuse alike."""
    why = r"seq 100000 is longer than the model's context \(gpt-tiny: 256 positions\): use seq <= 256, or a gpt:LxD shape"
    with pytest.raises(ValueError, match=why):
        _train("gpt-tiny", seq=100000)
    r = measure("gpt-tiny", "baseline", batch=2, seq=100000, steps=1, device="cpu")
    assert not r["ok"] and re.search(why, r["error"])
    for cmd in (["estimate", "--model", "gpt-tiny"], ["plan", "--model", "gpt-tiny"], ["bench", "--model", "gpt-tiny"],
                ["train", "--model", "gpt-tiny"]):
        assert main(cmd + ["--seq", "100000"]) == 2
        assert re.match("error: " + why, capsys.readouterr().err)


def test_hub_model_sequence_longer_than_context(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["estimate", "--model", "hf:openai-community/gpt2", "--seq", "2048"]) == 2
    assert "seq 2048 is longer than the model's context (hf:openai-community/gpt2: 1024 positions)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error for a machine without a GPU")
def test_device_cuda_without_gpu():
    with pytest.raises(ValueError, match=r"device 'cuda': torch sees no CUDA GPU on this machine .*--device cpu"):
        _train(device="cuda")
    r = measure("gpt:2x64", "baseline", batch=2, seq=16, steps=1, device="cuda")
    assert not r["ok"] and "torch sees no CUDA GPU" in r["error"]


def test_bench_bad_sizes():
    r = measure("gpt:2x64", "baseline", batch=-4, seq=16, steps=1, device="cpu")
    assert not r["ok"] and r["error"] == "ValueError: batch must be a positive whole number of sequences per step, got -4"


def test_hub_id_that_cannot_be_resolved(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"hf:nonexistent/xyz is not in this machine's Hugging Face cache.*"
                                         r"set HF_HUB_OFFLINE=1 to skip the hub.*gpt:LxD / llama:LxD need no hub"):
        _train("hf:nonexistent/xyz")
    assert time.monotonic() - t0 < 20


def test_checkpoint_whose_manifest_holds_code(tmp_path):
    train("gpt:2x64", steps=1, batch=2, seq=16, device="cpu", progress=False, track=False, checkpoint_dir=str(tmp_path))
    path = list_checkpoints(str(tmp_path))[-1][1]
    plant_pickle(path, ("versions", "torch"), {"__pickle__": "gASVBQAAAAAAAACMAXiULg=="})
    with pytest.warns(RuntimeWarning, match="skipped checkpoint ckpt-00000001.ckpt: refused for safety: the manifest "
                                            "holds a pickled Python object"), \
            pytest.raises(CheckpointError, match="no valid checkpoint"):
        _train(checkpoint_dir=str(tmp_path), resume="must")


def test_saving_a_value_that_is_not_data(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot save state\['optimizer'\]\['hook'\]: a builtins.function is "
                                              r"not data.*give this object a state_dict\(\) of plain values"):
        write_checkpoint({"optimizer": {"hook": lambda: 0}}, str(tmp_path / "d"), 1)
    assert not os.path.exists(tmp_path / "d")


def test_checkpoint_from_another_plan(tmp_path):
    train("gpt:2x64", steps=1, batch=2, seq=16, device="cpu", progress=False, track=False, checkpoint_dir=str(tmp_path))
    with pytest.raises(PlanError, match=r"different run — plan: checkpoint 'baseline', this run 'sgd'"):
        _train(plan="sgd", checkpoint_dir=str(tmp_path), resume=True)


def test_bad_on_oom():
    with pytest.raises(ValueError, match=r"on_oom='retry': use 'shrink'"):
        _train(on_oom="retry")


def test_chunked_ce_where_it_cannot_apply():
    with pytest.raises(PlanError, match=r"chunked-ce computes a language model head's cross-entropy, and Sequential "
                                        r"has no LM head .*: drop chunked-ce"):
        _train(torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)), plan="chunked-ce")
    with pytest.raises(PlanError, match=r"chunked-ce computes the cross-entropy of the labels itself, .*: drop loss_fn="):
        from colabkit.trainer import Trainer
        Trainer(build_model("gpt-tiny"), "chunked-ce", device="cpu", loss_fn=lambda out, labels, n: out.sum())
    with pytest.raises(PlanError, match=r"chunked-ce and zero:3 conflict: .* use zero:2 or zero:1 with chunked-ce"):
        _train(plan="zero:3+chunked-ce")


def _tiny_llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("make", [lambda: build_model("gpt-tiny"), _tiny_llama], ids=["gpt", "hf-own-loss"])
@pytest.mark.parametrize("bad, match", [
    ("shape", r"labels have shape \(2, 12\) .* needs labels of shape \(2, 16\) .* dtype torch.long"),
    ("float", r"dtype torch.float32; .* needs labels of shape \(2, 16\) .* dtype torch.long"),
    ("int32", r"dtype torch.int32; .* dtype torch.long"),
    ("vocab", r"labels hold \d+ ids outside \[0, 256\) .* dtype torch.long"),
])
def test_malformed_labels(make, bad, match):
    """Wrong-shape, float, int32 and out-of-vocabulary labels get colabkit's error naming the expected shape
    and dtype before any forward (torch's raw errors before: "Expected input batch_size (32) to match target
    batch_size (24)", "Target 300 is out of bounds", "expected target dtype to be Long")."""
    from colabkit.trainer import Trainer
    x = torch.randint(0, 256, (2, 16))
    labels = {"shape": x[:, :12], "float": x.float(), "int32": x.int(), "vocab": x.clone().index_fill_(1, torch.tensor([3]), 256)}
    model = make()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    t = Trainer(model, "baseline", device="cpu")
    for batch in ({"input_ids": x, "labels": labels[bad]}, (x, labels[bad])):
        with pytest.raises(PlanError, match=match):
            t.step(*batch) if isinstance(batch, tuple) else t.step(batch)
    assert calls == []  # refused before the forward
    ok = x.clone()
    ok[:, :3] = -100  # negative control: well-formed labels (ignored positions too) train
    assert math.isfinite(t.step({"input_ids": x, "labels": ok})) and calls


class _PositionsFirst(torch.nn.Module):
    """A user's model whose first nn.Embedding is a position table (16 rows), not the token table (256)."""

    def __init__(self):
        super().__init__()
        self.pos, self.tok, self.head = torch.nn.Embedding(16, 8), torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

    def forward(self, input_ids, labels=None):
        return self.head(self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1])))


@pytest.mark.parametrize("make", [lambda: build_model("gpt-tiny"), _tiny_llama], ids=["gpt", "hf"])
def test_out_of_vocabulary_input_ids(make):
    """Token ids the input embedding has no row for (a tokenizer larger than the model's vocabulary) get colabkit's
    error before the forward, naming the embedding's size and the fix; torch said "index out of range in self"
    (a device-side assert on a GPU). Negative controls: the same batch with its ids in range trains; a plain
    module, whose token table colabkit cannot tell from its other embeddings, is not refused on a guess (its
    first nn.Embedding is a 16-row position table; refused as out of range until 2026-11-27)."""
    from colabkit.trainer import Trainer
    x = torch.randint(0, 256, (2, 16))
    assert math.isfinite(Trainer(_PositionsFirst(), "baseline", device="cpu").step({"input_ids": x, "labels": x}))
    model = make()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    t = Trainer(model, "baseline", device="cpu")
    for bad in (x.clone().index_fill_(1, torch.tensor([5]), 300), x.clone().index_fill_(1, torch.tensor([2]), -1)):
        with pytest.raises(PlanError, match=r"input_ids hold 2 ids outside \[0, 256\) .*resize_token_embeddings"):
            t.step({"input_ids": bad, "labels": x})
    assert calls == []
    assert math.isfinite(t.step({"input_ids": x, "labels": x})) and calls


def test_malformed_classification_labels():
    from colabkit.trainer import Trainer
    from tests.own_models import bert
    t = Trainer(bert(), "baseline", device="cpu")  # num_labels=3
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(PlanError, match=r"ids outside \[0, 3\) .* shape \(2,\) and dtype torch.long"):
        t.step({"input_ids": ids, "labels": torch.tensor([0, 3])})
    with pytest.raises(PlanError, match=r"labels have shape \(3,\) .* shape \(2,\) and dtype torch.long"):
        t.step({"input_ids": ids, "labels": torch.tensor([0, 1, 2])})
    assert math.isfinite(t.step({"input_ids": ids, "labels": torch.tensor([0, 2])}))  # negative control


def test_every_command_refuses_what_train_refuses(tmp_path):
    """accum:K that does not divide the batch, and several ranks without a zero:N token, are refused by estimate
    and measure (bench) as by train -- estimate predicted and bench measured both until 2026-11-27. A local hf:
    path that is not a model folder says so, instead of a hub lookup's error."""
    import colabkit
    from colabkit.models import HubError

    with pytest.raises(colabkit.PlanError, match="accum:3 does not divide batch 4"):
        colabkit.estimate("gpt-tiny", "accum:3", batch=4, seq=32)
    assert "accum:3 does not divide batch 4" in colabkit.measure("gpt-tiny", "accum:3", batch=4, seq=32, steps=1,
                                                                  device="cpu")["error"]
    with pytest.raises(colabkit.PlanError, match="has no zero:N token"):
        colabkit.estimate("gpt:2x64", "checkpoint", batch=8, seq=32, device="cpu", gpu=None, world_size=2)
    assert colabkit.estimate("gpt:2x64", "accum:2", batch=4, seq=32)["peak_bytes"] > 0  # control: these run
    (tmp_path / "empty").mkdir()
    with pytest.raises(HubError, match="the folder does not exist"):
        colabkit.estimate(f"hf:{tmp_path / 'missing'}", batch=1, seq=16)
    with pytest.raises(HubError, match="the folder has no config.json"):
        colabkit.estimate(f"hf:{tmp_path / 'empty'}", batch=1, seq=16)


class _Tiny(torch.nn.Module):
    """A user's plain language model: no get_input_embeddings, a table of 100 token rows (colabkit's corpus is
    bytes: ids up to 255) and a position table."""

    def __init__(self, vocab: int = 100):
        super().__init__()
        self.tok, self.pos, self.head = torch.nn.Embedding(vocab, 16), torch.nn.Embedding(64, 16), torch.nn.Linear(16, vocab)

    def forward(self, x):
        return self.head(self.tok(x) + self.pos(torch.arange(x.shape[-1])))


def test_a_plain_modules_embedding_refuses_ids_it_has_no_row_for(monkeypatch, tmp_path, capsys):
    """A plain module (no named token table) given ids beyond its table: colabkit's error names the table, its rows
    and the ids, in the loop, through Trainer.step and on the command line, before torch's lookup; nothing stays on
    the user's model (it pickles without colabkit's hooks). Control: with the check off, torch's own IndexError is
    what the user gets."""
    from colabkit import Trainer
    from colabkit import trainer as trainer_mod

    with pytest.raises(PlanError, match=r"embedding 'tok' \(100 rows\) was given \d+ indices outside \[0, 100\)"):
        train(_Tiny, plan="baseline", steps=1, batch=2, seq=16, device="cpu")
    x, model = torch.tensor([[1, 2, 150, 3]]), _Tiny()
    with pytest.raises(PlanError, match=r"'tok' \(100 rows\) was given 1 index outside \[0, 100\) \(min 150, max 150\)"):
        Trainer(model, "baseline", device="cpu").step(x, x)
    assert Trainer(model, "baseline", device="cpu").step(x.clamp(max=99), x.clamp(max=99)) > 0  # in range: trains
    assert not model.tok._forward_pre_hooks and not torch.nn.modules.module._global_forward_pre_hooks  # none left
    with pytest.raises(IndexError):  # outside a step the model is the user's own again: torch's lookup
        model(x)
    (tmp_path / "mine.py").write_text("import sys; sys.path.insert(0, %r)\nfrom tests.test_bad_input import _Tiny\n"
                                      "def build():\n    return _Tiny()\n" % os.getcwd())
    assert main(["train", "--model", f"{tmp_path / 'mine.py'}:build", "--steps", "1", "--batch", "2", "--seq", "16",
                 "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "'tok' (100 rows)" in err and "ids 0-255" in err and "--data FILE.py:FN" in err and "Traceback" not in err, err
    monkeypatch.setattr(trainer_mod, "lookup_tables", lambda model: {})
    with pytest.raises(IndexError, match="index out of range"):
        Trainer(_Tiny(), "baseline", device="cpu").step(x, x)


def tiny_batches():
    """Your own batches for _Tiny (ids below its 100 rows): what `train --data FILE.py:FN` calls."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (x := torch.randint(0, 100, (2, 16), generator=g)), "labels": x} for _ in range(3)]


def test_the_cli_trains_a_plain_module_on_your_own_data(tmp_path, capsys):
    """`train --data FILE.py:FN`: the batches the function returns, as train(model, data=...) takes them -- the
    same weights as that Python call. Control: without --data the run gets colabkit's byte corpus, which the
    100-row table cannot take (the error says to pass --data's equivalent)."""
    from colabkit import train

    src = tmp_path / "mine.py"
    src.write_text("import sys; sys.path.insert(0, %r)\nfrom tests.test_bad_input import _Tiny, tiny_batches\n"
                   "def build():\n    return _Tiny()\n" % os.getcwd())
    argv = ["train", "--model", f"{src}:build", "--steps", "3", "--batch", "2", "--seq", "16", "--device", "cpu",
            "--json", "-"]
    assert main([*argv, "--data", f"{src}:tiny_batches"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = train(_Tiny, data=tiny_batches(), steps=3, batch=2, seq=16, device="cpu", progress=False)
    assert got["step"] == 3 and got["weights_sha256"] == want["weights_sha256"] and len(got["losses"]) == 3
    assert main(argv) == 2 and "train(model, data=...)" in capsys.readouterr().err
    assert main([*argv, "--data", "batches"]) == 2 and "give FILE.py:FUNCTION" in capsys.readouterr().err

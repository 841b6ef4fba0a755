"""The train loop as events (colabkit.callbacks): a user's own object sees every event in order with the
checkpoints' and the trainer's step numbers (also across a resume), plain functions still get the step's
dict, today's keyword arguments and the Checkpointing object say the same thing, and train() is short."""
import ast
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

import colabkit
from colabkit.callbacks import Callback
from colabkit.checkpoints import Checkpointing, list_checkpoints
from colabkit.models import build_model
from colabkit.train import train

KW = dict(batch=2, seq=16, seed=3, device="cpu", progress=False, track=False)


class Recorder(Callback):
    """Every event with the step the trainer reports at that moment (``run.step``) and the event's own number."""

    def __init__(self):
        self.events = []

    def on_init_end(self, run):
        self.events.append(("init_end", run.step))

    def on_train_begin(self, run):
        self.events.append(("train_begin", run.step))

    def on_step_begin(self, run, step):
        self.events.append(("step_begin", step, run.step))

    def on_step_end(self, run, event):
        self.events.append(("step_end", event["step"], run.step))
        self.last_loss = event["loss"]

    def on_evaluate(self, run, step, loss):
        self.events.append(("evaluate", step, run.step))

    def on_save(self, run, path):
        self.events.append(("save", int(os.path.basename(path)[5:13]), run.step))

    def on_oom(self, run, event):
        self.events.append(("oom", event["step"], event["recovered"]))

    def on_train_end(self, run):
        self.events.append(("train_end", run.step, run.error is None))


def _expected(first, last, every, evals=0, end_save=True):
    """The events of steps first..last (1-based): saves every ``every`` steps (and at the end), evaluations."""
    ev = [("init_end", 0), ("train_begin", first - 1)]  # the checkpoint is restored at init_end (Checkpointing's)
    for n in range(first, last + 1):
        ev += [("step_begin", n, n - 1), ("step_end", n, n)]
        if (every and n % every == 0) or (end_save and n == last):  # the cadence's saves, and one at the end
            ev.append(("save", n, n))
        if evals and n % evals == 0:
            ev.append(("evaluate", n, n))
    return ev + [("train_end", last, True)]


def test_user_object_sees_every_event_in_order_across_a_resume(tmp_path):
    d = str(tmp_path / "ck")
    first, second = Recorder(), Recorder()
    a = train("gpt:2x64", steps=3, checkpoint_dir=d, checkpoint_every=2, eval_every=3, callbacks=[first], **KW)
    assert first.events == _expected(1, 3, every=2, evals=3)
    # the saves the object saw are the files on disk (an independent record of the steps)
    assert [s for s, _ in list_checkpoints(d)] == [e[1] for e in first.events if e[0] == "save"] == [2, 3]
    b = train("gpt:2x64", steps=5, checkpoint_dir=d, checkpoint_every=2, resume=True, callbacks=[second], **KW)
    assert b["resumed_from"].endswith("ckpt-00000003.ckpt")
    assert second.events == _expected(4, 5, every=2)  # the second run's events start at the resumed step
    # the resumed run's steps are the uninterrupted run's steps 4 and 5 (same losses, same weights)
    whole = train("gpt:2x64", steps=5, **KW)
    assert a["losses"] + b["losses"] == pytest.approx(whole["losses"], abs=0) and b["weights_sha256"] == whole["weights_sha256"]
    assert second.last_loss == whole["losses"][-1]
    # negative control: a run not resumed starts its events at step 1 again
    fresh = Recorder()
    train("gpt:2x64", steps=2, callbacks=[fresh], **KW)
    assert fresh.events == _expected(1, 2, every=0, end_save=False) != second.events[:len(fresh.events)]


def test_train_end_fires_with_the_error_and_no_end_checkpoint(tmp_path):
    """A step that raises: on_train_end still fires (logs close) with run.error, and no end-of-run save."""
    class Boom(Callback):
        def on_step_end(self, run, event):
            if event["step"] == 2:
                raise KeyboardInterrupt

    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        train("gpt:2x64", steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=3, callbacks=[rec, Boom()], **KW)
    assert rec.events[-1] == ("train_end", 2, False)
    assert not any(e[0] == "save" for e in rec.events) and list_checkpoints(str(tmp_path)) == []


def test_oom_events_shrink_and_stop(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))

    class OOMAbove(torch.nn.Module):  # a GPU too small for a micro-batch above ``limit`` sequences
        def __init__(self, limit):
            super().__init__()
            self.gpt, self.limit = build_model("gpt:2x64"), limit

        def forward(self, x):
            out = self.gpt(x)
            if x.shape[0] > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return out

    rec = Recorder()
    out = train(OOMAbove(2), steps=2, on_oom="shrink", callbacks=[rec], **{**KW, "batch": 8})
    assert [e for e in rec.events if e[0] == "oom"] == [("oom", 1, True), ("oom", 1, True)]  # 8 -> 4 -> 2
    assert len(out["oom_shrinks"]) == 2
    rec = Recorder()
    with pytest.raises(torch.OutOfMemoryError):
        train(OOMAbove(0), steps=2, checkpoint_dir=str(tmp_path / "ck"), callbacks=[rec], **{**KW, "track": True})
    # out of memory in step 1: the event, then the state before the step saved, then the end (with the error)
    assert rec.events[-3:] == [("oom", 1, False), ("save", 0, 0), ("train_end", 0, False)]
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [0]


def test_plain_function_callbacks_get_the_step_dict():
    seen = []
    out = train("gpt:2x64", steps=3, callbacks=[seen.append], **KW)
    assert [sorted(e) for e in seen] == [["loss", "step", "step_time_s", "trainer"]] * 3
    assert [e["step"] for e in seen] == [1, 2, 3] and [e["loss"] for e in seen] == out["losses"]
    assert all(e["trainer"] is out["trainer"] for e in seen)
    with pytest.raises(TypeError, match="callbacks"):
        train("gpt:2x64", steps=1, callbacks=[42], **KW)


def test_live_plot_gets_the_trackers_samples():
    class Plot:
        def __init__(self):
            self.samples = []

        def update(self, sample):
            self.samples.append(sample)

    p = Plot()
    out = train("gpt:2x64", steps=2, live_plot=p, **{**KW, "track": True})
    assert p.samples == out["timeline"] and {s["step"] for s in p.samples} >= {0, 1}


# today's keyword arguments: every one of them (names and defaults) is still train's
OLD = dict(data=None, plan="baseline", steps=100, batch=8, seq=128, seed=0, device=None, lr=3e-4, max_grad_norm=None,
           track=True, live_plot=None, callbacks=(), checkpoint_dir=None, checkpoint_every=0, checkpoint_minutes=None,
           resume=False, progress=True, eval_every=0, keep=3, on_oom="stop", budget_bytes=None,
           host_limit_bytes=int(12.7e9), log=None, log_dir=None, offload_sim=False, deterministic=False)


@pytest.mark.filterwarnings("ignore:CSVLogger")
def test_old_keyword_arguments_still_work(tmp_path):
    params = inspect.signature(train).parameters
    assert {k: params[k].default for k in OLD} == OLD
    d1, d2 = str(tmp_path / "a"), str(tmp_path / "b")
    kw = {**OLD, "steps": 3, "batch": 2, "seq": 16, "seed": 1, "device": "cpu", "progress": False, "track": False,
          "eval_every": 2, "log": "csv", "log_dir": str(tmp_path / "logs"), "max_grad_norm": 1.0, "lr": 1e-3}
    old = train("gpt:2x64", **{**kw, "checkpoint_dir": d1, "checkpoint_every": 2, "keep": 1})
    new = train("gpt:2x64", **{**kw, "checkpointing": Checkpointing(d2, every=2, keep=1)})
    assert [os.path.basename(p) for _, p in list_checkpoints(d1)] == ["ckpt-00000003.ckpt"]
    assert os.listdir(d1) == os.listdir(d2) and old["weights_sha256"] == new["weights_sha256"]
    assert [e[0] for e in old["evals"]] == [2] and os.path.exists(tmp_path / "logs" / "metrics.csv")
    with pytest.raises(ValueError, match="not both"):
        train("gpt:2x64", checkpoint_dir=d1, checkpointing=Checkpointing(d2), **{**KW, "steps": 1})


def body_lines(fn: ast.FunctionDef) -> int:
    """Lines of a function, signature included, its docstring not."""
    n = fn.end_lineno - fn.lineno + 1
    doc = fn.body[0]
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        n -= doc.end_lineno - doc.lineno + 1
    return n


def test_train_is_at_most_60_lines():
    tree = ast.parse(Path(inspect.getsourcefile(sys.modules["colabkit.train"])).read_text())
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "train")
    assert body_lines(fn) <= 60
    # negative control: the count sees a long body (the docstring alone is not counted)
    long = ast.parse("def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * 61).body[0]
    assert body_lines(long) == 62 and body_lines(ast.parse("def g():\n    '''d\n    d'''\n    pass\n").body[0]) == 2


def test_callbacks_are_public():
    assert colabkit.Callback is Callback and colabkit.Checkpointing is Checkpointing


def test_a_transformers_callback_is_refused_with_where_it_belongs():
    """A transformers.TrainerCallback (args, state, control) given to colabkit.train: said at once, not a
    TypeError about 'state' and 'control' from inside the loop."""
    import transformers

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw): ...

    for cb in (Steps(), colabkit.MemoryCallback()):
        with pytest.raises(TypeError, match=r"is a transformers.TrainerCallback .* transformers.Trainer\(callbacks="):
            train("gpt:2x64", callbacks=[cb], **{**KW, "steps": 1})

    class Mine(Callback):  # negative control: colabkit's own Callback with the same method name runs
        def __init__(self): self.steps = []
        def on_step_end(self, run, event): self.steps.append(event["step"])
    mine = Mine()
    train("gpt:2x64", callbacks=[mine], **{**KW, "steps": 1})
    assert mine.steps == [1]

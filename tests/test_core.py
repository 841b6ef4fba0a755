"""Models, data, env, the train loop (determinism, exact resume) and the CLI contract."""
import importlib.util
import json
import os

import pytest
import torch

import colabkit
from colabkit.__main__ import bench_table as main_table, main
from colabkit.models import PRESETS, build_model, count_params, gpt_config
from colabkit.plan import Plan, PlanError
from colabkit.train import measure, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,expected", [("gpt2-124m", 124_439_808), ("gpt2-350m", 354_823_168),
                                           ("gpt2-774m", 774_030_080), ("gpt2-1.5b", 1_557_611_200)])
def test_gpt2_presets_have_gpt2_parameter_counts(name, expected):
    # Counts of the published GPT-2 checkpoints (tied embeddings), from the config and from a model on meta.
    assert PRESETS[name].n_params == expected
    with torch.device("meta"):
        assert count_params(build_model(name)) == expected


def test_gpt_shape_names_and_errors():
    cfg = gpt_config("gpt:8x256")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (8, 256, 4, 256)
    assert gpt_config("gpt:2x128:v50257").vocab_size == 50257
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt-huge")


def test_env_report_and_smoke(monkeypatch):
    info = colabkit.env()
    for key in ("platform", "gpu", "capability", "vram_total_bytes", "host_ram_total_bytes", "bf16_native",
                "sdpa_backends", "smoke", "emulating_t4"):
        assert key in info
    assert info["host_ram_total_bytes"] > 0
    monkeypatch.setenv("COLABKIT_SMOKE", "0")
    assert colabkit.smoke_mode() is False
    monkeypatch.setenv("COLABKIT_SMOKE", "1")
    assert colabkit.smoke_mode() is True
    if not torch.cuda.is_available():
        assert info["bf16_native"] is False and info["sdpa_backends"] == ["math"]
        assert "No GPU attached" in colabkit.format_env(info)
        # the hint follows the smoke flag and T4 rules on a CPU claim no GPU (a full-size CPU run said "smoke")
        full = colabkit.format_env({**info, "smoke": False, "emulating_t4": True})
        assert "at full sizes" in full and "smoke mode (tiny" not in full and "larger GPU" not in full
        assert "in smoke mode (tiny sizes)" in colabkit.format_env({**info, "smoke": True})


def test_env_looks_bitsandbytes_up_once_found_and_again_while_absent(monkeypatch):
    """env() runs per estimate (a plan: ~100 calls); the installed bitsandbytes' version is kept once found,
    an absence is looked up again (a pip install afterwards is seen). Reference: importlib.metadata's answer."""
    import importlib.metadata as md

    env_mod = importlib.import_module("colabkit.env")  # the module (colabkit.env is also the function)

    calls = []
    installed = [None]

    def version(name):
        calls.append(name)
        if installed[0] is None:
            raise md.PackageNotFoundError(name)
        return installed[0]

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(env_mod, "_BNB_VERSION", [])
    assert colabkit.env()["bitsandbytes"] is None and colabkit.env()["bitsandbytes"] is None
    assert calls == ["bitsandbytes"] * 2  # absent: asked each time
    installed[0] = "0.50.2"
    assert [colabkit.env()["bitsandbytes"] for _ in range(3)] == ["0.50.2"] * 3
    assert calls == ["bitsandbytes"] * 3  # found once, then kept


def test_emulate_t4_refuses_bf16_and_flash():
    try:
        info = colabkit.emulate_t4()
        assert info["emulating_t4"] and info["bf16_native"] is False and "flash" not in info["sdpa_backends"]
        assert info["budget_bytes"] == colabkit.T4_USABLE_BYTES
    finally:
        colabkit.emulate_t4(False)


def test_plan_errors_are_actionable():
    with pytest.raises(PlanError, match="Known tokens"):
        Plan.parse("warp-drive")
    with pytest.raises(PlanError, match="alone"):
        Plan.parse("baseline+adamw")
    assert str(Plan.parse("baseline")) == "baseline"


def test_loss_falls_and_runs_are_repeatable():
    a = train("gpt-tiny", steps=30, batch=8, seq=64, seed=3, lr=3e-3, progress=False, track=False)
    b = train("gpt-tiny", steps=30, batch=8, seq=64, seed=3, lr=3e-3, progress=False, track=False)
    assert a["losses"] == b["losses"] and a["weights_sha256"] == b["weights_sha256"]
    assert a["losses"][0] > 5.0  # ~ln(256) at init
    assert sum(a["losses"][-5:]) / 5 < a["losses"][0] - 1.5  # the corpus is learnable


def test_resume_is_exact(tmp_path):
    full = train("gpt-tiny", steps=6, batch=4, seq=32, seed=1, progress=False, track=False)
    d = str(tmp_path / "ck")
    first = train("gpt-tiny", steps=3, batch=4, seq=32, seed=1, progress=False, track=False,
                  checkpoint_dir=d, checkpoint_every=3)
    assert first["step"] == 3
    torch.manual_seed(12345)  # a fresh process would have other RNG state: the checkpoint restores it
    rest = train("gpt-tiny", steps=6, batch=4, seq=32, seed=1, progress=False, track=False,
                 checkpoint_dir=d, checkpoint_every=3, resume=True)
    assert rest["step"] == 6
    assert first["losses"] + rest["losses"] == full["losses"]
    assert rest["weights_sha256"] == full["weights_sha256"]


def test_resume_with_other_plan_is_refused(tmp_path):
    d = str(tmp_path / "ck")
    train("gpt-tiny", steps=1, batch=2, seq=16, progress=False, track=False, checkpoint_dir=d, checkpoint_every=1)
    with pytest.raises(PlanError, match="same plan"):
        train("gpt-tiny", plan="sgd", steps=2, batch=2, seq=16, progress=False, track=False, checkpoint_dir=d,
              checkpoint_every=1, resume=True)


def test_measure_record_contract_and_repeatability():
    r1 = measure("gpt-tiny", "baseline", batch=4, seq=32, steps=2)
    r2 = measure("gpt-tiny", "baseline", batch=4, seq=32, steps=2)
    for key in ("plan", "model", "params", "peak_bytes", "breakdown", "step_time_s", "loss", "ok", "error"):
        assert key in r1
    assert r1["ok"] and r1["error"] is None and r1["loss"] == r2["loss"]
    p = r1["params"]
    assert r1["breakdown"]["params"] == 4 * p and r1["breakdown"]["grads"] == 4 * p
    assert 8 * p <= r1["breakdown"]["optimizer"] <= 8 * p + 4 * 64
    assert r1["breakdown"]["activations"] > 0
    assert r1["peak_bytes"] >= max(r1["breakdown"].values())


def test_measure_custom_model_fn():
    def tiny_lm():  # any (B, S) -> (B, S, V) module
        return torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))

    r = measure(tiny_lm, "baseline", batch=2, seq=16, steps=1)
    assert r["ok"] and r["params"] == 256 * 32 + 32 * 256 + 256


def test_measure_reports_errors_instead_of_raising():
    r = measure("gpt-tiny", "bogus-token", batch=2, seq=16, steps=1)
    assert not r["ok"] and "unknown plan token" in r["error"]


def _cli(capsys, *args) -> tuple[int, str, str]:
    """``python -m colabkit <args>`` as that process runs it (``main(argv)``, its exit status, what it printed), in
    this process: the contract is main's output, not an interpreter start (tests/test_cli.py runs real processes)."""
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_bench_contract(capsys):
    rc, out, err = _cli(capsys, "bench", "--model", "gpt-tiny", "--plan", "baseline", "--device", "cpu", "--steps", "2",
                        "--json", "-")
    assert rc == 0, err
    data = json.loads(out)  # stdout holds the JSON only
    assert set(data) == {"env", "results"} and data["env"]["device"] in ("cpu", "cuda")
    r = data["results"][0]
    assert set(r["breakdown"]) == {"params", "grads", "optimizer", "activations", "other"}
    p = r["params"]
    assert (r["breakdown"]["params"], r["breakdown"]["grads"]) == (4 * p, 4 * p)
    assert abs(r["breakdown"]["optimizer"] / p - 8) < 0.01


def test_cli_env_and_bad_plan(capsys):
    rc, out, _ = _cli(capsys, "env", "--json", "-")
    assert rc == 0 and "smoke" in json.loads(out)
    rc, out, _ = _cli(capsys, "bench", "--model", "gpt-tiny", "--plan", "nope", "--device", "cpu", "--steps", "1")
    assert rc == 1 and "unknown plan token" in out


def test_cli_train_contract(tmp_path, capsys):
    rc, out, err = _cli(capsys, "train", "--model", "gpt-tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--device",
                        "cpu", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1", "--json", "-")
    assert rc == 0, err
    data = json.loads(out)
    assert data["step"] == 2 and len(data["weights_sha256"]) == 64 and data["loss"] > 0


def _benchmark_script(name: str):
    """benchmarks/<name>.py as a module (its ``main(argv)`` is what ``python benchmarks/<name>.py`` runs)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_script_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _benchmark_script("run").main(["--device", "cpu", "--model", "gpt-tiny", "--batch", "2", "--seq", "16",
                                          "--steps", "2", "--plan", "baseline", "--plan", "checkpoint", "--plan",
                                          "offload:optimizer", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    base, ck, off = data["results"]
    assert base["ok"] and ck["ok"] and not off["ok"] and "nothing to offload" in off["error"]
    # the estimator traces two steps (the second one's backward holds the optimizer state): so does the run; with
    # one step and fused AdamW (no step temporaries) the run's peak is the first step's, ~6% lower here
    assert abs(base["estimate_error"]) < 0.05
    assert "| `checkpoint` |" in (tmp_path / "r.md").read_text()
    assert capsys.readouterr().out.startswith("`gpt-tiny`, batch 2")  # the table, printed as the script prints it


def test_load_model_hook_lets_a_technique_load_the_model():
    from colabkit.plan import REGISTRY, Technique, register
    from colabkit.trainer import load_model

    sentinel = torch.nn.Linear(2, 2)
    register(Technique(name="test-loader", help="test", load_model=lambda name, plan, ctx, seq: sentinel
                       if name == "special" else None))
    try:
        assert load_model("special", "test-loader") is sentinel
        assert load_model("gpt-tiny", "test-loader").config.n_layer == 2  # None: built normally
    finally:
        del REGISTRY["test-loader"]
    # qlora only takes over for hub models on a GPU; on the CPU the base is quantized in prepare_model
    assert REGISTRY["qlora"].load_model("hf:some/model", Plan.parse("qlora:8"), colabkit.Context(device=torch.device("cpu")), 64) is None


def test_measure_untracked_timing_keeps_memory_and_loss():
    tracked = measure("gpt-tiny", "baseline", batch=4, seq=32, steps=2, timing_steps=0)
    timed = measure("gpt-tiny", "baseline", batch=4, seq=32, steps=2, timing_steps=2)
    # the extra steps only time: the record's memory and loss are those of the tracked steps
    assert timed["loss"] == tracked["loss"] and timed["peak_bytes"] == tracked["peak_bytes"]
    assert timed["breakdown"] == tracked["breakdown"]
    assert timed["step_time_s"] > 0 and timed["step_time_tracked_s"] > 0
    assert tracked["step_time_s"] == tracked["step_time_tracked_s"] and tracked["timing_steps"] == 0
    # the tables show no tracked figure as speed (the tracker made a gpt-tiny step 1.6x slower): '-' for it
    table = colabkit.comparison_table([timed, tracked])
    assert [line.split()[-2] for line in table.splitlines()[1:3]] == [f"{timed['step_time_s']:.3f}", "-"], table
    assert "step_times" in table.splitlines()[-1]
    bench = main_table({"results": [timed, tracked]})
    assert [line.split()[-2] for line in bench.splitlines()[1:3]] == [f"{timed['step_time_s']:.3f}", "-"], bench

"""The commands prepared for a lent GPU (issue 35): benchmarks/device_run.sh and device_notebooks.sh in their
dry run (what CI runs), the wheel list and the travelling size, and the offline stand-in for hub models."""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess

import nbformat
import pytest
import torch

import colabkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheels, device_run, device_notebooks, bench = (_script(n) for n in ("device_wheels", "device_run", "device_notebooks", "run"))


# ----- the first command: selftest + every plan token, one results file ----------------------------------------
def test_bench_records_carry_the_estimators_figures_and_the_baseline_loss(tmp_path):
    """Fast twin of the dry run: run.py's records (in process) as device_run.py files them."""
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--model", "gpt-tiny", "--batch", "2", "--seq", "16", "--steps", "2",
                       "--plan", "baseline", "--plan", "offload:optimizer", "--plan", "chunked-ce", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    base, off, ce = data["results"]
    assert base["ok"] and ce["ok"] and not off["ok"] and "nothing to offload" in off["error"]
    # the estimator's own figures (the wrapped library), not recomputed by the script
    est = colabkit.estimate("gpt-tiny", "chunked-ce", batch=2, seq=16, gpu=None, device="cpu")
    assert ce["estimate_peak_bytes"] == est["peak_bytes"]
    assert ce["estimate_error"] == pytest.approx((est["peak_bytes"] - ce["peak_bytes"]) / ce["peak_bytes"])
    st = colabkit.predict_step_time("gpt-tiny", "chunked-ce", 2, 16)["step_time_s"]
    assert ce["estimate_step_time_s"] == pytest.approx(st, rel=0.5)  # the CPU's throughput is re-measured per call
    assert ce["step_profile"].startswith("this CPU")
    assert ce["timing_steps"] == 1 and ce["step_time_s"] != ce["step_time_tracked_s"]  # set against an untracked step
    assert ce["loss_vs_baseline"] == ce["loss"] - base["loss"] and base["loss_vs_baseline"] == 0
    assert "estimate_step_time_t4_s" not in ce  # no T4 emulation: no T4 time claimed
    run = {"env": device_run.environment(None, data, dry=True), "config": {}, "limit_s": 240, "wall_s": 1.0,
           "phases": {"bench": {"rc": 0, "wall_s": 1.0}}, "selftest": None, "bench": data,
           "summary": device_run.summary(data)}
    assert run["summary"]["measured"] == 2 and run["summary"]["refused"] == 1 and run["summary"]["not_run"] == 0
    md = device_run.markdown(run)
    assert md.startswith("# colabkit on dry-run, cpu,") and "| `offload:optimizer` | refused:" in md
    assert "| `chunked-ce` |" in md and "predicted with this CPU" in md


def test_a_spent_time_budget_shows_plans_as_not_run():
    data = bench.run("gpt-tiny", ["baseline", "checkpoint"], 2, 16, 1, "cpu", budget_s=-1)
    assert [r.get("not_run") for r in data["results"]] == [True, True]
    md = bench.markdown(data)
    assert "| `baseline` | not run:" in md and "refused" not in md
    # the negative control: with time left the plan is measured
    assert bench.run("gpt-tiny", ["baseline"], 2, 16, 1, "cpu", budget_s=600)["results"][0]["ok"]


def test_result_files_are_named_after_the_gpu_and_the_date():
    env = {"date": "2026-11-27T04:00:00+00:00"}
    assert device_run.result_stem({**env, "gpu": "NVIDIA H100 80GB HBM3"}, dry=False) == "cuda-h100-t4emu-2026-11-27"
    # a GPU without a colabkit profile keeps its own name (never a neighbour's)
    assert device_run.result_stem({**env, "gpu": "NVIDIA H200"}, dry=False) == "cuda-h200-t4emu-2026-11-27"
    assert device_run.result_stem({**env, "gpu": "NVIDIA B200"}, dry=False) == "cuda-nvidia-b200-t4emu-2026-11-27"
    assert device_run.result_stem({**env, "gpu": None}, dry=True) == "dry-run-cpu-2026-11-27"


def test_step_time_profile_on_a_cpu_is_the_cpus():
    assert bench.step_profile("cpu") == (None, "this CPU (measured throughput)")


def test_default_plans_hold_every_token_the_issue_names():
    assert set(device_run.FIRST) <= set(bench.PLANS)  # the device run's order: these first, then the rest
    tokens = {t for p in bench.PLANS for t in p.split("+")}
    for t in ("paged-adamw8bit", "adamw4bit", "fused-step", "offload:optimizer", "offload:activations",
              "offload:params", "offload:disk", "compress:int8", "attention:efficient", "chunked-ce", "lora:8",
              "qlora:8", "bf16", "attention:flash"):
        assert t in tokens, t
    for p in bench.PLANS:  # each one a valid plan (a refusal on the device is a finding, a typo is not)
        colabkit.Plan.parse(p)


@pytest.mark.slow  # fast twin: test_bench_records_carry_the_estimators_figures_and_the_baseline_loss
def test_device_run_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLABKIT_SMOKE")}
    # a check named like an option (as a rerun of the failed checks names them) reaches the selftest as a value
    checks = ["--check=--deterministic", "--check", "peak vs estimate: baseline"]
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_run.sh"), str(out), "--dry-run", *checks],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    stem = f"dry-run-cpu-{datetime.datetime.now(datetime.timezone.utc).date().isoformat()}"
    assert sorted(os.listdir(out)) == sorted([f"{stem}.json", f"{stem}.md", "device_run.log"])  # <= 8 files back
    data = json.loads((out / f"{stem}.json").read_text())
    assert data["env"]["label"] == "dry-run, cpu" and {"gpu", "driver", "torch", "cuda", "date"} <= set(data["env"])
    assert data["selftest"]["simulated"] is True and data["selftest"]["ok"]
    assert [(c["name"], c["status"]) for c in data["selftest"]["checks"]] == [
        ("--deterministic", "pass"), ("peak vs estimate: baseline", "pass")]
    plans = {r["plan"]: r for r in data["bench"]["results"]}
    assert plans["baseline"]["ok"] and not plans["offload:optimizer"]["ok"]
    assert "| `offload:optimizer` | refused:" in (out / f"{stem}.md").read_text()


# ----- the second command: the notebooks -------------------------------------------------------------------
def test_the_parts_hold_every_notebook_once():
    numbers = sorted(f[:2] for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))
    parts = list(device_notebooks.PARTS.values())
    assert sorted(sum(parts, [])) == numbers   # each once: a repeat would make the sorted list longer
    assert len(device_notebooks.notebooks("all")) == len(numbers) == 16
    assert set(device_notebooks.HUB_MODELS) <= set(numbers)


def test_unknown_notebook_numbers_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        device_notebooks.main(["--out", str(tmp_path), "--only", "99"])
    assert "no notebook matches --only 99" in capsys.readouterr().err and not os.listdir(tmp_path)
    assert [os.path.basename(p)[:2] for p in device_notebooks.notebooks(only=["99", "00"])] == ["00"]


def test_inserted_cell_emulates_a_t4_on_the_gpu_only_and_leaves_the_file(tmp_path):
    path = os.path.join(ROOT, "notebooks", "00_quickstart.ipynb")
    before = open(path, "rb").read()
    nb = device_notebooks.prepared(path, dry=False, stand_ins={"Qwen/Qwen2.5-0.5B": "/tmp/x"})
    first = nb.cells[0]
    assert first.metadata["tags"] == [device_notebooks.INSERTED_TAG] and "colabkit.emulate_t4()" in first.source
    assert "Qwen/Qwen2.5-0.5B is a stand-in" in first.source and "random weights" in first.source
    assert nb.cells[1:] == nbformat.read(path, as_version=4).cells and open(path, "rb").read() == before
    assert "emulate_t4" not in device_notebooks.first_cell(dry=True, stand_ins={})  # a CPU has nothing to cap
    compile(device_notebooks.first_cell(dry=False, stand_ins={"a/b": "/tmp/y"}), "cell", "exec")


def test_the_inserted_cell_says_what_ran_on_a_cpu_rehearsal(capsys):
    """At real size on a CPU (no --dry-run, no GPU) the cell named the GPU as None "with T4 emulation"."""
    if torch.cuda.is_available():
        pytest.skip("the CPU rehearsal's wording; a GPU prints its name")
    try:
        exec(device_notebooks.first_cell(dry=False, stand_ins={}), {})
    finally:
        colabkit.emulate_t4(False)
    said = capsys.readouterr().out
    assert said.startswith("device run: cpu, real sizes") and "None" not in said and "capped to" not in said


def test_notebook_records_from_an_executed_copy():
    """Fast twin of the notebook dry run: the record's parts read from outputs written as nbclient writes them."""
    nb = nbformat.v4.new_notebook()
    png = "iVBORw0KGgo="
    nb.cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output("display_data", data={"image/png": png})]),
                nbformat.v4.new_code_cell("y", outputs=[nbformat.v4.new_output("display_data", data={"image/png": png})]),
                nbformat.v4.new_code_cell("z", outputs=[nbformat.v4.new_output(
                    "display_data", data={"text/markdown": "- **When**: fine-tuning\n- more"})]),
                nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output(
                    "error", ename="AssertionError", evalue="the loss should fall", traceback=[])])]
    assert device_notebooks.takeaway(nb).startswith("- **When**: fine-tuning")
    assert device_notebooks.problems(nb) == ["cell 1 shows the same image as cell 0 (a chart drawn twice)"]
    assert device_notebooks._last_error(nb) == "cell 3 (0: the inserted one): AssertionError: the loss should fall"
    nb.cells = nb.cells[2:3]  # the negative control: one image, no error
    assert device_notebooks.problems(nb) == [] and device_notebooks._last_error(nb) is None
    # the runner's own first cell says "T4 emulation" (jargon in a notebook's output): not the notebook's finding
    said = [nbformat.v4.new_output("stream", name="stdout", text="device run: H200 with T4 emulation\n")]
    nb.cells = [nbformat.v4.new_code_cell("print()", outputs=said)]
    assert device_notebooks.problems(nb)  # untagged: flagged
    nb.cells[0].metadata["tags"] = [device_notebooks.INSERTED_TAG]
    assert device_notebooks.problems(nb) == []


@pytest.mark.slow  # fast twin: test_notebook_records_from_an_executed_copy
def test_device_notebooks_dry_run_executes_and_archives(tmp_path):
    import tarfile

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import colabkit\nassert colabkit.smoke_mode()"),
                nbformat.v4.new_code_cell("from IPython.display import Markdown, display\ndisplay(Markdown('- **When**: here'))")]
    bad = nbformat.v4.new_notebook(metadata=nb.metadata, cells=[nbformat.v4.new_code_cell("assert 1 == 2, 'planted'")])
    nbformat.write(nb, tmp_path / "98_ok.ipynb")
    nbformat.write(bad, tmp_path / "99_bad.ipynb")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLABKIT_SMOKE")}
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_notebooks.sh"), str(out), "--dry-run",
                        "--notebook", str(tmp_path / "98_ok.ipynb"), "--notebook", str(tmp_path / "99_bad.ipynb")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr  # the planted failure fails the command
    data = json.loads((out / "notebooks-only.json").read_text())
    ok, failed = data["results"]
    assert ok["status"] == "ok" and ok["takeaway"].startswith("- **When**: here")
    assert failed["status"] == "error" and "planted" in failed["error"]
    with tarfile.open(out / data["archive"]) as tar:
        assert sorted(tar.getnames()) == ["98_ok.ipynb", "99_bad.ipynb"]
        executed = nbformat.reads(tar.extractfile("98_ok.ipynb").read().decode(), as_version=4)
    assert "dry-run, cpu" in executed.cells[0].outputs[0]["text"]  # the inserted cell ran and said what it is


# ----- the wheels and the travelling size ------------------------------------------------------------------
def test_wheel_list_covers_what_colabkit_needs_and_each_wheels_requirements():
    """Every runtime requirement of colabkit (pyproject's dependencies and the hf extra) and each carried wheel's
    own requirements (their metadata, installed here) is carried or in the lent machine's image."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    carried = {wheels.norm(n) for n in wheels.WHEELS} | wheels.DEVICE_IMAGE
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    needs = wheels.requirements(project["dependencies"] + project["optional-dependencies"]["hf"]
                                + ["nbformat", "nbclient", "ipykernel", "nbval", "adam-mini", "galore-torch"])
    assert sorted(set(needs) - carried) == []
    meta = {n: wheels.installed_requirements(n) for n in wheels.WHEELS}
    meta = {n: r for n, r in meta.items() if r is not None}
    assert wheels.unmet(meta) == {}
    # the negative controls: a wheel left out shows up as an unmet requirement
    assert "comm" in wheels.unmet({n: r for n, r in meta.items() if n != "comm"}).get("ipywidgets", [])
    assert "ipywidgets" in set(needs) - (carried - {"ipywidgets"})
    assert not {wheels.norm(n) for n in wheels.WHEELS} & wheels.DEVICE_IMAGE  # two versions stop pip --no-index


def test_pins_and_the_download_command():
    from importlib.metadata import version

    pins = wheels.pins()
    assert "bitsandbytes==0.50.2" in pins and f"nbformat=={version('nbformat')}" in pins
    cmd = wheels.download_command(pins, "/tmp/w")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert "manylinux_2_24_x86_64" in cmd  # bitsandbytes 0.50.2's tag


def test_travelling_size_counts_tree_and_carried_paths_only(tmp_path):
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / ".gitignore").write_text("/.whl/\n/ignored/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    run("add", ".")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"z" * 5000)
    (tmp_path / ".whl").mkdir()
    with open(tmp_path / ".whl" / "a.whl", "wb") as f:
        f.truncate(65 * 2**20)  # sparse: 65 MiB by size, nothing on disk
    gi = len((tmp_path / ".gitignore").read_bytes())
    s = wheels.travelling_size(str(tmp_path), carry=[])
    assert s["bytes"] == 1000 + 300 + gi and s["carried_bytes"] == 0 and s["fits"]  # ignored files stay behind
    s = wheels.travelling_size(str(tmp_path), carry=[".whl"])
    assert s["carried_bytes"] == 65 * 2**20 and s["bytes"] == 1300 + gi + 65 * 2**20 and not s["fits"]


def test_this_checkout_and_the_measured_wheels_fit_one_run_call():
    s = wheels.travelling_size(ROOT, carry=[])
    assert s["tree_bytes"] + wheels.MEASURED_WHEEL_BYTES <= wheels.LIMIT_BYTES, s["largest"]


# ----- the offline stand-in for hub weights ----------------------------------------------------------------
def test_offline_stand_in_loads_through_from_pretrained(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import huggingface_hub.constants
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on the lent machine (read once, at import: set both)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from colabkit.hf_models import is_stand_in, offline_stand_in
    from colabkit.models import hub_config

    # notebook 14's model, shipped config narrowed to one small layer (its tokenizer class comes with the type)
    shipped = hub_config("Qwen/Qwen2.5-0.5B").to_dict()
    shipped.pop("layer_types", None)
    cfg = type(hub_config("Qwen/Qwen2.5-0.5B"))(**{**shipped, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
    folder = offline_stand_in("someorg/tiny", cache_dir=str(tmp_path), config=cfg, seed=1)
    kw = {"cache_dir": str(tmp_path), "local_files_only": True}  # what HF_HUB_OFFLINE=1 makes of every load
    m = transformers.AutoModelForCausalLM.from_pretrained("someorg/tiny", dtype=torch.float32, **kw)
    assert type(m).__name__ == "Qwen2ForCausalLM" and m.config.hidden_size == 64 and m.config.vocab_size == 300
    tok = transformers.AutoTokenizer.from_pretrained("someorg/tiny", **kw)
    text = "Q: héllo\nA:  日本 \x03"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text  # id b is byte b
    assert tok.eos_token_id == 256 < m.config.vocab_size
    assert "random weights" in open(os.path.join(folder, "COLABKIT_STAND_IN.txt")).read()
    assert is_stand_in("someorg/tiny", cache_dir=str(tmp_path)) and not is_stand_in("someorg/none", cache_dir=str(tmp_path))
    # negative controls: another seed gives other weights; an id with no stand-in is not found
    offline_stand_in("someorg/tiny2", cache_dir=str(tmp_path), config=cfg, seed=2)
    m2 = transformers.AutoModelForCausalLM.from_pretrained("someorg/tiny2", dtype=torch.float32, **kw)
    assert not torch.equal(m.model.embed_tokens.weight, m2.model.embed_tokens.weight)
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained("someorg/none", **kw)

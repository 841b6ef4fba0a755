"""The GPU column the technique notebooks' tables show: rendered from the committed results file (through the
packaged summary), never typed in."""
from __future__ import annotations

import importlib.util
import json
import os

from colabkit.gpu_results import gpu_peak, gpu_results
from colabkit.memory import CATEGORIES, fmt_bytes
from colabkit.plots import results_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("device_results", os.path.join(ROOT, "benchmarks", "device_results.py"))
device_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_results)


def test_packaged_summary_is_what_the_committed_results_give(tmp_path):
    assert device_results.main(["--check"]) == 0
    src = device_results.newest()
    assert gpu_results() == device_results.summarize(src)
    with open(src) as f:  # negative control: another figure in the results would not match the packaged file
        d = json.load(f)
    d["bench"]["results"][0]["peak_bytes"] += 1
    (tmp_path / "r.json").write_text(json.dumps(d))
    assert device_results.summarize(str(tmp_path / "r.json")) != gpu_results()


def _rec(plan, peak):
    return {"plan": plan, "ok": True, "peak_bytes": peak, "peak_phase": "backward", "loss": 2.5,
            "breakdown": {c: peak // 5 for c in CATEGORIES}}


def test_results_table_shows_the_gpu_runs_peak_and_ratio_beside_the_notebooks_own():
    with open(os.path.join(ROOT, device_results.newest())) as f:
        runs = {r["plan"]: r for r in json.load(f)["bench"]["results"] if r.get("ok")}
    table = results_table([_rec("baseline", 4096), _rec("fp16", 2048), _rec("fp16+sgd", 1024)]).splitlines()
    d = gpu_results()
    assert table[0].endswith(f"measured on an {d['gpu']} capped to a T4's memory, {d['date']} ({d['model']}, "
                             f"{d['batch']} × {d['seq']}): peak (÷ its baseline) |")
    ratio = runs["fp16"]["peak_bytes"] / runs["baseline"]["peak_bytes"]
    assert table[3].endswith(f"| {fmt_bytes(runs['fp16']['peak_bytes'])} ({ratio:.2f}) |")
    assert table[4].endswith("| - |") and gpu_peak("fp16+sgd") is None  # a plan the GPU run did not measure
    plain = results_table([_rec("baseline", 4096), _rec("fp16", 2048)], gpu=False).splitlines()
    assert "peak (÷ its baseline)" not in plain[0] and plain[3].count("|") == table[3].count("|") - 1

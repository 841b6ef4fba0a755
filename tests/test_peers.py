"""benchmarks/peers.py (issue 25) at tiny sizes: every row runs and lands in the JSON and the table; the
state bytes it reports agree with the peers' own (bitsandbytes' AdamW8bit layout) and with theory."""
import json
import math
import os
import subprocess
import sys

from colabkit.models import build_model
from colabkit.techniques.optimizers import optimizer_state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peers_quick_runs_every_row(tmp_path):
    out = tmp_path / "peers"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["quick"] and "torch" in data["versions"] and data["device"].startswith("CPU")
    rows = {r["what"]: r for r in data["rows"]}
    assert {r["kind"] for r in data["rows"]} == {"cli", "estimate", "optimizer", "disk", "tracker"}
    assert all(r["exit_code"] == 0 for r in data["rows"] if r["kind"] == "cli")
    for r in data["rows"]:  # every timing positive, every ratio a finite positive number
        assert all(t["median_s"] > 0 and t["low_s"] <= t["median_s"] <= t["high_s"] for t in r["timings"].values())
        assert all(math.isfinite(x) and x > 0 for x in r["ratios"].values()), r["what"]
    a8 = rows["adamw8bit"]
    # colabkit's AdamW8bit keeps bitsandbytes' state bytes (bnb adds two 256-entry quantization maps: 2 KiB)
    assert abs(a8["state_bytes"]["adamw8bit"] - a8["state_bytes"]["bitsandbytes AdamW8bit"]) <= 2048 + 8
    fused = rows["adamw"]["state_bytes"]["torch fused AdamW"]
    assert rows["adamw"]["state_bytes"]["adamw"] == fused  # the token is torch's AdamW: the same state
    assert 8 * rows["adamw"]["params"] <= fused <= 8 * rows["adamw"]["params"] + 4 * 200  # + a 4-byte step per tensor
    model = build_model(data["sizes"]["opt_model"], seq=data["sizes"]["opt_seq"])
    theory, n_tensors = optimizer_state_bytes(model, "adamw8bit"), len(list(model.parameters()))
    # + per tensor: a 4-byte step, and each absmax count rounded up to whole blocks (2 moments x 4 bytes)
    assert theory <= a8["state_bytes"]["adamw8bit"] <= theory + 12 * n_tensors, (theory, a8["state_bytes"])
    md = (tmp_path / "peers.md").read_text()
    assert "| what | colabkit | peer |" in md and "quick mode" in md
    for name in ("adamw4bit", "adamw8bit", "adam-mini", "galore:32", "offload:disk", "MemoryTracker"):
        assert name in md, name

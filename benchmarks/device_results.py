"""The GPU figures the notebooks show beside their own: ``colabkit/gpu_results.json`` (package data, so a
pip-installed colabkit in Colab has it), made from the committed ``benchmarks/results/cuda-<gpu>-t4emu-<date>.json``.

    python benchmarks/device_results.py            # rewrite colabkit/gpu_results.json from the newest results file
    python benchmarks/device_results.py --check    # exit 1 if the packaged file is not what the results give

Per plan measured there: peak allocated, the estimate beside it, the untracked step time. Nothing is typed in:
``tests/test_gpu_results.py`` holds the packaged file equal to what this script makes.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGED = os.path.join(ROOT, "colabkit", "gpu_results.json")


def newest(results_dir: str = os.path.join(ROOT, "benchmarks", "results")) -> str:
    """The newest device run's results file (by date in its name; a ``-first`` run yields to its rerun)."""
    files = [f for f in glob.glob(os.path.join(results_dir, "cuda-*-t4emu-*.json")) if not f.endswith("-first.json")]
    if not files:
        raise FileNotFoundError(f"no cuda-<gpu>-t4emu-<date>.json in {results_dir}")
    return max(files, key=lambda f: (re.search(r"(\d{4}-\d\d-\d\d)", f)[1], f))


def summarize(path: str) -> dict:
    """The packaged summary of one results file."""
    with open(path) as f:
        d = json.load(f)
    b, env = d["bench"], d["env"]
    plans = {r["plan"]: {"peak_bytes": int(r["peak_bytes"]), "estimate_peak_bytes": int(r["estimate_peak_bytes"]),
                         "step_time_s": round(float(r["step_time_s"]), 6)}
             for r in b["results"] if r.get("ok") and r.get("estimate_peak_bytes")}
    return {"gpu": env["gpu"], "label": env["label"], "date": env["date"][:10], "model": b["model"], "batch": b["batch"],
            "seq": b["seq"], "source": os.path.relpath(path, ROOT), "plans": plans}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    text = json.dumps(summarize(newest()), indent=1, sort_keys=True) + "\n"
    if args.check:
        with open(PACKAGED) as f:
            same = f.read() == text
        print("colabkit/gpu_results.json " + ("matches" if same else "differs from") + " the newest results file")
        return 0 if same else 1
    with open(PACKAGED, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PACKAGED, ROOT)} from {newest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

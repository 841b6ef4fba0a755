"""The second command on a lent GPU (issue 35): execute the notebooks at real size (``COLABKIT_SMOKE=0``) under
T4 emulation and bring them back executed, in one archive, so their figures can be looked at.

Run through ``benchmarks/device_notebooks.sh OUT --part 1`` (then ``--part 2`` ... ``5``: the 16 notebooks do not fit one
4-minute command); ``--dry-run`` runs the same code in smoke mode on the CPU. The notebooks are not edited: each
is executed from an in-memory copy whose first cell, inserted here and visible in the executed copy, switches
T4 emulation on (memory capped to a T4's usable bytes, bf16 and flash attention refused; the times are this
GPU's) and says so. With no network, the notebooks that load hub weights at real size (10, 14) get a stand-in
in a private Hugging Face cache: the hub model's shipped config with random weights and a byte-level tokenizer
(:func:`colabkit.hf_models.offline_stand_in`), said so in that first cell's output; their learning claims
(a pretrained model's answers) cannot come true on it.

Writes into OUT: ``notebooks-<part>.tar.gz`` (the executed notebooks, at most 16 MiB) and ``notebooks-<part>.json``
and ``.md`` (per notebook: status, wall time, the error, what the nbval output rules find, the takeaway it
printed); the progress goes to stderr.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
WALL_S = 220  # this script; the wheels' install (~15 s) before it: within 4 minutes a part
MAX_ARCHIVE = 16 * 2**20  # a file that comes back from a run call
# parts of at most ~200 s each on an H200 (times of the 2026-11-27 runs: 00 52 s, 01 19, 02 27, 03 55, 04 35, 05 61,
# 06 16, 07 > 100, 08 > 50, 10 > 57; the rest never ran there), the never-run notebooks first; --part all runs them all
PARTS = {"1": ["09", "11", "12", "15"], "2": ["13", "14"], "3": ["07", "10"],
         "4": ["00", "01", "02", "04", "06"], "5": ["03", "05", "08"]}
# the hub models a notebook loads at real size: offline, a stand-in (config + random weights) takes their place
HUB_MODELS = {"10": ["Qwen/Qwen2.5-0.5B-Instruct"], "14": ["Qwen/Qwen2.5-0.5B"]}
INSERTED_TAG = "device-run"


def notebooks(part: str | None = None, only: list[str] | None = None) -> list[str]:
    """The notebook paths of a part (``"1"``, ``"2"``, ``"all"``) or of the numbers in ``only``.

    >>> [os.path.basename(p)[:2] for p in notebooks(only=["10", "03"])]
    ['03', '10']
    """
    paths = sorted(glob.glob(os.path.join(NB_DIR, "[0-9][0-9]_*.ipynb")))
    keep = set(only) if only else set(sum(PARTS.values(), [])) if part in (None, "all") else set(PARTS[part])
    return [p for p in paths if os.path.basename(p)[:2] in keep]


def first_cell(dry: bool, stand_ins: dict[str, str]) -> str:
    """The code of the inserted first cell: T4 emulation on a GPU (not on the dry run's CPU), and what it does."""
    lines = ["# inserted by benchmarks/device_notebooks.py for this run (not part of the notebook)", "import colabkit"]
    if dry:
        lines.append('print("device run: dry-run, cpu, smoke sizes (no T4 emulation on a CPU)")')
    else:
        lines += ["colabkit.emulate_t4()",
                  "if colabkit.env()['gpu']:",
                  '    print(f"device run: {colabkit.env()[\'gpu\']} with T4 emulation (memory capped to a T4\'s usable '
                  'bytes, bf16 and flash attention refused; times are this GPU\'s, not a T4\'s), real sizes")',
                  "else:  # a rehearsal at real size on a CPU: T4 rules answer capability questions, nothing is capped",
                  '    print("device run: cpu, real sizes (no GPU: T4 rules on, no memory to cap; times are this CPU\'s)")']
    for hub_id, folder in stand_ins.items():
        lines.append(f"print({f'offline: {hub_id} is a stand-in: its shipped config with random weights and a byte-level tokenizer ({folder}); a pretrained model is not available here'!r})")
    return "\n".join(lines)


def prepared(path: str, dry: bool, stand_ins: dict[str, str]):
    """The notebook read from ``path`` with the first cell inserted (the file itself is not changed)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cell = nbformat.v4.new_code_cell(first_cell(dry, stand_ins))
    cell.metadata["tags"] = [INSERTED_TAG]
    nb.cells.insert(0, cell)
    return nb


def takeaway(nb) -> str | None:
    """The last Markdown a cell displayed (the notebook's takeaways, rendered from its results), else None."""
    for cell in reversed(nb.cells):
        for out in reversed(cell.get("outputs", []) if cell.cell_type == "code" else []):
            md = (out.get("data") or {}).get("text/markdown")
            if md:
                return md if isinstance(md, str) else "".join(md)
    return None


def _output_rules():
    """``output_problems`` of notebooks/conftest.py: the nbval hook's rules (an image shown twice, library noise)."""
    spec = importlib.util.spec_from_file_location("notebooks_conftest", os.path.join(NB_DIR, "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.output_problems


def problems(nb) -> list[str]:
    """What the nbval output rules find in the executed notebook."""
    check, seen, out = _output_rules(), {}, []
    for i, cell in enumerate(nb.cells):  # the inserted first cell is this runner's, not the notebook's
        if cell.cell_type == "code" and INSERTED_TAG not in cell.get("metadata", {}).get("tags", []):
            out += check(cell.get("outputs", []), seen, i)
    return out


def execute(path: str, nb, timeout: float, workdir: str) -> dict:
    """Execute ``nb`` in a fresh kernel (cwd ``workdir``) within ``timeout`` seconds in all (each cell gets what
    is left); returns status, wall time, the error and the takeaway."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    client = NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": workdir}},
                            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())))
    rec = {"notebook": os.path.basename(path), "status": "ok", "error": None}
    try:
        client.execute()
    except CellTimeoutError as e:
        rec.update(status="timeout", error=str(e).splitlines()[0][:300])
    except (CellExecutionError, DeadKernelError) as e:
        rec.update(status="error", error=f"{type(e).__name__}: {_last_error(nb) or str(e)[-600:]}")
    except Exception as e:  # noqa: BLE001  (a kernel that does not start: recorded, the next notebook runs)
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:600])
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    rec["takeaway"] = takeaway(nb)
    rec["problems"] = problems(nb)
    return rec


def _last_error(nb) -> str | None:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return f"cell {i} (0: the inserted one): {out.get('ename')}: {out.get('evalue')}"[:600]
    return None


def make_stand_ins(numbers: list[str], cache: str) -> dict[str, str]:
    """For the hub models of ``numbers`` not in the Hugging Face cache: a stand-in in ``cache`` (offline only)."""
    from colabkit.models import _cached_snapshot

    need = sorted({m for n in numbers for m in HUB_MODELS.get(n, [])})
    made = {}
    if need:
        from colabkit.hf_models import offline_stand_in

    for hub_id in need:
        if _cached_snapshot(hub_id) is None:
            made[hub_id] = offline_stand_in(hub_id, cache_dir=cache)
    return made


def markdown(data: dict) -> str:
    lines = [f"# Notebooks at {'smoke' if data['dry_run'] else 'real'} size on {data['device']}, {data['date'][:10]} "
             f"(part {data['part']})", "",
             f"- {sum(r['status'] == 'ok' for r in data['results'])} of {len(data['results'])} ran clean in "
             f"{data['wall_s']} s (limit {data['limit_s']} s); archive {data['archive']} ({data['archive_bytes'] / 2**20:.1f} MiB)"]
    for hub_id, folder in data["stand_ins"].items():
        lines.append(f"- offline stand-in for {hub_id}: shipped config, random weights, byte-level tokenizer")
    lines += ["", "| notebook | status | wall | error / output-rule findings | takeaway (first line) |", "|---|---|---|---|---|"]
    for r in data["results"]:
        first = next((ln.strip().removeprefix("- ") for ln in (r.get("takeaway") or "").splitlines() if ln.strip()), "")
        what = "; ".join(filter(None, [r.get("error"), *r.get("problems", [])])).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['notebook']} | {r['status']} | {r.get('wall_s', '-')} s | {what[:300]} | "
                     f"{first.replace('|', chr(92) + '|')[:200]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--part", default="1", choices=[*PARTS, "all"])
    p.add_argument("--only", action="append", default=None, metavar="NN", help="these notebook numbers instead")
    p.add_argument("--notebook", action="append", default=None, metavar="PATH", help="these notebook files instead")
    p.add_argument("--dry-run", action="store_true", help="smoke sizes on the CPU (what CI runs)")
    p.add_argument("--wall-s", type=float, default=WALL_S)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    paths = args.notebook or notebooks(args.part, args.only)
    label = "only" if (args.only or args.notebook) else args.part
    if not paths:
        p.error(f"no notebook matches --only {' '.join(args.only or [])}: use two-digit numbers of notebooks/NN_*.ipynb")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="colabkit-notebooks-")
    stand_ins = {}
    if not args.dry_run:  # a private cache: the stand-ins never mix with real weights elsewhere
        cache = os.path.join(work, "hf-cache")
        os.environ["HF_HUB_CACHE"] = cache
        stand_ins = make_stand_ins([os.path.basename(p)[:2] for p in paths], cache)
    import nbformat
    import torch

    device = "cpu (dry run)" if args.dry_run else (torch.cuda.get_device_name(0) + " with T4 emulation"
                                                   if torch.cuda.is_available() else "cpu")
    results, executed = [], os.path.join(work, "executed")
    os.makedirs(executed)

    def finish() -> dict:  # after each notebook: a kill later still leaves the ones done
        archive = os.path.join(args.out, f"notebooks-{label}.tar.gz")
        with tarfile.open(archive, "w:gz") as tar:
            for name in sorted(os.listdir(executed)):
                tar.add(os.path.join(executed, name), arcname=name)
        data = {"device": device, "dry_run": args.dry_run, "part": label,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "smoke": os.environ.get("COLABKIT_SMOKE"), "stand_ins": stand_ins, "results": results,
                "archive": os.path.basename(archive), "archive_bytes": os.path.getsize(archive),
                "archive_fits": os.path.getsize(archive) <= MAX_ARCHIVE, "limit_s": args.wall_s,
                "wall_s": round(time.perf_counter() - t0, 1)}
        stem = os.path.join(args.out, f"notebooks-{label}")
        with open(stem + ".json", "w") as f:
            json.dump(data, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(data))
        return data

    for path in paths:
        left = args.wall_s - 20 - (time.perf_counter() - t0)  # 20 s kept for the archive and the reports
        name = os.path.basename(path)
        if left < 15:
            results.append({"notebook": name, "status": "not run", "error": "the time budget was spent"})
            continue
        mine = {k: v for k, v in stand_ins.items() if k in HUB_MODELS.get(name[:2], [])}
        nb = prepared(path, args.dry_run, mine)
        rec = execute(path, nb, left, os.path.dirname(os.path.abspath(path)))
        rec["stand_in"] = sorted(mine)
        nbformat.write(nb, os.path.join(executed, name))
        results.append(rec)
        print(f"{name}: {rec['status']} in {rec['wall_s']} s {rec['error'] or ''}", file=sys.stderr, flush=True)
        finish()
    data = finish()
    shutil.rmtree(work, ignore_errors=True)  # the executed copies are in the archive; the stand-ins go
    print(f"device_notebooks: wrote {data['archive']} ({data['archive_bytes'] / 2**20:.1f} MiB) and its report in "
          f"{args.out} in {data['wall_s']} s", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in results) and data["archive_fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

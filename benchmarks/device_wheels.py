"""The wheels a lent GPU machine needs to run colabkit, and what travels to it.

The lent machine (see CONTRIBUTING, "Running on a lent GPU") has Python 3.12, torch, transformers, peft and
accelerate but no network: bitsandbytes, the notebook stack (nbformat, nbclient, ipykernel, ipywidgets, nbval)
and the optimizer packages travel as wheels in ``.whl/`` (ignored by git, carried by the ``run`` call), and
together with the working tree must stay within 64 MiB.

    python benchmarks/device_wheels.py fetch       # pip download into .whl/ (needs PyPI), then the size check
    python benchmarks/device_wheels.py check       # the travelling size and unmet requirements, no download

Each wheel is pinned to the version this checkout's tests run with here (``importlib.metadata``), bitsandbytes
to ``BITSANDBYTES``; every requirement of a carried wheel is either carried too or in the machine's image
(``DEVICE_IMAGE``, from the workplace's list of what that image holds).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = ".whl"          # in the repository root; /.whl/ is in .gitignore
LIMIT_BYTES = 64 * 2**20    # what a run call sends: the working tree and its carried paths
BITSANDBYTES = "0.50.2"     # built for CUDA 13 (the lent machine's torch is 2.11+cu130)
DEVICE_PYTHON = "3.12"
# what `fetch` downloaded on 2026-11-27 (39 wheels; bitsandbytes 41.1 MiB of it): the size check's figure for the
# wheels when they are not here
MEASURED_WHEEL_BYTES = 58_778_826
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]

# what the machine lacks: bitsandbytes (qlora, 8-bit and paged optimizers), the optimizer packages of adam-mini
# and galore, and what executes notebooks (nbclient + ipykernel), shows widgets (ipywidgets) and checks them (nbval)
WHEELS = [
    "bitsandbytes", "adam-mini", "galore-torch",
    "nbformat", "fastjsonschema", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "jupyter-core", "platformdirs", "traitlets", "nbclient", "jupyter-client", "pyzmq", "tornado",
    "ipykernel", "comm", "debugpy", "matplotlib-inline", "nest-asyncio2", "nest-asyncio",
    "ipython", "ipython-pygments-lexers", "decorator", "jedi", "parso", "prompt-toolkit", "wcwidth", "pexpect",
    "ptyprocess", "stack-data", "asttokens", "executing", "pure-eval", "backcall", "pickleshare",
    "ipywidgets", "widgetsnbextension", "jupyterlab-widgets", "nbval",
]

# The lent machine's image ('cuda'), as the workplace lists it (2026-11-17): never carried again (two versions
# of one package stop pip --no-index). Names normalised (PEP 503).
DEVICE_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio interface-meta iniconfig jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())


def norm(name: str) -> str:
    """PEP 503 name: ``Jupyter_Core`` -> ``jupyter-core``. >>> norm("Jupyter_Core")
    'jupyter-core'"""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(lines: list[str] | None, python: str = DEVICE_PYTHON) -> list[str]:
    """The names a distribution needs on Linux x86-64 under ``python`` (no extras), from Requires-Dist lines.

    >>> requirements(["comm>=0.1.3", "pytest; extra == 'test'", "backcall; python_version < '3.8'"])
    ['comm']
    """
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    out = []
    for line in lines or []:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(env):
            out.append(norm(r.name))
    return out


def installed_requirements(name: str) -> list[str] | None:
    """Requires-Dist of the distribution installed here, None when it is not installed."""
    try:
        return requirements(md.requires(name))
    except md.PackageNotFoundError:
        return None


def wheel_requirements(path: str) -> tuple[str, list[str]]:
    """(name, requirements) read from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M)[1].strip()
    return norm(name), requirements(re.findall(r"^Requires-Dist: (.+)$", text, re.M))


def unmet(carried: dict[str, list[str] | None], image: set[str] = DEVICE_IMAGE) -> dict[str, list[str]]:
    """For each carried distribution, the requirements neither carried nor in the image.
    ``carried`` maps a name to its requirements (None: not known here -- reported as unknown).

    >>> unmet({"ipywidgets": ["comm", "traitlets"], "traitlets": []}, image=set())
    {'ipywidgets': ['comm']}
    """
    names = {norm(n) for n in carried} | {norm(n) for n in image}
    out = {}
    for n, reqs in carried.items():
        missing = ["(not installed here: requirements unknown)"] if reqs is None else sorted(set(reqs) - names)
        if missing:
            out[norm(n)] = missing
    return out


def pins(names: list[str] = WHEELS) -> list[str]:
    """``name==version`` for each wheel: the version installed here (bitsandbytes: ``BITSANDBYTES``); names not
    installed here (a requirement of another Python) are left out, since the image or another wheel covers them."""
    out = []
    for n in names:
        if norm(n) == "bitsandbytes":
            out.append(f"bitsandbytes=={BITSANDBYTES}")
            continue
        try:
            out.append(f"{n}=={md.version(n)}")
        except md.PackageNotFoundError:
            pass
    return out


def download_command(specs: list[str], dest: str) -> list[str]:
    """The pip command that fetches ``specs`` as cp312 manylinux x86-64 wheels (no dependencies: each is named)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           DEVICE_PYTHON, "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + specs


def travelling_files(root: str = ROOT, carry: list[str] = (WHEEL_DIR,)) -> dict[str, int]:
    """Path -> bytes of what a ``run`` call sends from ``root``: tracked and untracked-not-ignored files (git),
    ``shared/`` if the checkout has one, and every file under the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    files = {p: 0 for p in listed if p}
    for extra in [*carry, "shared"]:
        top = os.path.join(root, extra)
        if os.path.isfile(top):
            files[extra] = 0
        for d, _, names in os.walk(top):
            for n in names:
                files[os.path.relpath(os.path.join(d, n), root)] = 0
    for p in list(files):
        full = os.path.join(root, p)
        if os.path.islink(full) or not os.path.isfile(full):  # a deleted tracked file, a link (travels as a link)
            files[p] = len(os.readlink(full)) if os.path.islink(full) else 0
        else:
            files[p] = os.path.getsize(full)
    return files


def travelling_size(root: str = ROOT, carry: list[str] = (WHEEL_DIR,)) -> dict:
    """``{"bytes", "tree_bytes", "carried_bytes", "limit_bytes", "fits", "largest"}`` for a run from ``root``."""
    files = travelling_files(root, carry)
    carried = sum(b for p, b in files.items() if any(p == c or p.startswith(c.rstrip("/") + "/") for c in carry))
    total = sum(files.values())
    largest = sorted(files.items(), key=lambda kv: -kv[1])[:5]
    return {"bytes": total, "tree_bytes": total - carried, "carried_bytes": carried, "limit_bytes": LIMIT_BYTES,
            "fits": total <= LIMIT_BYTES, "largest": largest}


def check(root: str = ROOT) -> dict:
    """The size check and the requirement check of the wheels in ``root/.whl`` (or, with none there yet, of the
    versions installed here)."""
    wdir = os.path.join(root, WHEEL_DIR)
    wheels = sorted(f for f in os.listdir(wdir) if f.endswith(".whl")) if os.path.isdir(wdir) else []
    if wheels:
        carried = dict(wheel_requirements(os.path.join(wdir, f)) for f in wheels)
        names = [n for n in carried]
        dupes = sorted({n for n in names if names.count(n) > 1})
    else:
        carried = {norm(n): installed_requirements(n) for n in WHEELS if installed_requirements(n) is not None}
        dupes = []
    missing_wheels = sorted({norm(n) for n in WHEELS if installed_requirements(n) is not None} - set(carried))
    return {"size": travelling_size(root), "wheels": len(wheels), "from": "wheels" if wheels else "installed here",
            "unmet": unmet(carried), "missing_wheels": missing_wheels if wheels else [], "duplicates": dupes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["fetch", "check", "pins"])
    args = p.parse_args(argv)
    if args.what == "pins":
        print("\n".join(pins()))
        return 0
    if args.what == "fetch":
        os.makedirs(os.path.join(ROOT, WHEEL_DIR), exist_ok=True)
        subprocess.run(download_command(pins(), os.path.join(ROOT, WHEEL_DIR)), check=True)
    r = check()
    s = r["size"]
    print(f"travels: {s['bytes'] / 2**20:.1f} MiB of {s['limit_bytes'] / 2**20:.0f} (tree {s['tree_bytes'] / 2**20:.1f}, "
          f"{WHEEL_DIR} {s['carried_bytes'] / 2**20:.1f}; {r['wheels']} wheels) -> {'fits' if s['fits'] else 'TOO BIG'}")
    print("largest:", ", ".join(f"{p} {b / 2**20:.1f} MiB" for p, b in s["largest"]))
    for what in ("unmet", "missing_wheels", "duplicates"):
        if r[what]:
            print(f"{what}: {r[what]}")
    return 0 if s["fits"] and not (r["unmet"] or r["missing_wheels"] or r["duplicates"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

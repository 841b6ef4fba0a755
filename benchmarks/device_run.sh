#!/usr/bin/env bash
# The first command on a lent GPU (issue 35; CONTRIBUTING, "Running on a lent GPU"): selftest, every plan
# token on gpt2-124m under T4 emulation, estimates beside each; <= 4 minutes on one H100/H200.
#   benchmarks/device_run.sh OUT              on the GPU machine (carry .whl); writes OUT/cuda-<gpu>-t4emu-<date>.*
#   benchmarks/device_run.sh OUT --dry-run    the same phases in smoke mode on a CPU (what CI runs)
# Further options go to benchmarks/device_run.py (--wall-s, --plan, --steps).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/device_run.sh OUT [--dry-run] [device_run.py options]}
shift
. benchmarks/device_env.sh "$@" || exit 1
exec "$PYTHON" benchmarks/device_run.py --out "$out" "$@"

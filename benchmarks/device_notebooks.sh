#!/usr/bin/env bash
# The second command on a lent GPU (issue 35; CONTRIBUTING, "Running on a lent GPU"): the notebooks at real
# size under T4 emulation, returned executed in OUT/notebooks-<part>.tar.gz; <= 4 minutes per part.
#   benchmarks/device_notebooks.sh OUT --part 1       on the GPU machine (carry .whl); then --part 2
#   benchmarks/device_notebooks.sh OUT --dry-run --only 00    smoke mode on a CPU
# Further options go to benchmarks/device_notebooks.py (--only NN, --notebook PATH, --wall-s).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/device_notebooks.sh OUT [--part 1|2|all] [--dry-run] [device_notebooks.py options]}
shift
. benchmarks/device_env.sh "$@" || exit 1
exec "$PYTHON" benchmarks/device_notebooks.py --out "$out" "$@"

# Sourced by benchmarks/device_run.sh and device_notebooks.sh: the environment of a run on a lent GPU.
# With --dry-run among the arguments (CI, a CPU): this checkout on the path, smoke mode, nothing installed.
# Otherwise (the lent machine: Python 3.12 with torch, no network): the wheels carried in .whl/ installed into
# a local target once per machine (pip --no-index, nothing fetched), then this checkout first on the path.
PYTHON=${PYTHON:-python3}
SITE=${COLABKIT_SITE:-/tmp/colabkit-site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case " $* " in
*" --dry-run "*)
    export COLABKIT_SMOKE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD"
    ;;
*)
    if [ ! -f "$SITE/.installed" ]; then
        ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run 'python benchmarks/device_wheels.py fetch' here and carry .whl" >&2; return 1; }
        t0=$(date +%s)
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            || { echo "installing the carried wheels failed" >&2; return 1; }
        touch "$SITE/.installed"
        echo "device_env: installed $(ls .whl/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s" >&2
    fi
    export COLABKIT_SMOKE=0 PYTHONPATH="$PWD:$SITE"
    ;;
esac

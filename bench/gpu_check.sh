#!/usr/bin/env bash
# The staged GPU check (issue 33), for the device image as it is: python3 with its own torch and
# triton, no registry. Wheels from bench/fetch_wheels.sh (bench/wheels/, carried along) go into
# /tmp/ninfer-site with --no-index --no-deps --target and come first on PYTHONPATH after this
# checkout; nothing is pip-installed into the image. Then one process per stage, each with its
# own cap, inside a 540 s budget; a JSON line per stage appended to $OUT/gpu_check.jsonl as it
# ends, every stage's output in $OUT/gpu_check.log (ninfer/benchmarks/gpu_runner.py).
# Usage: bench/gpu_check.sh [--stages a,b] [--budget S]      ($OUT defaults to bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
py=${PYTHON:-python3}
if ls bench/wheels/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ninfer-site bench/wheels/*.whl || echo "[gpu-check] wheel install failed" >&2
    export PYTHONPATH="$PWD:/tmp/ninfer-site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "[gpu-check] no bench/wheels (bench/fetch_wheels.sh): using what the image has" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
# a carried tiny model (models/tiny, `ninfer make-tiny-model models/tiny`) saves building it there
model=()
[ -f models/tiny/config.json ] && model=(--model models/tiny)
# the runner enforces the budget; the outer timeout only guards the runner itself
exec timeout 570 $py ninfer/benchmarks/gpu_runner.py --out "$out/gpu_check.jsonl" "${model[@]}" "$@"

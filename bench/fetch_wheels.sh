#!/usr/bin/env bash
# The wheels the staged GPU check carries to the device image (issue 33): python3.12 with its own
# torch 2.11 / triton 3.6 and no registry; it lacks msgspec and fla-core (einops, fla's only
# requirement, is there). Downloaded here, once, into bench/wheels/ (ignored by git; a device
# run names it in `carry`); bench/gpu_check.sh installs them with --no-index --no-deps --target,
# so the image's torch and triton are never replaced. Pinned to what the tests run against.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=bench/wheels
mkdir -p "$dest"
pip=${PIP:-python3 -m pip}
$pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" msgspec==0.23.0 fla-core==0.6.0
ls -l "$dest"
# never carry a torch or triton: the image's own are the ones to check
if ls "$dest" | grep -Eiq '^(torch|triton)-'; then echo "refusing: a torch/triton wheel is in $dest" >&2; exit 1; fi

#!/usr/bin/env bash
# Wheels of kvlab's small runtime packages (tokenizers, safetensors, tqdm), for a GPU machine without
# network that lacks them. The lent H200's image has all three: it needs none of this.
# Run this on a machine WITH network; it writes .whl/ (ignored by git, ~4 MB), which travels with the
# working tree to the GPU machine. There: python scripts/gpu_tour.py --wheels .whl
# Usage: bash scripts/gpu_tour_wheels.sh [PYTHON_VERSION (3.12)] [PLATFORM (manylinux2014_x86_64)]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --only-binary=:all: --no-deps --implementation cp \
    --python-version "${1:-3.12}" --platform "${2:-manylinux2014_x86_64}" --dest .whl \
    tokenizers safetensors tqdm
ls -l .whl

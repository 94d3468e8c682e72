#!/usr/bin/env bash
# Run HERE (not on the device), from the repo root, before a device session: the wheels of what
# servelm's engine imports and the device image lacks (its python3 is 3.12 with torch, triton,
# transformers, tokenizers, safetensors, numpy, pyyaml, tqdm, requests), into .whl/ (git-ignored).
# Then on the device: `run` with carry [".whl"] and the command `bash benchmarks/gpu_run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    gguf==0.19.0 msgspec==0.22.0 pyzmq==27.3.0
ls -la .whl

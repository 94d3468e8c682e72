#!/usr/bin/env bash
# Run HERE (not on the device), from the repo root, before a device session. Makes (git-ignored):
#   .whl/         the wheels of what servelm's engine, API server and bench import and the device
#                 image lacks (its python3 is 3.12 with torch, triton, transformers, tokenizers,
#                 safetensors, numpy, pyyaml, tqdm, requests, jinja2); ~10 MB, no matplotlib
#                 (runs without plots need none)
#   .gpu_stage/1, .gpu_stage/2
#                 the default model's GGUF (98 MB) in two halves: one call's working tree may carry
#                 at most 64 MiB, so the model reaches the device in two calls (gpu_stage.sh).
# Then on the device:
#   issue 18's checks: `run` with carry [".whl"], command `bash benchmarks/gpu_run.sh`
#   with the default model (scenarios): two calls back to back (the machine stays warm ~30 s):
#     run(command="bash benchmarks/gpu_stage.sh", carry=[".gpu_stage/1"], timeout_s=120)
#     run(command="bash benchmarks/gpu_scenario.sh", carry=[".gpu_stage/2", ".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    gguf==0.19.0 msgspec==0.22.0 pyzmq==27.3.0 \
    fastapi==0.163.2 starlette==1.10.0 annotated-doc==0.0.7 pydantic==2.14.3 pydantic_core==2.50.4 \
    annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 \
    h11==0.16.0 click==8.5.1 prometheus_client==0.26.0 httpx==0.28.1 httpcore==1.0.9 anyio==4.16.0 \
    sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1 opentelemetry-api==1.45.2 typing_extensions==4.16.0
ls -la .whl
# The default model in two halves, .gpu_stage/1 and .gpu_stage/2 (gpu_stage.sh joins them there).
bash benchmarks/gpu_stage.sh split "$(.venv/bin/python -c 'from servelm.default_model import default_model_path; print(default_model_path())')"

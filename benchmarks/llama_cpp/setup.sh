#!/usr/bin/env bash
# Builds a separate virtual environment with llama-cpp-python (llama.cpp's Python bindings and
# its OpenAI-compatible server) for the side-by-side serving benchmark
# (benchmarks/serving_peers.py --systems llama.cpp). llama.cpp is never a servelm dependency:
# it lives only in benchmarks/llama_cpp/.venv (ignored by git), rebuilt from scratch each time.
#
# Compiled from the sdist for this machine, the way llama.cpp's README builds for a CPU:
# GGML_NATIVE (-march=native: AVX2/FMA/F16C, AVX-512 and VNNI where the CPU has them), no BLAS
# (llama.cpp's own quantised kernels decode a Q4_1 model), no multimodal library (LLAVA_BUILD).
# Without AMX: on the Xeons these machines have, -march=native turns on llama.cpp's AMX weight
# buffers, and the first decode of the Q4_1 model then dies with a segmentation fault (0.3.36;
# `use_extra_bufts=false` avoids it too, but its server has no flag for that); explicit -mno-amx-*
# flags win over -march=native in GCC whatever their order. Without OpenMP (ggml's own threads):
# the server decodes each request in whichever thread-pool worker its call lands on, and with the
# OpenMP build any thread but the first that computed decodes ~3x slower (measured on the default
# model, 2 threads: 8 ms/token from the first thread, 27 from any other; ~10 from every thread
# without OpenMP), so every request after the server's first would pay it. ~5-20 minutes on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
version="0.3.36"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$venv/bin/pip" install --no-binary llama-cpp-python --no-cache-dir "llama-cpp-python[server]==$version"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
"$venv/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"

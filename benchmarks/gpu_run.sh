#!/usr/bin/env bash
# ON the lent GPU machine, from the repo root, with .whl carried (benchmarks/gpu_wheels.sh makes it):
#   bash benchmarks/gpu_run.sh [gpu_checks.py flags]
# The default model (98 MB) cannot travel in one call (64 MiB): with only .whl carried its checks
# are skipped (--no-default-model); to include them, first `bash benchmarks/gpu_stage.sh` carrying
# .gpu_stage/1, then this at once carrying .gpu_stage/2 and .whl (see gpu_wheels.sh).
# Installs the carried wheels beside the image's packages, then runs every GPU check within the
# device tool's per-call limit (use timeout_s 600); the reports, the JSON and the logs land in $OUT.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/nvidia_smi.csv"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# Sampling and memory first (1-2 min: seeded CPU = CUDA, syncs inside the sampler, bf16 loading,
# utilization sizing, a forced OOM), then everything else; each within its own limit.
timeout 150 python3 benchmarks/gpu_devmem_checks.py 2>&1 | tee "$OUT/gpu_devmem_checks.log"
devmem=${PIPESTATUS[0]}
model_flags=()
bash benchmarks/gpu_stage.sh || model_flags=(--no-default-model)
timeout 420 python3 benchmarks/gpu_checks.py "${model_flags[@]}" "$@" 2>&1 | tee "$OUT/gpu_checks.log"
checks=${PIPESTATUS[0]}
echo "gpu_devmem_checks exit $devmem, gpu_checks exit $checks"
[ "$devmem" = 0 ] && [ "$checks" = 0 ]

# Sourced (not run) ON the device, from the repo root, by gpu_run.sh and gpu_scenario.sh: installs
# the carried wheels (.whl, gpu_wheels.sh) into $GPU_SITE beside the image's packages and puts
# src/ and $GPU_SITE on PYTHONPATH; $OUT is where the device tool collects files. gpu_stage.sh
# puts the default model into the same $GPU_SITE.
export GPU_SITE="${GPU_SITE:-/tmp/site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$GPU_SITE" .whl/*.whl || exit 1
export PYTHONPATH="$PWD/src:$GPU_SITE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"

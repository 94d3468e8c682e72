#!/usr/bin/env bash
# ON the device, from the repo root, in the call after `bash benchmarks/gpu_stage.sh` (see
# gpu_wheels.sh), carrying .gpu_stage/2 and .whl: the long-histories "TTFT tripled" scenario on the
# default model where the engine is fast (issue 11: on 2 CPU cores the default model's prefill
# saturates long before the API process, so the frontend cause cannot show there).
#   bash benchmarks/gpu_scenario.sh [SCENARIO] [RATES] [SECONDS] [SESSIONS]   # default: long-histories "32 96" 20 32
# Each rate: a fresh server (`servelm serve`, device auto = cuda), a baseline and a today window of
# SECONDS each, then `servelm diagnose`. SESSIONS conversations at once: with the profile's 4, each
# waiting for its previous turn, a fast server is offered only a few requests at a time; 32 at
# 96 req/s for 20 s still gives each conversation ~60 turns (histories reach the context).
# $OUT gets each rate's log and diagnosis and one tar.gz of every window (the device tool returns
# at most 8 files). Two rates fit the tool's 600 s call (each run is cut at 270 s).
set -uo pipefail
scenario="${1:-long-histories}"
rates="${2:-32 96}"
seconds="${3:-20}"
sessions="${4:-32}"
source benchmarks/gpu_env.sh
bash benchmarks/gpu_stage.sh || exit 1
mkdir -p /tmp/gpu_scen
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/nvidia_smi.csv"
nproc
status=0
for rate in $rates; do
    dir="/tmp/gpu_scen/$scenario-rate$rate"
    timeout 270 python3 -m servelm.cli bench scenario "$scenario" --out "$dir" --rate "$rate" --seconds "$seconds" \
        --sessions "$sessions" --no-progress 2>&1 | grep -v ' INFO ' | tee "$OUT/$scenario-rate$rate.log" || status=1
    cp "$dir/diagnosis.txt" "$OUT/$scenario-rate$rate-diagnosis.txt" 2>/dev/null
done
tar -czf "$OUT/gpu_scenario.tar.gz" -C /tmp gpu_scen
exit $status

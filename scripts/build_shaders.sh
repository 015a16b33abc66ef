#!/usr/bin/env bash
# Compile shaders/*.comp to the SPIR-V the crate embeds (shaders/spv/, committed): one variant
# per block format for the kernels that read weights, and per K/V codec for the ones that
# read or write the device's K/V. `--check` recompiles into a temporary
# folder, validates every module with spirv-val and fails if the committed files differ.
set -euo pipefail
cd "$(dirname "$0")/.."
out=shaders/spv
check=0
if [ "${1:-}" = "--check" ]; then
    check=1
    out=$(mktemp -d)
fi
mkdir -p "$out"
flags=(--target-env=vulkan1.2 -O -Ishaders)
formats="F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K"
for k in mul_mat mul_mat_rows get_rows; do
    for f in $formats; do
        glslc "${flags[@]}" -DFMT_$f "shaders/$k.comp" -o "$out/${k}_$(echo "$f" | tr 'A-Z' 'a-z').spv"
    done
done
for k in kv_store attention; do
    for c in F16 Q8_0 TQ4; do
        glslc "${flags[@]}" -DKV_$c "shaders/$k.comp" -o "$out/${k}_$(echo "$c" | tr 'A-Z' 'a-z').spv"
    done
done
for k in rms_norm rope eltwise gather_rows round_act; do
    glslc "${flags[@]}" "shaders/$k.comp" -o "$out/$k.spv"
done
if [ $check = 1 ]; then
    for f in "$out"/*.spv; do
        spirv-val --target-env vulkan1.2 "$f"
    done
    diff -r "$out" shaders/spv && echo "shaders: committed SPIR-V is up to date and valid"
    rm -rf "$out"
fi

#!/usr/bin/env bash
# Compile shaders/*.comp to the SPIR-V the crate embeds (shaders/spv/, committed): every module
# shaders/variants.txt lists (one per block format for the kernels that read weights, one per K/V
# codec for the ones that read or write the device's K/V), the list the crate's build.rs reads
# too. `--check` recompiles into a temporary folder, validates every module with spirv-val and
# fails if the committed files differ.
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
declare -A prefix values
while read -r kind a b c rest; do
    case "$kind" in
    set)
        # set NAME DEFINE_PREFIX RUST_TYPE [open] VALUE=RustVariant ...
        prefix[$a]=$b
        vals=""
        for v in $rest; do
            [ "$v" = open ] || vals="$vals ${v%%=*}"
        done
        values[$a]=$vals
        ;;
    kernel)
        # kernel Variant SOURCE [SET]
        src=$b
        set_name=$c
        if [ -z "$set_name" ]; then
            glslc "${flags[@]}" "shaders/$src.comp" -o "$out/$src.spv"
        else
            for v in ${values[$set_name]}; do
                glslc "${flags[@]}" "-D${prefix[$set_name]}$v" "shaders/$src.comp" -o "$out/${src}_$(echo "$v" | tr 'A-Z' 'a-z').spv"
            done
        fi
        ;;
    '' | '#'*) ;;
    *)
        echo "shaders/variants.txt: unknown line kind '$kind'" >&2
        exit 1
        ;;
    esac
done <shaders/variants.txt
if [ $check = 1 ]; then
    for f in "$out"/*.spv; do
        spirv-val --target-env vulkan1.2 "$f"
    done
    diff -r "$out" shaders/spv && echo "shaders: committed SPIR-V is up to date and valid"
    rm -rf "$out"
fi

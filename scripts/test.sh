#!/usr/bin/env bash
# The whole test suite: lints (rustfmt, clippy, ruff), Rust unit and kernel tests, the type stubs
# against the built module, then pytest against the real models (fetched through dasllama's own
# fetcher on first use; the scalar kernels' golden checks run there too, on a runtime of their
# own: tests/test_golden.py, tests/test_runtime_kernels.py). Works on a fresh
# machine with Rust and Python 3.11+; everything else it installs into .venv.
#
# With arguments it runs only pytest with them (`bash scripts/test.sh tests/test_sampling_chain.py`,
# `bash scripts/test.sh tests/test_server.py -k models -x`): no apt, no lints, no cargo;
# it builds the extension into .venv first only when .venv cannot import it yet.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -gt 0 ]; then
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    . .venv/bin/activate
    if ! python -c "import dasllama._native, pytest" >/dev/null 2>&1; then
        echo "building dasllama into .venv (a Rust build: about 6 minutes on 2 cores)"
        python -m pip install -q --upgrade pip
        MATURIN_PEP517_ARGS="--features fault-injection" python -m pip install -q -e '.[test]'
    fi
    # The Vulkan tests may use lavapipe, a CPU Vulkan device, which dasllama otherwise never picks.
    export DASLLAMA_VK_ALLOW_CPU=1
    exec python -m pytest -q "$@"
fi

# Installed once, quietly, when missing and we may install (Debian): Debian's chromium for the
# web pages' Playwright tests (Playwright's own browser download is not reachable from CI); Mesa's
# lavapipe (a CPU Vulkan device) and the Vulkan loader for the Vulkan driver's tests; glslc and
# spirv-tools to recompile and validate the committed shaders.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-liberation)
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || missing+=(mesa-vulkan-drivers)
ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1 ' || missing+=(libvulkan1)
command -v glslc >/dev/null 2>&1 || missing+=(glslc)
command -v spirv-val >/dev/null 2>&1 || missing+=(spirv-tools)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The test build carries the engine's fault hooks (the `fault-injection` feature, which the
# robustness tests drive); the release wheel (.ci/run) is built without them.
MATURIN_PEP517_ARGS="--features fault-injection" python -m pip install -q -e '.[test]'

cargo fmt --all --check
if command -v glslc >/dev/null 2>&1 && command -v spirv-val >/dev/null 2>&1; then
    bash scripts/build_shaders.sh --check
else
    echo "shader check skipped: glslc or spirv-val is missing (apt-get install glslc spirv-tools)"
fi
cargo clippy --release --all-targets -p dasllama -p dasllama-py -- -D warnings
cargo clippy --release --all-targets -p dasllama -p dasllama-py --features fault-injection -- -D warnings
ruff check python tests benches examples scripts
python -m mypy.stubtest dasllama._native --allowlist scripts/stubtest-allowlist.txt

# The Vulkan tests may use lavapipe, a CPU Vulkan device, which dasllama otherwise never picks.
export DASLLAMA_VK_ALLOW_CPU=1
cargo test --release -p dasllama --features fault-injection
DASLLAMA_NO_SIMD=1 cargo test --release -p dasllama --features fault-injection  # the scalar twins under the same tests
python -m pytest -q tests

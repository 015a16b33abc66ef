#!/usr/bin/env bash
# The whole test suite: lints (rustfmt, clippy, ruff), Rust unit and kernel tests, the type stubs
# against the built module, then pytest against the real models (fetched through dasllama's own
# fetcher on first use), and the golden subset once more on the scalar kernels. Works on a fresh
# machine with Rust and Python 3.9+; everything else it installs into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

# The web pages' tests drive Debian's chromium through Playwright (Playwright's own browser download
# is not reachable from CI); installed once, quietly, when it is missing and we may install it.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium for the browser tests (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'

cargo fmt --all --check
cargo clippy --release --all-targets -p dasllama -p dasllama-py -- -D warnings
ruff check python tests benches examples scripts
python -m mypy.stubtest dasllama._native --allowlist scripts/stubtest-allowlist.txt

cargo test --release -p dasllama
DASLLAMA_NO_SIMD=1 cargo test --release -p dasllama  # the scalar twins under the same tests
python -m pytest -q tests "$@"
# The scalar twins end to end: every SIMD kernel off (read once per process, hence a process of
# its own), the golden comparisons must still hold.
DASLLAMA_NO_SIMD=1 DASLLAMA_GOLDEN_STEPS=6 python -m pytest -q tests/test_golden.py -k "first_step_matches or all_steps_close"

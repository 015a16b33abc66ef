#!/usr/bin/env bash
# The whole test suite: Rust unit and kernel tests, then pytest against the real models
# (fetched through dasllama's own fetcher on first use). Works on a fresh machine with Rust and
# Python 3.9+; everything else it installs into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'

cargo test --release -p dasllama
python -m pytest -q tests "$@"

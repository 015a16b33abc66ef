"""llama.cpp's own tools, built natively from the sources llama-cpp-python's sdist vendors, for the
benches to run beside dasllama: `llama-server` (`bench_server.py`, `bench_long_prompt.py` use it
when it is on the PATH), `llama-batched-bench` (the figure `bench_batch.py --llama-python` is
checked against), `llama-bench` and `llama-quantize` (`make_bench_model.py`). The sdist comes from
PyPI (`pip download --no-deps`), the only network this needs; the binaries are linked statically,
so they run from wherever they are copied.

    python scripts/build_llama_cpp.py [--version 0.3.36] [--dest ~/.cache/dasllama/llama.cpp/bin]
    export PATH=~/.cache/dasllama/llama.cpp/bin:$PATH

Needs a C++ compiler and `cmake` (`pip install cmake ninja` provides both build tools). Takes
about five minutes on two cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger("build_llama_cpp")

TOOLS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-quantize")


def run(cmd: list[str], cwd: Path, log_file: Path) -> None:
    """Runs `cmd`, its output into `log_file`; on failure raises with the log's last lines."""
    with log_file.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, check=False, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log_file.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{cmd[0]} failed (exit {rc}); the end of {log_file}:\n{tail}")


def vendored_sources(version: str, work: Path, build_log: Path) -> tuple[Path, list[str]]:
    """The llama.cpp sources llama-cpp-python `version` vendors, unpacked into `work`, and the
    CMake generator to build them with (Ninja where it is installed)."""
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not found on the PATH: install a C++ compiler, and cmake with `pip install cmake ninja`")
    log.info("downloading the llama-cpp-python %s sdist", version)
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(work)], work, build_log)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        raise SystemExit(f"pip saved no llama_cpp_python sdist into {work}; is version {version} on PyPI?")
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"{sdist.name} vendors no llama.cpp at {src.relative_to(work)}")
    return src, ["-G", "Ninja"] if shutil.which("ninja") else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.3.36", help="the llama-cpp-python release whose vendored llama.cpp to build")
    ap.add_argument("--dest", type=Path, default=Path.home() / ".cache/dasllama/llama.cpp/bin")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        work = Path(tmp)
        build_log = work / "build.log"
        src, generator = vendored_sources(args.version, work, build_log)
        log.info("configuring llama.cpp (native CPU build, static)")
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
        run(["cmake", "-S", str(src), "-B", str(src / "build"), *generator, *flags], src, build_log)
        log.info("building %s with %d jobs (minutes)", ", ".join(TOOLS), args.jobs)
        run(["cmake", "--build", str(src / "build"), "-j", str(args.jobs), "--target", *TOOLS], src, build_log)
        args.dest.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(src / "build" / "bin" / tool, args.dest / tool)
    log.info("built into %s; put it on the PATH for the benches:\n  export PATH=%s:$PATH", args.dest, args.dest)


if __name__ == "__main__":
    main()

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

`--vulkan` builds the Vulkan backend instead, for the GPU check (`scripts/gpu_check.sh`) to run
llama.cpp beside dasllama on a lent GPU machine: `llama-bench`, `llama-batched-bench` and
`llama-quantize`, for a generic x86-64 with AVX2 rather than this machine's CPU (they run there),
with libstdc++ and libgcc linked in and no OpenMP, and stripped, so that they need only glibc and
`libvulkan.so.1` where they land. Needs the Vulkan headers, loader and shader compiler
(`apt-get install -y libvulkan-dev glslc spirv-headers` on Debian 12). Debian 12's glslc knows
no cooperative matrices nor integer dot products, without which llama.cpp's Vulkan backend falls
back to its slowest matrix kernels on NVIDIA (no fair figure beside dasllama), so where the
installed glslc lacks GL_NV_cooperative_matrix2 this fetches Debian 13's glslc and Vulkan headers
with apt-get (Debian's own archive, into a cache folder, installing nothing) and builds with them,
the glslc run through its own glibc's loader. Takes far longer than the CPU build (over a
thousand shaders):

    nice -n 19 python scripts/build_llama_cpp.py --vulkan --jobs 2 --dest .llama-vk
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger("build_llama_cpp")

TOOLS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-quantize")
# The server is left out of the Vulkan build: the GPU check runs no server, and every tool links
# the whole Vulkan backend, so each one costs megabytes of what may travel to the device machine.
VULKAN_TOOLS = ("llama-batched-bench", "llama-bench", "llama-quantize", "llama-mtmd-cli")
COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
CPU_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON"]
# Built here, run on another machine: no -march=native (AVX2, FMA and F16C every x86-64 server
# of the last decade has), no OpenMP (libgomp may be missing there; ggml's own thread pool does).
# The backend embeds every shader's SPIR-V (some 50 MB with the cooperative-matrix variants), so
# the Vulkan tools link it as one shared library beside them (found through $ORIGIN) rather than
# each carrying a copy; no OpenSSL (nothing is downloaded), so only glibc, libstdc++ and the Vulkan
# loader are needed where they land.
VULKAN_FLAGS = [
    "-DGGML_VULKAN=ON", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_RPATH=$ORIGIN",
]  # fmt: skip


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


def glslc_knows(glslc: str, extension: str, work: Path) -> bool:
    """Whether `glslc` compiles a compute shader that requires `extension` (as llama.cpp's
    CMakeLists asks it)."""
    src = work / f"probe-{extension}.comp"
    src.write_text(f"#version 460\n#extension {extension} : require\nlayout(local_size_x = 1) in;\nvoid main() {{}}\n")
    cmd = [glslc, "-o", "-", "-fshader-stage=compute", "--target-env=vulkan1.3", str(src)]
    return subprocess.run(cmd, check=False, capture_output=True).returncode == 0


def debian13_shader_tools(cache: Path, build_log: Path) -> tuple[Path, Path]:
    """Debian 13's glslc (shaderc 2025) and Vulkan headers, unpacked under `cache` from Debian's
    archive with apt-get's own download (no install): a wrapper that runs that glslc through the
    glibc and libstdc++ it was built for, and the include folder."""
    root, wrapper = cache / "root", cache / "glslc"
    if wrapper.exists() and (root / "usr/include/vulkan/vulkan_core.h").exists():
        return wrapper, root / "usr/include"
    lists, debs = cache / "lists", cache / "debs"
    for d in (lists / "partial", debs, cache / "archives/partial"):
        d.mkdir(parents=True, exist_ok=True)
    (cache / "sources.list").write_text("deb http://deb.debian.org/debian trixie main\n")
    # A private list and cache, so the host's own apt state (Debian 12) is left as it was.
    opts = [
        f"-oDir::Etc::SourceList={cache / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null", f"-oDir::State::Lists={lists}",
        f"-oDir::Cache={cache}", "-oAPT::Architecture=amd64", "-oAPT::Architectures=amd64",
    ]  # fmt: skip
    log.info("fetching Debian 13's glslc and Vulkan headers into %s", cache)
    run(["apt-get", *opts, "update"], cache, build_log)
    run(["apt-get", *opts, "download", "glslc", "libshaderc1", "libc6", "libgcc-s1", "libstdc++6", "libvulkan-dev", "spirv-headers"], debs, build_log)
    for deb in sorted(debs.glob("*.deb")):
        run(["dpkg-deb", "-x", str(deb), str(root)], cache, build_log)
    lib = root / "usr/lib/x86_64-linux-gnu"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(lib / "ld-linux-x86-64.so.2"))} --library-path {shlex.quote(str(lib))} {shlex.quote(str(root / "usr/bin/glslc"))} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, root / "usr/include"


def vulkan_shader_flags(work: Path, build_log: Path) -> list[str]:
    """CMake flags that point llama.cpp at a glslc which knows NVIDIA's cooperative matrices (and
    headers that declare them): the installed one where it does, else Debian 13's."""
    glslc = shutil.which("glslc")
    if glslc is None and shutil.which("apt-get") is None:
        raise SystemExit("glslc not found on the PATH: `apt-get install -y libvulkan-dev glslc spirv-headers`")
    if glslc is not None and glslc_knows(glslc, "GL_NV_cooperative_matrix2", work):
        return []
    if shutil.which("apt-get") is None:
        log.warning("%s knows no cooperative matrices: llama.cpp's Vulkan build will run its slowest matrix kernels", glslc)
        return []
    wrapper, include = debian13_shader_tools(Path.home() / ".cache/dasllama/debian13-glslc", build_log)
    if not glslc_knows(str(wrapper), "GL_NV_cooperative_matrix2", work):
        raise SystemExit(f"Debian 13's glslc ({wrapper}) does not compile GL_NV_cooperative_matrix2 either; see {build_log}")
    return [f"-DVulkan_GLSLC_EXECUTABLE={wrapper}", f"-DVulkan_INCLUDE_DIR={include}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.3.36", help="the llama-cpp-python release whose vendored llama.cpp to build")
    ap.add_argument("--dest", type=Path, default=Path.home() / ".cache/dasllama/llama.cpp/bin")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--vulkan", action="store_true", help="the Vulkan build of llama-bench, llama-batched-bench and llama-quantize, portable and stripped")
    ap.add_argument("--pack", action="store_true", help="with --vulkan: the tools and libraries as one llama-vk.tar.xz in --dest (what travels to the device)")
    ap.add_argument("--tools", nargs="+", default=None, help="the tools to build (default: llama-server, llama-batched-bench, llama-bench, llama-quantize; llama-mtmd-cli for bench_vision.py)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dest = args.dest.resolve()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        # The Vulkan build takes most of an hour on two cores: its tree is kept, so that a rerun
        # (after a failure, or for another --dest) only finishes what is left.
        work = Path.home() / f".cache/dasllama/llama.cpp/vulkan-{args.version}" if args.vulkan else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        build_log = work / "build.log"
        src = work / f"llama_cpp_python-{args.version}" / "vendor" / "llama.cpp"
        if args.vulkan and (src / "CMakeLists.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        else:
            src, generator = vendored_sources(args.version, work, build_log)
        tools = args.tools or (VULKAN_TOOLS if args.vulkan else TOOLS)
        log.info("configuring llama.cpp (%s)", "Vulkan build for x86-64 with AVX2, shared" if args.vulkan else "native CPU build, static")
        flags = COMMON_FLAGS + (VULKAN_FLAGS + vulkan_shader_flags(work, build_log) if args.vulkan else CPU_FLAGS)
        run(["cmake", "-S", str(src), "-B", str(src / "build"), *generator, *flags], src, build_log)
        log.info("building %s with %d jobs (minutes; log in %s)", ", ".join(tools), args.jobs, build_log)
        run(["cmake", "--build", str(src / "build"), "-j", str(args.jobs), "--target", *tools], src, build_log)
        bin_dir = src / "build" / "bin"
        stage = Path(tmp) / "stage" if args.pack else dest
        stage.mkdir(parents=True, exist_ok=True)
        # The shared libraries with their version links, as links (one copy of each library).
        libs = sorted(bin_dir.glob("lib*.so*")) if args.vulkan else []
        for f in [bin_dir / t for t in tools] + libs:
            target = stage / f.name
            target.unlink(missing_ok=True)
            shutil.copy2(f, target, follow_symlinks=False)
            # Symbols are most of a binary's size, and the Vulkan build's must travel.
            if args.vulkan and not f.is_symlink() and shutil.which("strip"):
                run(["strip", "--strip-unneeded", str(target)], src, build_log)
        if args.pack:
            dest.mkdir(parents=True, exist_ok=True)
            tar = dest / "llama-vk.tar.xz"
            run(["tar", "-C", str(stage), "-cJf", str(tar), *sorted(p.name for p in stage.iterdir())], src, build_log)
            log.info("packed %s (%.1f MiB)", tar, tar.stat().st_size / 2**20)
    log.info("built into %s; put it on the PATH for the benches:\n  export PATH=%s:$PATH", dest, dest)


if __name__ == "__main__":
    main()

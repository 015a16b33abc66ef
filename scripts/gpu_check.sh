#!/usr/bin/env bash
# The prepared check for a lent GPU machine (see the device tool's README): run once, in about
# 7 minutes. Nothing there can be fetched, and the real test models are larger than what may
# travel, so it checks the driver on models made there:
#   1. the device list, and the GPU's name (nvidia-smi -L, else the Vulkan device's);
#   2. a random-weight model of Llama-3.2-1B's shapes (its 128256-token vocabulary, tied
#      embeddings) written in F16, quantized to Q4_K_M by llama.cpp's own llama-quantize;
#   3. dasllama on the device: decode tokens/s of one stream, prefill tokens/s of a 512-token
#      prompt, and 16 streams' batched decode tokens/s (128-token prompts, 64 steps);
#   4. llama.cpp's Vulkan build from the same sources on the same file: llama-bench -p 512 -n 64
#      (pp512, tg64) and llama-batched-bench -npp 128 -ntg 64 -npl 16 (its S_TG);
#   5. one table of both, with their ratio, on stdout and in $OUT/bench.txt;
#   6. image encode of two vision towers (Gemma 3, Qwen2.5-VL; 4 layers at their real widths) on
#      the device and on the host's cores, beside llama-mtmd-cli where the pack has it
#      ($OUT/vision.txt);
#   7. the kernel-level and model-level Vulkan tests (the device goldens), with whatever time the
#      benches left: last, so that a slow or hung test cannot take the benches' time.
# Every step runs under its own `timeout` and within one budget (GPU_CHECK_BUDGET, 420 s), and a
# failed step is reported and passed over, never ending the run. $OUT gets bench.txt, steps.txt
# (each step's outcome and seconds), devices.txt, vision.txt, tests.txt and log.txt (every step's output).
#
# Prepare here (x86-64, Debian 12), in the repository root:
#   printf '/.gl/\n/.whl/\n/.llama-vk/\n' >>.git/info/exclude
#   # the Vulkan loader (as the device README shows, the loader alone)
#   mkdir -p .gl /tmp/amd64/partial; o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
#   apt-get $o update; (cd .gl && apt-get $o download libvulkan1)
#   # our wheel (abi3, so Python 3.12 there takes it) and gguf, the one dependency missing there
#   rm -rf .whl; maturin build --release --out .whl
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
#   # llama.cpp's Vulkan tools (llama-bench, llama-batched-bench, llama-quantize and the shared
#   # libraries they use) packed as .llama-vk/llama-vk.tar.xz; about 35 minutes on two busy cores
#   apt-get install -y libvulkan-dev glslc spirv-headers; python3 -m pip install cmake ninja
#   nice -n 19 python3 scripts/build_llama_cpp.py --vulkan --pack --jobs 2 --dest .llama-vk
# Then: run(command="bash scripts/gpu_check.sh", carry=[".gl", ".whl", ".llama-vk"], timeout_s=540)
#
# Here, on lavapipe (Mesa's CPU Vulkan: apt-get install -y mesa-vulkan-drivers libvulkan1), with
# a model of two narrow layers and a small vocabulary, in a few minutes:
#   source .venv/bin/activate; DASLLAMA_VK_ALLOW_CPU=1 GPU_CHECK_SMALL=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_check_out}
W=${GPU_CHECK_WORK:-/tmp/gpu_check}
SMALL=${GPU_CHECK_SMALL:-0}
BUDGET=${GPU_CHECK_BUDGET:-420}
LLAMA=${GPU_CHECK_LLAMA:-$PWD/.llama-vk}
mkdir -p "$OUT" "$W"
: >"$OUT/steps.txt"
: >"$OUT/log.txt"
START=$SECONDS
# Exported: the steps that are functions run in a shell of their own.
export OUT W PYTHONUNBUFFERED=1 GPU_CHECK_SMALL="$SMALL" GPU_CHECK_WORK="$W"

# step NAME LIMIT COMMAND...: COMMAND under `timeout`, its limit cut to what is left of the budget,
# its output into $W/NAME.txt and $OUT/log.txt with the last lines on stdout; its outcome into
# steps.txt. Returns COMMAND's status, so a later step can depend on an earlier one. With
# STEP_UNCUT=1 (the table: seconds, and the point of the run) the limit is kept past the budget.
step() {
    local name=$1 limit=$2 left rc t0
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    ((limit > left)) && [[ ${STEP_UNCUT:-0} != 1 ]] && limit=$left
    if ((limit < 5)); then
        printf '%-14s skipped: the budget (%ss) is spent\n' "$name" "$BUDGET" | tee -a "$OUT/steps.txt"
        return 124
    fi
    printf '\n== %s (limit %ss, at %ss)\n' "$name" "$limit" "$((SECONDS - START))" | tee -a "$OUT/log.txt"
    t0=$SECONDS
    # -k: a step that ignores TERM (a wedged driver call) is killed 10 s later. Through `bash -c`
    # so that a step may be one of the functions below (each exported).
    timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >"$W/$name.txt" 2>&1
    rc=$?
    cat "$W/$name.txt" >>"$OUT/log.txt"
    tail -n 6 "$W/$name.txt"
    local what=ok
    ((rc == 124 || rc == 137)) && what="TIMED OUT after ${limit}s"
    ((rc != 0 && rc != 124 && rc != 137)) && what="FAILED (exit $rc)"
    printf '%-14s %-28s %4ss\n' "$name" "$what" "$((SECONDS - t0))" | tee -a "$OUT/steps.txt"
    return "$rc"
}

# The carried Vulkan loader and wheels (on the device machine; here the loader is installed and
# the dev venv already imports dasllama).
setup() {
    if compgen -G ".gl/*.deb" >/dev/null; then
        for f in .gl/*.deb; do dpkg -x "$f" / || return 1; done
        ldconfig
    fi
    if ! python3 -c "import dasllama" 2>/dev/null; then
        compgen -G ".whl/*.whl" >/dev/null || { echo "dasllama does not import and no .whl was carried"; return 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
    fi
    # llama.cpp's Vulkan tools travel packed (the backend's shaders are some 50 MB unpacked).
    if [[ -f $LLAMA/llama-vk.tar.xz ]]; then
        rm -rf "$W/llama-vk" && mkdir -p "$W/llama-vk" && tar -C "$W/llama-vk" -xJf "$LLAMA/llama-vk.tar.xz" || return 1
    fi
    ldconfig -p | grep libvulkan || echo "no libvulkan on the loader path"
}
export -f setup
export LLAMA
step setup 90 setup
[[ -f $LLAMA/llama-vk.tar.xz ]] && LLAMA=$W/llama-vk
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site:$PWD/tests || export PYTHONPATH=$PWD/tests
if [[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]]; then
    # The NVIDIA driver's ICD lies outside the loader's search path there; with it named, a
    # missing device fails the tests instead of skipping them.
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json} DASLLAMA_VK_REQUIRE=${DASLLAMA_VK_REQUIRE:-1}
fi
if [[ ${DASLLAMA_VK_ALLOW_CPU:-0} == 1 ]]; then
    # llama.cpp skips CPU-type Vulkan devices unless named; lavapipe is the only one here.
    export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
fi

devices() {
    command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi -L
    python3 - <<'PY'
from dasllama import gpu

print("witness:", gpu.kernel_backend_available("vulkan"))
for d in gpu.vulkan_devices():
    print(d)
PY
}
export -f devices
step devices 60 devices
cp "$W/devices.txt" "$OUT/devices.txt"
GPU=$(grep -m1 '^GPU 0:' "$W/devices.txt" | sed 's/ (UUID.*//; s/^GPU 0: //')
[[ -z $GPU ]] && GPU=$(python3 - "$W/devices.txt" <<'PY'
import ast
import sys

for line in open(sys.argv[1]):
    if line.startswith("{"):
        d = ast.literal_eval(line)
        print(f"{d.get('name')} (Vulkan, {d.get('kind')})")
        break
PY
)
export GPU_CHECK_GPU=${GPU:-unknown}

# The model: F16 (llama-quantize's input, as llama.cpp's own conversions make it), random weights
# drawn once and reused across tensors (speed does not depend on their values; drawing 1.2B
# normals would cost half a minute), each scaled by 1/sqrt(fan-in) so activations stay ordinary.
step model 120 python3 - <<'PY'
from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
log = logging.getLogger("gpu_check.model")
small = os.environ["GPU_CHECK_SMALL"] == "1"
# Llama-3.2-1B: d 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192, vocabulary 128256.
d, layers, heads, kv, hd, ffn, vocab = (256, 2, 4, 2, 64, 512, 4096) if small else (2048, 16, 32, 8, 64, 8192, 128256)
path = os.path.join(os.environ["GPU_CHECK_WORK"], "bench-f16.gguf")
t0 = time.perf_counter()
w = GGUFWriter(path, "llama")
w.add_name("gpu_check llama 1B shapes (random weights)")
w.add_block_count(layers)
w.add_context_length(8192)
w.add_embedding_length(d)
w.add_feed_forward_length(ffn)
w.add_head_count(heads)
w.add_head_count_kv(kv)
w.add_rope_freq_base(500000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_dimension_count(hd)
w.add_vocab_size(vocab)
w.add_file_type(1)  # MOSTLY_F16
# A SentencePiece-style vocabulary: specials, the 256 byte tokens, then plain pieces to fill it.
pieces = vocab - 3 - 256
w.add_tokenizer_model("llama")
w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581p{i}" for i in range(pieces)])
w.add_token_scores([0.0] * 259 + [-float(i) for i in range(pieces)])
w.add_token_types([2, 3, 3] + [6] * 256 + [1] * pieces)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
rng = np.random.default_rng(0)
pool = rng.standard_normal(1 << 22, dtype=np.float32).astype(np.float16)


def mat(name: str, rows: int, cols: int, std: float) -> None:
    # numpy order rows x cols = GGUF's ne = [cols, rows]; a random rotation of the pool.
    n = rows * cols
    x = np.resize(np.roll(pool, int(rng.integers(len(pool)))), n).reshape(rows, cols)
    w.add_tensor(name, x * np.float16(std), raw_dtype=GGMLQuantizationType.F16)


def norm(name: str, n: int) -> None:
    w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))


mat("token_embd.weight", vocab, d, 1.0)  # tied: also the output projection, as in Llama-3.2-1B
for i in range(layers):
    p = f"blk.{i}."
    norm(p + "attn_norm.weight", d)
    mat(p + "attn_q.weight", heads * hd, d, d**-0.5)
    mat(p + "attn_k.weight", kv * hd, d, d**-0.5)
    mat(p + "attn_v.weight", kv * hd, d, d**-0.5)
    mat(p + "attn_output.weight", d, heads * hd, 0.5 * d**-0.5)
    norm(p + "ffn_norm.weight", d)
    mat(p + "ffn_gate.weight", ffn, d, d**-0.5)
    mat(p + "ffn_up.weight", ffn, d, d**-0.5)
    mat(p + "ffn_down.weight", d, ffn, 0.5 * ffn**-0.5)
norm("output_norm.weight", d)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
log.info("wrote %s (%.0f MiB) in %.1f s", path, os.path.getsize(path) / 2**20, time.perf_counter() - t0)
PY
MODEL_OK=$?

export F16=$W/bench-f16.gguf Q4=$W/bench-q4_k_m.gguf
rm -f "$Q4"
if ((MODEL_OK == 0)); then
    step quantize 90 "$LLAMA/llama-quantize" "$F16" "$Q4" Q4_K_M "$(nproc)"
else
    printf '%-14s skipped: no F16 model\n' quantize | tee -a "$OUT/steps.txt"
fi

# dasllama on the device: every figure a median of runs after a warm-up (the first dispatches
# build pipelines), its figures as JSON for the table.
bench_dasllama() {
    python3 - "$Q4" "$W/dasllama.json" <<'PY'
from __future__ import annotations

import json
import logging
import statistics
import sys
import time

import dasllama as dl
from dasllama import gpu

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
log = logging.getLogger("gpu_check.dasllama")
path, out = sys.argv[1], sys.argv[2]
STREAMS, PROMPT, STEPS, PP = 16, 128, 64, 512
figures: dict[str, object] = {}


def save() -> None:
    # After every figure: a later one that hangs or fails leaves the earlier ones in the table.
    with open(out, "w") as f:
        json.dump(figures, f)


gpu.set_gpu_resident_regions(STREAMS)
gpu.set_gpu_ctx_max(1024)
gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True))
log.info("armed: %s %s", gpu.moe_gpu_tier_arm(), gpu.gpu_tier_status())
t0 = time.perf_counter()
m = dl.load_model(path)
placement = gpu.gpu_slot_capture(gpu.gpu_model_marks_init())
figures["placement"] = placement
log.info("loaded in %.1f s: %s %s", time.perf_counter() - t0, placement, gpu.gpu_install_reason())
save()
vocab = m.n_vocab
ids = [(1000 + 7919 * i) % (vocab - 300) + 259 for i in range(PP)]


def session() -> dl.Session:
    s = gpu.create_device_session(m)
    if not gpu.is_device_session(s):
        raise SystemExit(f"no device session: {gpu.gpu_install_reason()}")
    return s


def decode(runs: int = 3) -> float:
    rates = []
    for _ in range(runs):
        s = session()
        dl.eval(m, s, ids[:1])
        for t in ids[1:5]:  # warm-up
            dl.eval(m, s, [t])
        t0 = time.perf_counter()
        for t in ids[5 : 5 + STEPS]:
            dl.eval(m, s, [t])
        rates.append(STEPS / (time.perf_counter() - t0))
        gpu.gpu_device_kv_park(s)
    return statistics.median(rates)


def prefill(runs: int = 3) -> float:
    s = session()
    dl.eval(m, s, ids[:PP])  # warm-up: the prefill chain's pipelines
    gpu.gpu_device_kv_park(s)
    rates = []
    for _ in range(runs):
        s = session()
        t0 = time.perf_counter()
        dl.eval(m, s, ids[:PP])
        rates.append(PP / (time.perf_counter() - t0))
        gpu.gpu_device_kv_park(s)
    return statistics.median(rates)


def batched() -> float:
    ss = [session() for _ in range(STREAMS)]
    for i, s in enumerate(ss):
        dl.eval(m, s, ids[i : i + PROMPT])
    ws = dl.create_batch_workspace(m)
    for j in range(4):  # warm-up
        dl.eval_batch(m, ws, ss, [ids[(PROMPT + j + 7 * i) % PP] for i in range(STREAMS)])
    t0 = time.perf_counter()
    for j in range(STEPS):
        dl.eval_batch(m, ws, ss, [ids[(PROMPT + 4 + j + 7 * i) % PP] for i in range(STREAMS)])
    rate = STREAMS * STEPS / (time.perf_counter() - t0)
    for s in ss:
        gpu.gpu_device_kv_park(s)
    return rate


for name, fn in (("tg64", decode), ("pp512", prefill), ("tg64x16", batched)):
    try:
        t0 = time.perf_counter()
        figures[name] = fn()
        log.info("%s: %.1f tok/s (%.1f s)", name, figures[name], time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - one figure's failure is reported, the others still run
        figures[name + "_error"] = f"{type(e).__name__}: {e}"
        log.info("%s failed: %s", name, figures[name + "_error"])
    save()
passes = gpu.gpu_cpu_passes()
figures["cpu_passes"] = [f"{p}" for p in passes]
log.info("CPU passes while on the device: %s", passes or "none")
save()
PY
}
export -f bench_dasllama
rm -f "$W/dasllama.json" "$W/llama-bench.txt" "$W/llama-batched.txt"
if [[ -f $Q4 ]]; then
    step dasllama 150 bench_dasllama
    # Its own figures (-o jsonl on stdout, one line a test), 3 runs after its warm-up.
    step llama-bench 90 "$LLAMA/llama-bench" -m "$Q4" -ngl 99 -p 512 -n 64 -r 3 -o jsonl
    # 16 sequences of a 128-token prompt each, then 64 steps of all 16: S_TG is 16 x 64 / t_tg.
    # Then the same for one sequence, if only because this llama.cpp's logger drops what is still
    # queued when the program exits (llama.cpp issue 22142): the 16 streams' line is written out
    # while the single stream runs.
    step llama-batched 90 "$LLAMA/llama-batched-bench" -m "$Q4" -ngl 99 -c 4096 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 16,1 --output-format jsonl
else
    printf '%-14s skipped: no Q4_K_M model\n' benches | tee -a "$OUT/steps.txt"
fi

table() {
    python3 - "$W" "$OUT/bench.txt" <<'PY'
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
log = logging.getLogger("gpu_check.table")
work, out = Path(sys.argv[1]), Path(sys.argv[2])


def jsonl(name: str) -> list[dict[str, object]]:
    # The tools' JSON lines among their logs.
    p = work / name
    rows = []
    for line in p.read_text(errors="replace").splitlines() if p.exists() else []:
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


ours: dict[str, object] = {}
if (work / "dasllama.json").exists():
    ours = json.loads((work / "dasllama.json").read_text())
theirs: dict[str, float] = {}
info = ""
for r in jsonl("llama-bench.txt"):
    key = "pp512" if r.get("n_prompt") == 512 and r.get("n_gen") == 0 else "tg64" if r.get("n_gen") == 64 and r.get("n_prompt") == 0 else None
    if key:
        theirs[key] = float(r["avg_ts"])  # type: ignore[arg-type]
        info = f"{r.get('backends', '')} on {r.get('gpu_info', '')}, build {r.get('build_commit', '')}"
for r in jsonl("llama-batched.txt"):
    if r.get("pl") == 16:
        theirs["tg64x16"] = float(r["speed_tg"])  # type: ignore[arg-type]
rows = [("decode, 1 stream (tg64)", "tg64"), ("prefill, 512 tokens (pp512)", "pp512"), ("decode, 16 streams (tg64 x16)", "tg64x16")]


def cell(v: object) -> str:
    return f"{v:.1f}" if isinstance(v, float) else "-"


small = " (GPU_CHECK_SMALL: 2 narrow layers, not the 1B)" if os.environ.get("GPU_CHECK_SMALL") == "1" else ""
lines = [
    f"GPU: {os.environ.get('GPU_CHECK_GPU', 'unknown')}",
    f"Model: random-weight Llama-3.2-1B shapes, Q4_K_M by llama-quantize{small}",
    f"dasllama placement: {ours.get('placement', '-')}; llama.cpp: {info or '-'}",
    "",
    "| figure (tokens/s) | dasllama | llama.cpp | ratio |",
    "| --- | ---: | ---: | ---: |",
]
for label, key in rows:
    a, b = ours.get(key), theirs.get(key)
    ratio = f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"
    lines.append(f"| {label} | {cell(a)} | {cell(b)} | {ratio} |")
for k, v in ours.items():
    if k.endswith("_error") or (k == "cpu_passes" and v):
        lines.append(f"dasllama {k}: {v}")
text = "\n".join(lines) + "\n"
out.write_text(text)
log.info("%s", text)
PY
}
export -f table
STEP_UNCUT=1 step table 30 table
cat "$OUT/bench.txt" 2>/dev/null

# Image encode: Gemma 3's tower (4096 patches of 896 x 896, full attention) and Qwen2.5-VL's
# (windows), cut to 4 layers at their real widths, on the device, then on the host's cores,
# beside llama-mtmd-cli where the pack has it (its Vulkan build: the tower on the GPU too).
vision() {
    local llama=(--no-llama) how=(--cases gemma3 qwen25vl --layers 4 --runs 2 --threads "$(nproc)")
    [[ -x $LLAMA/llama-mtmd-cli ]] && llama=() && export PATH=$LLAMA:$PATH
    [[ $GPU_CHECK_SMALL == 1 ]] && how+=(--shapes tiny)
    python3 benches/bench_vision.py "${how[@]}" --device vulkan "${llama[@]}" || return 1
    python3 benches/bench_vision.py "${how[@]}" --no-llama
}
export -f vision
step vision 90 vision
grep -A12 '^image encode' "$W/vision.txt" >"$OUT/vision.txt" 2>/dev/null

# The device goldens and model-level tests: last, with what is left of the budget.
step tests 240 python3 -m pytest -q tests/test_vulkan.py tests/test_vision_device.py -k "not real_models and not server"
cp "$W/tests.txt" "$OUT/tests.txt" 2>/dev/null

printf '\n== steps (budget %ss, used %ss)\n' "$BUDGET" "$((SECONDS - START))"
cat "$OUT/steps.txt"
cat "$OUT/bench.txt" "$OUT/vision.txt" 2>/dev/null
echo done

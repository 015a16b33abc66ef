#!/usr/bin/env bash
# The prepared check for a lent GPU machine (see the device tool's README): run once, well under
# 10 minutes. Nothing there can be fetched, and the real test models are larger than what may
# travel, so it checks the driver on synthetic models made there: the kernel-level and model-level
# Vulkan tests, then decode and batched-decode tokens/s of a random-weight model of Llama-3.2-1B's
# shapes on the device beside the same model on the CPU.
#
# Prepare here (x86-64), in the repository root:
#   echo /.gl/ >>.git/info/exclude; echo /.whl/ >>.git/info/exclude
#   (the Vulkan loader debs into .gl, as the device README shows)
#   maturin build --release --out .whl && python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --platform manylinux2014_x86_64 -d .whl gguf==0.17.1
# Then: run(command="bash scripts/gpu_check.sh", carry=[".gl", ".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/tests PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/devices.txt"
from dasllama import gpu
print("witness:", gpu.kernel_backend_available("vulkan"))
for d in gpu.vulkan_devices():
    print(d)
PY
timeout 240 python3 -m pytest -q -x tests/test_vulkan.py -k "not real_models and not server" 2>&1 | tee "$OUT/tests.txt" | tail -5
timeout 240 python3 - <<'PY' 2>&1 | tee "$OUT/bench.txt"
# Decode and 16-stream batched decode of a random Llama-3.2-1B-shaped model (Q4_0) on the device
# and on the CPU: tokens/s.
import time, numpy as np, dasllama as dl
from dasllama import gpu
from gguf import GGUFWriter, GGMLQuantizationType as QT
from gguf.quants import quantize
from synthetic import _write_vocab
D, L, H, KV, F, V = 2048, 16, 32, 8, 8192, 32000
w = GGUFWriter("/tmp/b1.gguf", "llama")
for k, v in {"block_count": L, "context_length": 2048, "embedding_length": D, "feed_forward_length": F, "attention.head_count": H,
             "attention.head_count_kv": KV, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 500000.0}.items():
    (w.add_uint32 if isinstance(v, int) else w.add_float32)(f"llama.{k}", v)
_write_vocab(w)
rng = np.random.default_rng(0)
def mat(name, r, c):
    w.add_tensor(name, quantize(rng.normal(0, 0.02, (r, c)).astype(np.float32), QT.Q4_0), raw_dtype=QT.Q4_0)
mat("token_embd.weight", 267, D)
for i in range(L):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32)); w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
    mat(p + "attn_q.weight", D, D); mat(p + "attn_k.weight", KV * 64, D); mat(p + "attn_v.weight", KV * 64, D); mat(p + "attn_output.weight", D, D)
    mat(p + "ffn_gate.weight", F, D); mat(p + "ffn_up.weight", F, D); mat(p + "ffn_down.weight", D, F)
w.add_tensor("output_norm.weight", np.ones(D, np.float32))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
gpu.set_gpu_resident_regions(16); gpu.set_gpu_ctx_max(512)
gpu.set_gpu_tier_want(gpu.GpuTierWant(auto_tier=True)); print("armed", gpu.moe_gpu_tier_arm())
m = dl.load_model("/tmp/b1.gguf"); print("outcome", gpu.gpu_slot_capture(gpu.gpu_model_marks_init()), gpu.gpu_install_reason())
def decode(make, n_streams, steps=64):
    ss = [make() for _ in range(n_streams)]
    ws = dl.create_batch_workspace(m)
    for s in ss: dl.eval(m, s, [1, 5, 9])
    t = time.perf_counter()
    for i in range(steps): dl.eval_batch(m, ws, ss, [7 + i % 50] * n_streams)
    return n_streams * steps / (time.perf_counter() - t)
for n in (1, 16):
    dev = decode(lambda: gpu.create_device_session(m), n)
    cpu = decode(lambda: dl.create_session(m), n, 8)
    print(f"| {n} streams | device {dev:.1f} tok/s | CPU {cpu:.1f} tok/s |")
PY
echo done

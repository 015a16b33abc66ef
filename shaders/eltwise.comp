#version 450
#extension GL_GOOGLE_include_directive : require
// The element-wise ops of a layer, one kernel with an op code:
//   0 add:      x[i] += y[i % width]   (width = count: residual add; width = row: bias)
//   1 silu GLU: x[i] = silu(x[i]) * y[i]
//   2 gelu GLU: x[i] = gelu_tanh(x[i]) * y[i], GELU's input and result in f16
//   3 softcap:  x[i] = a * tanh(x[i] / a)
//   4 copy:     x[i] = y[i]
//   5 swiglu_oai: gpt-oss's clamped GLU (cpu/ops.rs swiglu_oai): g = min(x[i], 7), u =
//                 clamp(y[i], -7, 7), x[i] = g / (1 + e^(1.702 * -g)) * (u + 1)
//   6 mul:        x[i] *= y[i]
//   7 sigmoid:    x[i] = 1 / (1 + e^-x[i])
//   8 scale:      x[i] *= a
//   9 add_scaled: x[i] += a * y[i]
//  10 col scale:  x[i] *= y[i % width]
//  11 row axpy:   x[i] += z[i / width] * y[i]   (a per-row weight: a gated shared expert)
//  12 row scale:  x[i] *= z[i / width]          (a per-row factor: mistral3's query temperature)
// Products and sums are `precise` where the CPU rounds them one at a time, so no compiler fuses
// them into one fma: x += a * y then gives the CPU's bits (the MoE's weighted sums rely on it).
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s y;
    uint count;
    uint width;
    uint op;
    float a;
    F32s z;
} p;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (i >= p.count) {
        return;
    }
    float v = p.x.v[i];
    if (p.op == 0u) {
        v += p.y.v[i % p.width];
    } else if (p.op == 1u) {
        v = v / (1.0 + exp(-v)) * p.y.v[i];
    } else if (p.op == 2u) {
        // As ggml's CPU build (and ours) computes it: from the f16 input, rounded to f16.
        float h = round_f16(v);
        float inner = fma(0.044715 * h, h, 1.0);
        v = round_f16(0.5 * h * (1.0 + tanh(0.7978846 * h * inner))) * p.y.v[i];
    } else if (p.op == 3u) {
        v = p.a * tanh(v / p.a);
    } else if (p.op == 4u) {
        v = p.y.v[i];
    } else if (p.op == 5u) {
        float g = min(v, 7.0);
        float u = clamp(p.y.v[i], -7.0, 7.0);
        precise float s = g / (1.0 + exp(1.702 * -g));
        v = s * (u + 1.0);
    } else if (p.op == 6u) {
        v *= p.y.v[i];
    } else if (p.op == 7u) {
        v = 1.0 / (1.0 + exp(-v));
    } else if (p.op == 8u) {
        v *= p.a;
    } else if (p.op == 9u) {
        precise float t = p.a * p.y.v[i];
        precise float r = v + t;
        v = r;
    } else if (p.op == 10u) {
        v *= p.y.v[i % p.width];
    } else if (p.op == 11u) {
        precise float t = p.z.v[i / p.width] * p.y.v[i];
        precise float r = v + t;
        v = r;
    } else {
        v *= p.z.v[i / p.width];
    }
    p.x.v[i] = v;
}

#version 450
#extension GL_GOOGLE_include_directive : require
// The element-wise ops of a layer, one kernel with an op code:
//   0 add:      x[i] += y[i % width]   (width = count: residual add; width = row: bias)
//   1 silu GLU: x[i] = silu(x[i]) * y[i]
//   2 gelu GLU: x[i] = gelu_tanh(x[i]) * y[i], GELU's input and result in f16
//   3 softcap:  x[i] = a * tanh(x[i] / a)
//   4 copy:     x[i] = y[i]
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s y;
    uint count;
    uint width;
    uint op;
    float a;
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
    } else {
        v = p.y.v[i];
    }
    p.x.v[i] = v;
}

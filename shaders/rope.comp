#version 450
#extension GL_GOOGLE_include_directive : require
// Rotary embedding of every head of every row from the step's table of (sin, cos) pairs per row
// (computed on the host, exactly as the CPU path does). One invocation per rotated pair.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s tab;
    uint width;
    uint head_dim;
    uint half_;
    uint neox;
    uint total;
} p;

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (g >= p.total) {
        return;
    }
    uint heads = p.width / p.head_dim;
    uint i = g % p.half_;
    uint h = (g / p.half_) % heads;
    uint t = g / (p.half_ * heads);
    uint base = t * p.width + h * p.head_dim;
    uint a = p.neox != 0u ? i : 2u * i;
    uint b = p.neox != 0u ? i + p.half_ : 2u * i + 1u;
    float s = p.tab.v[2u * (t * p.half_ + i)];
    float c = p.tab.v[2u * (t * p.half_ + i) + 1u];
    float x0 = p.x.v[base + a], x1 = p.x.v[base + b];
    p.x.v[base + a] = fma(x0, c, -(x1 * s));
    p.x.v[base + b] = fma(x0, s, x1 * c);
}

#version 450
#extension GL_GOOGLE_include_directive : require
// out[row] = x[row] / rms(x[row]) * w, one workgroup per row (whole rows, or single heads for
// QK-norm). In place when out == x.
#include "common.glsl"

#define WG 64u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s w;
    F32s out_;
    uint width;
    float eps;
} p;

shared float red[WG];

void main() {
    uint row = gl_WorkGroupID.x;
    uint tid = gl_LocalInvocationID.x;
    uint base = row * p.width;
    float s = 0.0;
    for (uint i = tid; i < p.width; i += WG) {
        float v = p.x.v[base + i];
        s = fma(v, v, s);
    }
    red[tid] = s;
    barrier();
    for (uint k = WG / 2u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    float scale = 1.0 / sqrt(red[0] / float(p.width) + p.eps);
    for (uint i = tid; i < p.width; i += WG) {
        p.out_.v[base + i] = p.x.v[base + i] * scale * p.w.v[i];
    }
}

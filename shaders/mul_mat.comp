#version 450
#extension GL_GOOGLE_include_directive : require
// y[t][r] = dot(W[r], x[t]) for up to NC activation rows per workgroup, one weight row per
// workgroup. Each thread owns a fixed set of 16-value units of the row and the partial sums add
// up in a fixed tree, so a row's result does not depend on which other rows share the dispatch:
// batched decode gives each stream what it gets alone.
#include "common.glsl"
#include "dequant.glsl"

#define WG 64u
#define NC 8u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    U32s w;
    F32s x;
    F32s y;
    uint rows;
    uint cols;
    uint n;
    uint row_words;
    uint x_stride;
    uint y_stride;
    uint rows_per_z;
} p;

shared float red[NC][WG];

void main() {
    uint r = gl_WorkGroupID.x + gl_WorkGroupID.z * p.rows_per_z;
    uint t0 = gl_WorkGroupID.y * NC;
    if (r >= p.rows) {
        return;
    }
    uint nc = min(NC, p.n - t0);
    uint tid = gl_LocalInvocationID.x;
    float acc[NC];
    [[unroll]] for (uint c = 0u; c < NC; c++) acc[c] = 0.0;
    uint units = p.cols / 16u;
    for (uint u = tid; u < units; u += WG) {
        float wv[16];
        dequant16(p.w, r * p.row_words, u, wv);
        // Constant bounds so the compiler keeps acc and wv in registers.
        [[unroll]] for (uint c = 0u; c < NC; c++) {
            if (c < nc) {
                uint xb = (t0 + c) * p.x_stride + u * 16u;
                float s = 0.0;
                [[unroll]] for (uint i = 0u; i < 16u; i++) s = fma(wv[i], p.x.v[xb + i], s);
                acc[c] += s;
            }
        }
    }
    [[unroll]] for (uint c = 0u; c < NC; c++) red[c][tid] = acc[c];
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            [[unroll]] for (uint c = 0u; c < NC; c++) red[c][tid] += red[c][tid + s];
        }
        barrier();
    }
    if (tid < nc) {
        p.y.v[(t0 + tid) * p.y_stride + r] = red[tid][0];
    }
}

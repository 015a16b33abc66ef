#version 450
#extension GL_GOOGLE_include_directive : require
// y[t][r] = dot(W[r], x[t]) with one invocation per weight row and no shared memory: the form
// for CPU-type Vulkan devices (lavapipe), where a workgroup's barriers cost more than its
// arithmetic. A row's sum runs in one fixed order whatever the batch, as in mul_mat.comp.
#include "common.glsl"
#include "dequant.glsl"

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

void main() {
    uint r = gl_GlobalInvocationID.x + gl_WorkGroupID.z * p.rows_per_z;
    uint t0 = gl_WorkGroupID.y * NC;
    if (r >= p.rows) {
        return;
    }
    uint nc = min(NC, p.n - t0);
    float acc[NC];
    [[unroll]] for (uint c = 0u; c < NC; c++) acc[c] = 0.0;
    uint units = p.cols / 16u;
    for (uint u = 0u; u < units; u++) {
        float wv[16];
        dequant16(p.w, r * p.row_words, u, wv);
        [[unroll]] for (uint c = 0u; c < NC; c++) {
            if (c < nc) {
                uint xb = (t0 + c) * p.x_stride + u * 16u;
                float s = 0.0;
                [[unroll]] for (uint i = 0u; i < 16u; i++) s = fma(wv[i], p.x.v[xb + i], s);
                acc[c] += s;
            }
        }
    }
    [[unroll]] for (uint c = 0u; c < NC; c++) {
        if (c < nc) p.y.v[(t0 + c) * p.y_stride + r] = acc[c];
    }
}

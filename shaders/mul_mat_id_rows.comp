#version 450
#extension GL_GOOGLE_include_directive : require
// mul_mat_id.comp with one invocation per weight row and no shared memory: the form for CPU-type
// Vulkan devices (lavapipe), as mul_mat_rows.comp is mul_mat.comp's. A row's sum runs exactly as
// in mul_mat_rows.comp.
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    U32s w;
    F32s x;
    F32s y;
    U32s ids;
    F32s bias;
    uint rows;
    uint cols;
    uint n_used;
    uint row_words;
    uint x_stride_t;
    uint x_stride_j;
    uint y_stride;
    uint has_bias;
    uint rows_per_z;
} p;

void main() {
    uint r = gl_GlobalInvocationID.x + gl_WorkGroupID.z * p.rows_per_z;
    uint s = gl_WorkGroupID.y;
    if (r >= p.rows) {
        return;
    }
    uint e = p.ids.v[2u * s];
    uint xb0 = (s / p.n_used) * p.x_stride_t + (s % p.n_used) * p.x_stride_j;
    uint wrow = (e * p.rows + r) * p.row_words;
    float acc = 0.0;
    uint units = p.cols / 16u;
    for (uint u = 0u; u < units; u++) {
        float wv[16];
        dequant16(p.w, wrow, u, wv);
        uint xb = xb0 + u * 16u;
        float sum = 0.0;
        [[unroll]] for (uint i = 0u; i < 16u; i++) sum = fma(wv[i], p.x.v[xb + i], sum);
        acc += sum;
    }
    if (p.has_bias != 0u) acc += p.bias.v[e * p.rows + r];
    p.y.v[s * p.y_stride + r] = acc;
}

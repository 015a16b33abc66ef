#version 450
#extension GL_GOOGLE_include_directive : require
// The experts' matmul: for slot s (row t = s / n_used, its j = s % n_used-th chosen expert e,
// read from the route's (expert, weight) pairs), y[s][r] = dot(W_e[r], x[t * x_stride_t +
// j * x_stride_j ..]) (+ bias[e * rows + r] where has_bias), one weight row and slot per
// workgroup. The experts' matrices are stored one after the other (expert e's row r is row
// e * rows + r). A row's sum runs exactly as in mul_mat.comp (the same units per thread, the same
// tree), so an expert's row is what the dense matmul gives, whatever the batch.
#include "common.glsl"
#include "dequant.glsl"

#define WG 64u
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

shared float red[WG];

void main() {
    uint r = gl_WorkGroupID.x + gl_WorkGroupID.z * p.rows_per_z;
    uint s = gl_WorkGroupID.y;
    if (r >= p.rows) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint e = p.ids.v[2u * s];
    uint xb0 = (s / p.n_used) * p.x_stride_t + (s % p.n_used) * p.x_stride_j;
    uint wrow = (e * p.rows + r) * p.row_words;
    float acc = 0.0;
    uint units = p.cols / 16u;
    for (uint u = tid; u < units; u += WG) {
        float wv[16];
        dequant16(p.w, wrow, u, wv);
        uint xb = xb0 + u * 16u;
        float sum = 0.0;
        [[unroll]] for (uint i = 0u; i < 16u; i++) sum = fma(wv[i], p.x.v[xb + i], sum);
        acc += sum;
    }
    red[tid] = acc;
    barrier();
    for (uint k = WG / 2u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    if (tid == 0u) {
        float v = red[0];
        if (p.has_bias != 0u) v += p.bias.v[e * p.rows + r];
        p.y.v[s * p.y_stride + r] = v;
    }
}

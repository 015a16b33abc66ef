#version 450
#extension GL_GOOGLE_include_directive : require
// Columns of each row into another matrix's columns: dst[r][dst_col + i] = src[r][src_col + i]
// for i < cols. What splits interleaved projections (a gated attention's queries and gates,
// DeltaNet's betas and alphas), takes one layer's share of per-layer inputs, or places two
// matrices side by side.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s src;
    F32s dst;
    uint src_width;
    uint src_col;
    uint dst_width;
    uint dst_col;
    uint cols;
    uint rows;
} p;

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (g >= p.rows * p.cols) {
        return;
    }
    uint r = g / p.cols, i = g % p.cols;
    p.dst.v[r * p.dst_width + p.dst_col + i] = p.src.v[r * p.src_width + p.src_col + i];
}

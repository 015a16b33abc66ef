#version 450
#extension GL_GOOGLE_include_directive : require
// Embedding gather: out[t] = scale * W[ids[t]], dequantized.
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    U32s w;
    F32s out_;
    U32s ids;
    uint cols;
    uint row_words;
    float scale;
} p;

void main() {
    uint t = gl_WorkGroupID.y;
    uint u = gl_GlobalInvocationID.x;
    if (u >= p.cols / 16u) {
        return;
    }
    float wv[16];
    dequant16(p.w, p.ids.v[t] * p.row_words, u, wv);
    [[unroll]] for (uint i = 0u; i < 16u; i++) p.out_.v[t * p.cols + u * 16u + i] = wv[i] * p.scale;
}

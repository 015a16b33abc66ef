#version 450
#extension GL_GOOGLE_include_directive : require
// dst[j] = src[idx[j]], rows of `width`: the rows that get logits.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s src;
    F32s dst;
    U32s idx;
    uint width;
    uint count;
} p;

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (g >= p.count * p.width) {
        return;
    }
    uint j = g / p.width, i = g % p.width;
    p.dst.v[g] = p.src.v[p.idx.v[j] * p.width + i];
}

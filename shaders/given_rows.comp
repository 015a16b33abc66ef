#version 450
#extension GL_GOOGLE_include_directive : require
// Rows given as values (an image's): batch row t whose map entry k names one takes columns
// src_off.. of given row k in place of its own (or, with `add`, adds them: Qwen3-VL's deepstack
// slices); rows whose entry is 0xffffffff (a token's) are left as they are.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    U32s map;
    F32s values;
    uint width;
    uint src_width;
    uint src_off;
    uint n;
    uint add;
} p;

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (g >= p.n * p.width) {
        return;
    }
    uint t = g / p.width, c = g % p.width;
    uint k = p.map.v[t];
    if (k == 0xffffffffu) {
        return;
    }
    float v = p.values.v[k * p.src_width + p.src_off + c];
    p.x.v[g] = p.add != 0u ? p.x.v[g] + v : v;
}

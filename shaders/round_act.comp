#version 450
#extension GL_GOOGLE_include_directive : require
// Round activations the way the CPU path (and llama.cpp) quantizes them before a dot product
// with weights of a given format, so the device's products see the same input values:
//   1: q8_0 / q8_1 blocks of 32: scale amax/127 (stored as f16), values rounded half to even
//   2: q8_K blocks of 256: scale from the signed value of largest magnitude, -127/max
//   3: f16    4: bf16
// One invocation per block; out[i] = the value the rounded block stands for. Divisions are
// div_rn's (common.glsl): a GPU's `/` may miss the CPU's quotient by an ulp, and a scale an ulp
// off rounds some values to the other integer.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s out_;
    uint blocks;
    uint mode;
} p;

void main() {
    uint b = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (b >= p.blocks) {
        return;
    }
    if (p.mode == 1u) {
        uint o = b * 32u;
        float amax = 0.0;
        for (uint j = 0u; j < 32u; j++) amax = max(amax, abs(p.x.v[o + j]));
        float id = amax != 0.0 ? div_rn(127.0, amax) : 0.0;
        float d = round_f16(div_rn(amax, 127.0));
        for (uint j = 0u; j < 32u; j++) p.out_.v[o + j] = roundEven(p.x.v[o + j] * id) * d;
    } else if (p.mode == 2u) {
        uint o = b * 256u;
        float amax = 0.0, mx = 0.0;
        for (uint j = 0u; j < 256u; j++) {
            float v = p.x.v[o + j];
            if (abs(v) > amax) {
                amax = abs(v);
                mx = v;
            }
        }
        float iscale = amax != 0.0 ? div_rn(-127.0, mx) : 0.0;
        float d = amax != 0.0 ? div_rn(1.0, iscale) : 0.0;
        for (uint j = 0u; j < 256u; j++) p.out_.v[o + j] = min(roundEven(iscale * p.x.v[o + j]), 127.0) * d;
    } else if (p.mode == 3u) {
        p.out_.v[b] = round_f16(p.x.v[b]);
    } else {
        uint u = floatBitsToUint(p.x.v[b]);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        p.out_.v[b] = uintBitsToFloat(u);
    }
}

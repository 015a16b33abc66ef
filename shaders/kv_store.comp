#version 450
#extension GL_GOOGLE_include_directive : require
// Write each batch row's K and V (f32) into its session's device region as f16, at the row's
// position. meta[2t] = the region's first word, meta[2t + 1] = the row's position.
// A region holds, per attention layer slot, K then V: [ctx][kv_dim] f16 each.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s k;
    F32s v;
    U32s kv;
    U32s meta;
    uint kvd;
    uint n;
    uint slot_off;
    uint v_off;
} p;

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    uint hw = p.kvd / 2u;
    if (g >= p.n * hw) {
        return;
    }
    uint t = g / hw, i = g % hw;
    uint dst = p.meta.v[2u * t] + p.slot_off + p.meta.v[2u * t + 1u] * hw + i;
    uint src = t * p.kvd + 2u * i;
    p.kv.v[dst] = packHalf2x16(vec2(p.k.v[src], p.k.v[src + 1u]));
    p.kv.v[dst + p.v_off] = packHalf2x16(vec2(p.v.v[src], p.v.v[src + 1u]));
}

#version 450
#extension GL_GOOGLE_include_directive : require
// Write each batch row's K and V (f32) into its session's device region at the row's position,
// in the region's codec (one variant each; see kv.glsl for the layouts). meta[2t] = the region's
// first word, meta[2t + 1] = the row's position. A region holds, per attention layer slot, K then
// V: [ctx][row_words] each.
//   KV_F16:  a thread per pair of values.
//   KV_Q8_0: a thread per 32-value block of K and of V, rounded as ggml's quantize_row_q8_0_ref.
//   KV_TQ4:  a workgroup per (row, KV head): the head is rotated (signs, then an orthonormal
//            Walsh-Hadamard transform in shared memory, as kv::codec::rotate), then each block
//            is rounded as ggml's quantize_row_q4_0_ref.
#include "common.glsl"
#include "kv.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s k;
    F32s v;
    U32s kv;
    U32s meta;
    F32s signs;
    uint kvd;
    uint n;
    uint slot_off;
    uint v_off;
    uint head_dim;
    float rscale;
} p;

#if defined(KV_F16)
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
#elif defined(KV_Q8_0)
void store_q8(F32s x, uint src, uint dst) {
    float amax = 0.0;
    for (uint j = 0u; j < 32u; j++) amax = max(amax, abs(x.v[src + j]));
    float d = div_rn(amax, 127.0);
    float id = d != 0.0 ? div_rn(1.0, d) : 0.0;
    p.kv.v[dst] = packHalf2x16(vec2(d, 0.0));
    for (uint w = 0u; w < 8u; w++) {
        uint word = 0u;
        for (uint b = 0u; b < 4u; b++) {
            float s = x.v[src + 4u * w + b] * id;
            // Rust's f32::round (and C's roundf): halves away from zero.
            int q = int(sign(s) * floor(abs(s) + 0.5));
            word |= (uint(q) & 0xFFu) << (8u * b);
        }
        p.kv.v[dst + 1u + w] = word;
    }
}

void main() {
    uint g = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    uint nb = p.kvd / 32u;
    if (g >= p.n * nb) {
        return;
    }
    uint t = g / nb, b = g % nb;
    uint dst = p.meta.v[2u * t] + p.slot_off + p.meta.v[2u * t + 1u] * nb * Q8_WORDS + b * Q8_WORDS;
    uint src = t * p.kvd + 32u * b;
    store_q8(p.k, src, dst);
    store_q8(p.v, src, dst + p.v_off);
}
#elif defined(KV_TQ4)
shared float hv[2][MAX_HD];

void main() {
    uint hd = p.head_dim, tid = gl_LocalInvocationID.x;
    uint n_kv = p.kvd / hd;
    uint t = gl_WorkGroupID.y, h = gl_WorkGroupID.x;
    uint src = t * p.kvd + h * hd;
    for (uint d = tid; d < hd; d += 64u) {
        hv[0][d] = p.k.v[src + d] * p.signs.v[d];
        hv[1][d] = p.v.v[src + d] * p.signs.v[d];
    }
    barrier();
    FWHT_BODY(hv, 2u, hd, tid, p.rscale)
    uint nb = hd / 32u;
    uint row = p.meta.v[2u * t] + p.slot_off + p.meta.v[2u * t + 1u] * n_kv * nb * Q4_WORDS;
    if (tid < 2u * nb) {
        uint which = tid / nb, b = tid % nb;
        float mx = 0.0, amax = 0.0;
        for (uint j = 0u; j < 32u; j++) {
            float x = hv[which][32u * b + j];
            if (abs(x) > amax) {
                amax = abs(x);
                mx = x;
            }
        }
        float d = mx / -8.0;
        float id = d != 0.0 ? div_rn(1.0, d) : 0.0;
        uint dst = row + (h * nb + b) * Q4_WORDS + which * p.v_off;
        p.kv.v[dst] = packHalf2x16(vec2(d, 0.0));
        for (uint w = 0u; w < 4u; w++) {
            uint word = 0u;
            for (uint c = 0u; c < 4u; c++) {
                uint j = 4u * w + c;
                uint lo = min(15u, uint(hv[which][32u * b + j] * id + 8.5));
                uint hi = min(15u, uint(hv[which][32u * b + 16u + j] * id + 8.5));
                word |= (lo | (hi << 4u)) << (8u * c);
            }
            p.kv.v[dst + 1u + w] = word;
        }
    }
}
#endif

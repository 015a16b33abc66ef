#version 450
#extension GL_GOOGLE_include_directive : require
// Causal attention of one query head of one batch row over its session's device K/V region
// (which already holds the row's own position), in tiles of 64 positions with a running softmax
// (flash-decode). One workgroup per (head, row); every thread computes one score per tile, then
// owns head dimensions tid, tid + 64, ... of the output. The order of every sum is fixed, so a
// row's result is the same whatever else the batch holds.
#include "common.glsl"

#define WG 64u
#define MAX_HD 256u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s q;
    F32s out_;
    U32s kv;
    U32s meta;
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;
    uint window;
    float qmul;
    float smul;
    float softcap;
    uint slot_off;
    uint v_off;
} p;

shared float qs[MAX_HD];
shared float sc[WG];

void main() {
    uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    uint tid = gl_LocalInvocationID.x;
    uint hd = p.head_dim, hw = hd / 2u;
    uint kvd = p.n_kv_heads * hd;
    uint kvh = h / (p.n_heads / p.n_kv_heads);
    uint qbase = (t * p.n_heads + h) * hd;
    // Queries as the CPU takes them against an f16 cache: scaled where the family scales them,
    // then rounded to f16.
    for (uint d = tid; d < hd; d += WG) qs[d] = round_f16(p.q.v[qbase + d] * p.qmul);
    uint pos = p.meta.v[2u * t + 1u];
    uint start = (p.window > 0u && pos + 1u > p.window) ? pos + 1u - p.window : 0u;
    uint kbase = p.meta.v[2u * t] + p.slot_off + kvh * hw;
    uint vbase = kbase + p.v_off;
    float m = -1.0 / 0.0, l = 0.0;
    float acc[MAX_HD / WG];
    [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) acc[k] = 0.0;
    barrier();
    for (uint p0 = start; p0 <= pos; p0 += WG) {
        uint cnt = min(WG, pos + 1u - p0);
        if (tid < cnt) {
            uint kr = kbase + (p0 + tid) * (kvd / 2u);
            float s = 0.0;
            for (uint d = 0u; d < hw; d++) {
                vec2 kk = unpackHalf2x16(p.kv.v[kr + d]);
                s = fma(qs[2u * d], kk.x, s);
                s = fma(qs[2u * d + 1u], kk.y, s);
            }
            if (p.softcap > 0.0) s = p.softcap * tanh(s / p.softcap);
            sc[tid] = s * p.smul;
        }
        barrier();
        float tm = m;
        for (uint j = 0u; j < cnt; j++) tm = max(tm, sc[j]);
        float corr = exp(m - tm);
        float ts = 0.0;
        for (uint j = 0u; j < cnt; j++) ts += exp(sc[j] - tm);
        l = l * corr + ts;
        [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
            uint d = tid + k * WG;
            if (d < hd) {
                float a = acc[k] * corr;
                for (uint j = 0u; j < cnt; j++) {
                    vec2 vv = unpackHalf2x16(p.kv.v[vbase + (p0 + j) * (kvd / 2u) + d / 2u]);
                    a = fma(exp(sc[j] - tm), (d & 1u) != 0u ? vv.y : vv.x, a);
                }
                acc[k] = a;
            }
        }
        m = tm;
        barrier();
    }
    [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
        uint d = tid + k * WG;
        if (d < hd) p.out_.v[qbase + d] = acc[k] / l;
    }
}

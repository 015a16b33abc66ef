#version 450
#extension GL_GOOGLE_include_directive : require
// Causal attention of one batch row over its session's device K/V region (which already holds
// the row's own position), for up to MAX_G query heads that share one KV head: each K and V row
// is read once for all of them (GQA). Positions go in tiles of 64 with a running softmax
// (flash-decode): every thread scores one position of the tile for each head, then owns head
// dimensions tid, tid + 64, ... of the outputs. Every sum runs in a fixed order, so a row's
// result is the same whatever else the batch holds.
// Workgroups: x = KV head * ceil(group / MAX_G) + chunk of query heads, y = batch row.
#include "common.glsl"

#define WG 64u
#define MAX_HD 256u
#define MAX_G 8u
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

shared float qs[MAX_G][MAX_HD];
shared float sc[MAX_G][WG];

void main() {
    uint group = p.n_heads / p.n_kv_heads;
    uint chunks = (group + MAX_G - 1u) / MAX_G;
    uint kvh = gl_WorkGroupID.x / chunks;
    uint h0 = kvh * group + (gl_WorkGroupID.x % chunks) * MAX_G;
    uint ng = min(MAX_G, kvh * group + group - h0);
    uint t = gl_WorkGroupID.y;
    uint tid = gl_LocalInvocationID.x;
    uint hd = p.head_dim, hw = hd / 2u;
    uint kvd = p.n_kv_heads * hd;
    // Queries as the CPU takes them against an f16 cache: scaled where the family scales them,
    // then rounded to f16.
    for (uint g = 0u; g < ng; g++) {
        for (uint d = tid; d < hd; d += WG) qs[g][d] = round_f16(p.q.v[(t * p.n_heads + h0 + g) * hd + d] * p.qmul);
    }
    uint pos = p.meta.v[2u * t + 1u];
    uint start = (p.window > 0u && pos + 1u > p.window) ? pos + 1u - p.window : 0u;
    uint kbase = p.meta.v[2u * t] + p.slot_off + kvh * hw;
    uint vbase = kbase + p.v_off;
    float m[MAX_G], l[MAX_G], acc[MAX_G][MAX_HD / WG];
    [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
        m[g] = -1.0 / 0.0;
        l[g] = 0.0;
        [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) acc[g][k] = 0.0;
    }
    barrier();
    for (uint p0 = start; p0 <= pos; p0 += WG) {
        uint cnt = min(WG, pos + 1u - p0);
        if (tid < cnt) {
            uint kr = kbase + (p0 + tid) * (kvd / 2u);
            float s[MAX_G];
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) s[g] = 0.0;
            for (uint d = 0u; d < hw; d++) {
                vec2 kk = unpackHalf2x16(p.kv.v[kr + d]);
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                    if (g < ng) {
                        s[g] = fma(qs[g][2u * d], kk.x, s[g]);
                        s[g] = fma(qs[g][2u * d + 1u], kk.y, s[g]);
                    }
                }
            }
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                if (g < ng) {
                    float v = s[g];
                    if (p.softcap > 0.0) v = p.softcap * tanh(v / p.softcap);
                    sc[g][tid] = v * p.smul;
                }
            }
        }
        barrier();
        float tm[MAX_G], corr[MAX_G];
        [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
            if (g < ng) {
                tm[g] = m[g];
                for (uint j = 0u; j < cnt; j++) tm[g] = max(tm[g], sc[g][j]);
                corr[g] = exp(m[g] - tm[g]);
                float ts = 0.0;
                for (uint j = 0u; j < cnt; j++) ts += exp(sc[g][j] - tm[g]);
                l[g] = l[g] * corr[g] + ts;
            }
        }
        [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
            uint d = tid + k * WG;
            if (d < hd) {
                float a[MAX_G];
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) a[g] = g < ng ? acc[g][k] * corr[g] : 0.0;
                for (uint j = 0u; j < cnt; j++) {
                    vec2 vv = unpackHalf2x16(p.kv.v[vbase + (p0 + j) * (kvd / 2u) + d / 2u]);
                    float v = (d & 1u) != 0u ? vv.y : vv.x;
                    [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                        if (g < ng) a[g] = fma(exp(sc[g][j] - tm[g]), v, a[g]);
                    }
                }
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) acc[g][k] = a[g];
            }
        }
        [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
            if (g < ng) m[g] = tm[g];
        }
        barrier();
    }
    [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
        uint d = tid + k * WG;
        if (d < hd) {
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                if (g < ng) p.out_.v[(t * p.n_heads + h0 + g) * hd + d] = acc[g][k] / l[g];
            }
        }
    }
}

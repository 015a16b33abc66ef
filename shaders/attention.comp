#version 450
#extension GL_GOOGLE_include_directive : require
// Causal attention of one batch row over its session's device K/V region (which already holds
// the row's own position), for up to MAX_G query heads that share one KV head: each K and V row
// is read once for all of them (GQA). Positions go in tiles of 64 with a running softmax
// (flash-decode): every thread scores one position of the tile for each head, then owns head
// dimensions tid, tid + 64, ... of the outputs. Every sum runs in a fixed order, so a row's
// result is the same whatever else the batch holds.
// One variant per K/V codec (kv.glsl): q8_0 rows are read block by block, scale times the block's
// sum as the CPU's kv_dot does; tq4 rows are in a rotated basis, so the queries are rotated into
// it first and the outputs rotated back at the end (kv::codec::rotate / unrotate).
// Attention sinks (gpt-oss): where has_sinks is set, query head h's logit sinks[h] joins the
// softmax's max and normalizer with no value behind it (unscaled, as cpu/backend.rs and ggml's
// soft_max_ext take it): the running softmax starts from it (m = sink, l = e^0 = 1) instead of
// from nothing (m = -inf, l = 0), so every later tile rescales it as it rescales the scores.
// Key ends (an image's rows that see each other): where has_ends is set, row t attends up to
// ends[t] (exclusive) instead of its own position + 1; a sliding window still starts from its own.
// Workgroups: x = KV head * ceil(group / MAX_G) + chunk of query heads, y = batch row.
#include "common.glsl"
#include "kv.glsl"

#define WG 64u
#define MAX_G 8u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s q;
    F32s out_;
    U32s kv;
    U32s meta;
    F32s signs;
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;
    uint window;
    float qmul;
    float smul;
    float softcap;
    uint slot_off;
    uint v_off;
    uint row_words;
    float rscale;
    F32s sinks;
    uint has_sinks;
    uint has_ends;
    U32s ends;
} p;

shared float qs[MAX_G][MAX_HD];

// Value d of the stored row starting at word `row`, as (quant or value, the scale it takes).
vec2 kv_value(uint row, uint d) {
#if defined(KV_F16)
    vec2 vv = unpackHalf2x16(p.kv.v[row + d / 2u]);
    return vec2((d & 1u) != 0u ? vv.y : vv.x, 1.0);
#elif defined(KV_Q8_0)
    uint bw = row + (d / 32u) * Q8_WORDS, j = d % 32u;
    float q = float(bitfieldExtract(int(p.kv.v[bw + 1u + j / 4u]), int(8u * (j % 4u)), 8));
    return vec2(q, unpackHalf2x16(p.kv.v[bw]).x);
#else
    uint bw = row + (d / 32u) * Q4_WORDS, j = d % 32u, byte = j % 16u;
    uint sh = 8u * (byte % 4u) + (j >= 16u ? 4u : 0u);
    float q = float(int((p.kv.v[bw + 1u + byte / 4u] >> sh) & 15u) - 8);
    return vec2(q, unpackHalf2x16(p.kv.v[bw]).x);
#endif
}
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
    // Queries as the CPU takes them against an f16 cache: scaled where the family scales them,
    // then rounded to f16.
    for (uint g = 0u; g < ng; g++) {
        for (uint d = tid; d < hd; d += WG) qs[g][d] = round_f16(p.q.v[(t * p.n_heads + h0 + g) * hd + d] * p.qmul);
    }
#if defined(KV_TQ4)
    for (uint g = 0u; g < ng; g++) {
        for (uint d = tid; d < hd; d += WG) qs[g][d] *= p.signs.v[d];
    }
    barrier();
    FWHT_BODY(qs, ng, hd, tid, p.rscale)
#endif
    uint pos = p.meta.v[2u * t + 1u];
    uint start = (p.window > 0u && pos + 1u > p.window) ? pos + 1u - p.window : 0u;
    uint end = p.has_ends != 0u ? p.ends.v[t] : pos + 1u;
    uint kbase = p.meta.v[2u * t] + p.slot_off + kvh * HEAD_WORDS(hd);
    uint vbase = kbase + p.v_off;
    float m[MAX_G], l[MAX_G], acc[MAX_G][MAX_HD / WG];
    [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
        bool sink = p.has_sinks != 0u && g < ng;
        m[g] = sink ? p.sinks.v[h0 + g] : -1.0 / 0.0;
        l[g] = sink ? 1.0 : 0.0;
        [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) acc[g][k] = 0.0;
    }
    barrier();
    for (uint p0 = start; p0 < end; p0 += WG) {
        uint cnt = min(WG, end - p0);
        if (tid < cnt) {
            uint kr = kbase + (p0 + tid) * p.row_words;
            float s[MAX_G];
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) s[g] = 0.0;
#if defined(KV_F16)
            for (uint d = 0u; d < hw; d++) {
                vec2 kk = unpackHalf2x16(p.kv.v[kr + d]);
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                    if (g < ng) {
                        s[g] = fma(qs[g][2u * d], kk.x, s[g]);
                        s[g] = fma(qs[g][2u * d + 1u], kk.y, s[g]);
                    }
                }
            }
#else
            for (uint b = 0u; b < hd / 32u; b++) {
#if defined(KV_Q8_0)
                uint bw = kr + b * Q8_WORDS;
#else
                uint bw = kr + b * Q4_WORDS;
#endif
                float scale = unpackHalf2x16(p.kv.v[bw]).x;
                float bs[MAX_G];
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) bs[g] = 0.0;
#if defined(KV_Q8_0)
                for (uint w = 0u; w < 8u; w++) {
                    int word = int(p.kv.v[bw + 1u + w]);
                    [[unroll]] for (uint c = 0u; c < 4u; c++) {
                        float kk = float(bitfieldExtract(word, int(8u * c), 8));
                        [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                            if (g < ng) bs[g] = fma(qs[g][32u * b + 4u * w + c], kk, bs[g]);
                        }
                    }
                }
#else
                for (uint w = 0u; w < 4u; w++) {
                    uint word = p.kv.v[bw + 1u + w];
                    [[unroll]] for (uint c = 0u; c < 4u; c++) {
                        uint j = 4u * w + c;
                        float lo = float(int((word >> (8u * c)) & 15u) - 8);
                        float hi = float(int((word >> (8u * c + 4u)) & 15u) - 8);
                        [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                            if (g < ng) {
                                bs[g] = fma(qs[g][32u * b + j], lo, bs[g]);
                                bs[g] = fma(qs[g][32u * b + 16u + j], hi, bs[g]);
                            }
                        }
                    }
                }
#endif
                [[unroll]] for (uint g = 0u; g < MAX_G; g++) s[g] = fma(scale, bs[g], s[g]);
            }
#endif
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
                    vec2 v = kv_value(vbase + (p0 + j) * p.row_words, d);
                    [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                        if (g < ng) a[g] = fma(exp(sc[g][j] - tm[g]) * v.y, v.x, a[g]);
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
#if defined(KV_TQ4)
    // Back from the rotated basis: the outputs through the transform, then the signs.
    [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
        uint d = tid + k * WG;
        if (d < hd) {
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                if (g < ng) qs[g][d] = acc[g][k] / l[g];
            }
        }
    }
    barrier();
    FWHT_BODY(qs, ng, hd, tid, p.rscale)
    for (uint g = 0u; g < ng; g++) {
        for (uint d = tid; d < hd; d += WG) p.out_.v[(t * p.n_heads + h0 + g) * hd + d] = qs[g][d] * p.signs.v[d];
    }
#else
    [[unroll]] for (uint k = 0u; k < MAX_HD / WG; k++) {
        uint d = tid + k * WG;
        if (d < hd) {
            [[unroll]] for (uint g = 0u; g < MAX_G; g++) {
                if (g < ng) p.out_.v[(t * p.n_heads + h0 + g) * hd + d] = acc[g][k] / l[g];
            }
        }
    }
#endif
}

#version 450
#extension GL_GOOGLE_include_directive : require
// A vision tower's full attention: out_h = softmax(q_h k_hᵀ * scale) v_h for each head h, every
// row against every row (no mask), rows of heads * hd values. Flash-attention style, so no n x n
// scores exist anywhere: a workgroup takes 32 query rows of one head and walks the keys 16 at a
// time through shared memory, keeping each row's running max and sum (online softmax) and its
// output accumulators in registers. Scores go through exp2 with log2(e) folded into the scale.
//
// Per key tile, four phases split by barriers: K up; scores (each thread a 2 x 4 block of
// query rows x keys, from vec4s of Q and K in shared memory); the softmax update (a thread per
// row) while V comes up into K's place; P V (each thread 4 rows x 4 vec4 columns of the
// output). K and V share one buffer so Q, K/V and P fit 27 KiB for heads up to 128 values.
#include "common.glsl"

layout(buffer_reference, std430, buffer_reference_align = 16) buffer Vec4s { vec4 v[]; };
// Each row's window, [start, end): its keys. Rows come window after window, so a tile's rows
// span the keys from its first row's start to its last row's end.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer Bounds { uvec2 b[]; };

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    Vec4s q;
    Vec4s k;
    Vec4s v;
    Vec4s out_;
    Bounds bounds;
    uint n;
    uint heads;
    uint hd;
    float scale;
    uint windowed;
} p;

#define BQ 32u
#define BK 16u
// vec4 columns of the widest head (128 values), plus one so that consecutive rows start in
// different banks (a row of 32 vec4s would put every row's column c in the same ones).
#define HD4 32u
#define STRIDE4 33u
// Below any score: a key past n never raises the max, and exp2 of it is 0.
#define NEG (-3.0e38)

shared vec4 qs[BQ * STRIDE4];
shared vec4 kvs[BK * STRIDE4];
shared float ps[BQ * (BK + 1u)];
shared float alpha_s[BQ];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint q0 = gl_WorkGroupID.x * BQ;
    uint h = gl_WorkGroupID.y;
    uint hd4 = p.hd >> 2;
    uint row4 = p.heads * hd4;
    uint head4 = h * hd4;
    float sl2 = p.scale * 1.4426950408889634;

    // Rows past n load as zeros: their results are never written.
    for (uint e = tid; e < BQ * hd4; e += 64u) {
        uint r = e / hd4, c = e - r * hd4;
        uint row = q0 + r;
        qs[r * STRIDE4 + c] = row < p.n ? p.q.v[row * row4 + head4 + c] : vec4(0.0);
    }

    // Scores: rows srow + 16i, keys kg + 4j.
    uint srow = tid >> 2, kg = tid & 3u;
    // P V: rows prow + 8i, vec4 columns pcol + 8j (columns past hd4 are skipped).
    uint prow = tid >> 3, pcol = tid & 7u;
    vec4 acc[4][4];
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            acc[i][j] = vec4(0.0);
        }
    }
    // The softmax state of row tid (threads below BQ).
    float m = NEG, l = 0.0;

    // The keys of the tile's rows, and of this thread's two score rows (all of them without
    // windows; a row past n takes the last row's, and its results are never written).
    bool windows = p.windowed != 0u;
    uint last = min(q0 + BQ, p.n) - 1u;
    uint kbeg = windows ? p.bounds.b[q0].x : 0u;
    uint kend = windows ? p.bounds.b[last].y : p.n;
    uvec2 own[2];
    [[unroll]] for (uint i = 0u; i < 2u; i++) {
        own[i] = windows ? p.bounds.b[min(q0 + srow + 16u * i, last)] : uvec2(0u, p.n);
    }

    for (uint k0 = kbeg; k0 < kend; k0 += BK) {
        uint kn = min(BK, kend - k0);
        for (uint e = tid; e < BK * hd4; e += 64u) {
            uint r = e / hd4, c = e - r * hd4;
            kvs[r * STRIDE4 + c] = r < kn ? p.k.v[(k0 + r) * row4 + head4 + c] : vec4(0.0);
        }
        barrier();

        float s[2][4];
        [[unroll]] for (uint i = 0u; i < 2u; i++) {
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                s[i][j] = 0.0;
            }
        }
        for (uint c = 0u; c < hd4; c++) {
            vec4 a0 = qs[srow * STRIDE4 + c];
            vec4 a1 = qs[(srow + 16u) * STRIDE4 + c];
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                vec4 b = kvs[(kg + 4u * j) * STRIDE4 + c];
                s[0][j] += dot(a0, b);
                s[1][j] += dot(a1, b);
            }
        }
        [[unroll]] for (uint i = 0u; i < 2u; i++) {
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                uint key = kg + 4u * j;
                bool in_row = key < kn && k0 + key >= own[i].x && k0 + key < own[i].y;
                ps[(srow + 16u * i) * (BK + 1u) + key] = in_row ? s[i][j] * sl2 : NEG;
            }
        }
        barrier();

        // V replaces K (every score is in ps); a key past n must be 0, not stale, as 0 * NaN is NaN.
        for (uint e = tid; e < BK * hd4; e += 64u) {
            uint r = e / hd4, c = e - r * hd4;
            kvs[r * STRIDE4 + c] = r < kn ? p.v.v[(k0 + r) * row4 + head4 + c] : vec4(0.0);
        }
        if (tid < BQ) {
            uint base = tid * (BK + 1u);
            float mt = m;
            [[unroll]] for (uint j = 0u; j < BK; j++) {
                mt = max(mt, ps[base + j]);
            }
            float sum = 0.0;
            [[unroll]] for (uint j = 0u; j < BK; j++) {
                // A key outside the row's window weighs nothing, even in a tile with no key of
                // its window yet (there mt is still NEG, and exp2(NEG - NEG) would be 1).
                float e = ps[base + j] > 0.5 * NEG ? exp2(ps[base + j] - mt) : 0.0;
                ps[base + j] = e;
                sum += e;
            }
            float a = exp2(m - mt);
            l = l * a + sum;
            m = mt;
            alpha_s[tid] = a;
        }
        barrier();

        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            float a = alpha_s[prow + 8u * i];
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                acc[i][j] *= a;
            }
        }
        for (uint key = 0u; key < kn; key++) {
            float w[4];
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                w[i] = ps[(prow + 8u * i) * (BK + 1u) + key];
            }
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                uint c = pcol + 8u * j;
                if (c < hd4) {
                    vec4 b = kvs[key * STRIDE4 + c];
                    [[unroll]] for (uint i = 0u; i < 4u; i++) {
                        acc[i][j] = fma(vec4(w[i]), b, acc[i][j]);
                    }
                }
            }
        }
        // The next tile's K overwrites V, and its scores ps.
        barrier();
    }

    if (tid < BQ) {
        alpha_s[tid] = 1.0 / l;
    }
    barrier();
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint r = prow + 8u * i;
        uint row = q0 + r;
        if (row < p.n) {
            float inv = alpha_s[r];
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                uint c = pcol + 8u * j;
                if (c < hd4) {
                    p.out_.v[row * row4 + head4 + c] = acc[i][j] * inv;
                }
            }
        }
    }
}

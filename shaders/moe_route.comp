#version 450
#extension GL_GOOGLE_include_directive : require
// MoE routing of one row of router logits per workgroup, as cpu/backend.rs `Ops::route` does it:
// scores by softmax (gating 0), sigmoid (1) or the raw logits (2, SOFTMAX_WEIGHT); the n_used
// experts of the highest scores plus the selection bias (where has_bias), highest first, ties to
// the lower expert (the CPU's sort: Rust's total_cmp order, then the index); their unbiased
// scores as weights (softmax over the chosen ones under gating 2), renormalised to sum to 1
// where norm (the sum clamped below at the smallest normal f16, as llama.cpp), times scale.
// out_ gets n_used (expert id, weight bits) word pairs per row, highest score first.
// Reductions run in a fixed tree, so a row's choice and weights do not depend on its batch.
#include "common.glsl"

#define WG 64u
#define MAX_E 512u
#define MAX_USED 32u
#define NONE 0xFFFFFFFFu
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s logits;
    U32s out_;
    F32s bias;
    uint n_expert;
    uint n_used;
    uint gating;
    uint has_bias;
    uint norm;
    float scale;
} p;

shared float pr[MAX_E];
shared int key[MAX_E];
shared uint taken[MAX_E];
shared float red[WG];
shared int rk[WG];
shared uint ri[WG];
shared uint chosen[MAX_USED];

// An int that orders as Rust's f32::total_cmp orders the float.
int total_key(float v) {
    int b = floatBitsToInt(v);
    return b ^ int(uint(b >> 31) >> 1);
}

void main() {
    uint t = gl_WorkGroupID.x;
    uint tid = gl_LocalInvocationID.x;
    uint ne = p.n_expert;
    for (uint e = tid; e < ne; e += WG) {
        pr[e] = p.logits.v[t * ne + e];
        taken[e] = 0u;
    }
    barrier();
    if (p.gating == 0u) {
        float mx = -1.0 / 0.0;
        for (uint e = tid; e < ne; e += WG) mx = max(mx, pr[e]);
        red[tid] = mx;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1) {
            if (tid < s) red[tid] = max(red[tid], red[tid + s]);
            barrier();
        }
        mx = red[0];
        barrier();
        float sum = 0.0;
        for (uint e = tid; e < ne; e += WG) {
            float v = exp(pr[e] - mx);
            pr[e] = v;
            sum += v;
        }
        red[tid] = sum;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1) {
            if (tid < s) red[tid] += red[tid + s];
            barrier();
        }
        float inv = 1.0 / red[0];
        for (uint e = tid; e < ne; e += WG) pr[e] *= inv;
    } else if (p.gating == 1u) {
        for (uint e = tid; e < ne; e += WG) pr[e] = 1.0 / (1.0 + exp(-pr[e]));
    }
    barrier();
    for (uint e = tid; e < ne; e += WG) {
        precise float s = p.has_bias != 0u ? pr[e] + p.bias.v[e] : pr[e];
        key[e] = total_key(s);
    }
    barrier();
    for (uint j = 0u; j < p.n_used; j++) {
        // Each thread's best of its experts (ascending, so a tie keeps the lower), then a tree.
        int bk = 0;
        uint bi = NONE;
        for (uint e = tid; e < ne; e += WG) {
            if (taken[e] == 0u && (bi == NONE || key[e] > bk)) {
                bk = key[e];
                bi = e;
            }
        }
        rk[tid] = bk;
        ri[tid] = bi;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1) {
            if (tid < s) {
                uint oi = ri[tid + s];
                uint mi = ri[tid];
                if (oi != NONE && (mi == NONE || rk[tid + s] > rk[tid] || (rk[tid + s] == rk[tid] && oi < mi))) {
                    rk[tid] = rk[tid + s];
                    ri[tid] = oi;
                }
            }
            barrier();
        }
        if (tid == 0u) {
            chosen[j] = ri[0];
            taken[ri[0]] = 1u;
        }
        barrier();
    }
    if (tid == 0u) {
        uint nu = p.n_used;
        float w[MAX_USED];
        for (uint j = 0u; j < nu; j++) w[j] = pr[chosen[j]];
        if (p.gating == 2u) {
            float mx = -1.0 / 0.0;
            for (uint j = 0u; j < nu; j++) mx = max(mx, w[j]);
            float sum = 0.0;
            for (uint j = 0u; j < nu; j++) {
                w[j] = exp(w[j] - mx);
                sum += w[j];
            }
            float inv = 1.0 / sum;
            for (uint j = 0u; j < nu; j++) w[j] *= inv;
        }
        if (p.norm != 0u) {
            float sum = 0.0;
            for (uint j = 0u; j < nu; j++) sum += w[j];
            sum = max(sum, 6.1035156e-5);
            for (uint j = 0u; j < nu; j++) w[j] /= sum;
        }
        if (p.scale != 1.0) {
            for (uint j = 0u; j < nu; j++) w[j] *= p.scale;
        }
        for (uint j = 0u; j < nu; j++) {
            p.out_.v[2u * (t * nu + j)] = chosen[j];
            p.out_.v[2u * (t * nu + j) + 1u] = floatBitsToUint(w[j]);
        }
    }
}

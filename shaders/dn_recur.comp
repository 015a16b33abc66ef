#version 450
#extension GL_GOOGLE_include_directive : require
// dn_recur_rows.comp's recurrence (its header says what it computes) in the form for GPUs: the
// state's rows go eight at a time, each row to eight threads, thread l of a row taking the CPU's
// lane l (values l, l + 8, ...: the sum the CPU keeps in its lane l, in the same order), so a
// warp reads runs of eight consecutive values of four rows instead of one value of 32 rows. The
// lanes meet in shared memory and are paired as the CPU pairs them, then the tail (thread 0 of the
// row): dn_recur_rows.comp's operations in its order (equal bits on lavapipe; NVIDIA's compiler
// puts the two an ulp or a few apart, each within the CPU's tolerance).
#include "common.glsl"

#define WG 64u
#define MAX_HD 256u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s qkv;
    F32s beta;
    F32s alpha;
    F32s out_;
    U32s meta;
    F32s state;
    F32s dt_bias;
    F32s a;
    uint hd;
    uint n_k_heads;
    uint n_v_heads;
    uint tiled;
    float eps_n;
    float sqrt_n;
    float scale;
} p;

shared float qn[MAX_HD];
shared float kn[MAX_HD];
shared float rq[WG];
shared float rk[WG];
// Each of the eight rows' lane sums, and its tail.
shared float la[8][8];
shared float tl[8];

float lanes(float a[8]) {
    precise float x = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    return x;
}

void main() {
    uint h = gl_WorkGroupID.x;
    uint m = gl_WorkGroupID.y * 6u;
    uint tid = gl_LocalInvocationID.x;
    uint first = p.meta.v[m], cnt = p.meta.v[m + 1u], sin_ = p.meta.v[m + 4u], sout = p.meta.v[m + 5u];
    uint hd = p.hd, nv = p.n_v_heads;
    uint kd = p.n_k_heads * hd, cd = 2u * kd + nv * hd;
    uint kh = p.tiled != 0u ? h % p.n_k_heads : h / (nv / p.n_k_heads);
    uint n8 = hd / 8u * 8u;
    uint hbase = h * hd * hd;
    for (uint t = 0u; t < cnt; t++) {
        uint row = (first + t) * cd;
        float sq = 0.0, sk = 0.0;
        for (uint i = tid; i < hd; i += WG) {
            float qv = p.qkv.v[row + kh * hd + i], kv = p.qkv.v[row + kd + kh * hd + i];
            qn[i] = qv;
            kn[i] = kv;
            precise float q2 = qv * qv;
            precise float k2 = kv * kv;
            precise float sq2 = sq + q2;
            precise float sk2 = sk + k2;
            sq = sq2;
            sk = sk2;
        }
        rq[tid] = sq;
        rk[tid] = sk;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1) {
            if (tid < s) {
                precise float a = rq[tid] + rq[tid + s];
                precise float b = rk[tid] + rk[tid + s];
                rq[tid] = a;
                rk[tid] = b;
            }
            barrier();
        }
        // Every step of the CPU's formula rounded as the CPU rounds it (div_rn: a GPU's `/` need
        // not), so the two forms, and the CPU, agree as far as sqrt and exp let them.
        float n = float(hd);
        precise float qm = div_rn(rq[0], n) + p.eps_n;
        precise float km = div_rn(rk[0], n) + p.eps_n;
        float qs = div_rn(div_rn(1.0, sqrt(qm)), p.sqrt_n);
        float ks = div_rn(div_rn(1.0, sqrt(km)), p.sqrt_n);
        barrier();
        for (uint i = tid; i < hd; i += WG) {
            precise float a = qn[i] * qs;
            precise float b = kn[i] * ks;
            qn[i] = a;
            kn[i] = b;
        }
        barrier();
        precise float e1 = 1.0 + exp(-p.beta.v[(first + t) * nv + h]);
        float beta = div_rn(1.0, e1);
        precise float x = p.alpha.v[(first + t) * nv + h] + p.dt_bias.v[h];
        precise float e2 = 1.0 + exp(x);
        float sp = x > 20.0 ? x : log(e2);
        precise float g = sp * p.a.v[h];
        float decay = exp(g);
        uint l = tid & 7u, rs = tid >> 3;
        for (uint j0 = 0u; j0 < hd; j0 += 8u) {
            uint j = j0 + rs;
            bool live = j < hd;
            uint src = (t == 0u ? sin_ : sout) + hbase + j * hd;
            uint dst = sout + hbase + j * hd;
            precise float acc = 0.0;
            if (live) {
                for (uint i = l; i < n8; i += 8u) {
                    precise float xs = p.state.v[src + i] * decay;
                    p.state.v[dst + i] = xs;
                    precise float pk = xs * kn[i];
                    acc = acc + pk;
                }
                if (l == 0u) {
                    precise float tail = 0.0;
                    for (uint i = n8; i < hd; i++) {
                        precise float xs = p.state.v[src + i] * decay;
                        p.state.v[dst + i] = xs;
                        precise float pk = xs * kn[i];
                        tail = tail + pk;
                    }
                    tl[rs] = tail;
                }
                la[rs][l] = acc;
            }
            barrier();
            float d = 0.0;
            if (live) {
                float a8[8];
                [[unroll]] for (uint m = 0u; m < 8u; m++) a8[m] = la[rs][m];
                precise float skj = lanes(a8) + tl[rs];
                precise float dv = p.qkv.v[row + 2u * kd + h * hd + j] - skj;
                precise float dd = dv * beta;
                d = dd;
            }
            barrier();
            acc = 0.0;
            if (live) {
                for (uint i = l; i < n8; i += 8u) {
                    precise float dk = d * kn[i];
                    precise float xs = p.state.v[dst + i] + dk;
                    p.state.v[dst + i] = xs;
                    precise float pq = xs * qn[i];
                    acc = acc + pq;
                }
                if (l == 0u) {
                    precise float tail = 0.0;
                    for (uint i = n8; i < hd; i++) {
                        precise float dk = d * kn[i];
                        precise float xs = p.state.v[dst + i] + dk;
                        p.state.v[dst + i] = xs;
                        precise float pq = xs * qn[i];
                        tail = tail + pq;
                    }
                    tl[rs] = tail;
                }
                la[rs][l] = acc;
            }
            barrier();
            if (live && l == 0u) {
                float a8[8];
                [[unroll]] for (uint m = 0u; m < 8u; m++) a8[m] = la[rs][m];
                precise float o = (lanes(a8) + tl[rs]) * p.scale;
                p.out_.v[(first + t) * nv * hd + h * hd + j] = o;
            }
            barrier();
        }
        barrier();
    }
}

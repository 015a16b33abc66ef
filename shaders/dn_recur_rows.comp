#version 450
#extension GL_GOOGLE_include_directive : require
// A gated DeltaNet layer's recurrence (cpu/deltanet.rs `delta_net` after the convolution), one
// workgroup per value head h and session, over the session's rows in order: the head's Q and K
// (key head kh: h / (n_v / n_k), or h % n_k where tiled) to unit length as the CPU makes them
// (x / sqrt(sum x^2 / n + eps / n) / sqrt(n); the sum in a fixed tree of f32 where the CPU sums in
// f64), beta = sigmoid(beta), decay = e^(softplus(alpha + dt_bias[h]) * a[h]); then the delta rule
// on the head's state S (row j holds S[.][j], hd rows of hd): row = S_in row * decay, d = (v[j] -
// row . k) * beta, row += d * k, o[j] = (row . q) * scale. Each thread owns state rows
// tid, tid + 64, ..., and adds its dots as the CPU does: eight lanes over steps of eight, the lanes
// paired ((0+4)+(1+5))+((2+6)+(3+7)), then the tail; products and sums `precise` (no fma).
// This is the form for CPU-type devices (no barriers inside a token); dn_recur.comp, for GPUs,
// gives each lane its own thread, in the same order.
// The first row reads the state at ssm_in, every row writes ssm_out (the same buffer or not).
// qkv: rows of 2 * key_dim + value_dim (Q heads, K heads, V heads), as dn_conv.comp left them;
// beta, alpha: rows of n_v; out_: rows of value_dim; meta as dn_conv.comp's.
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
        for (uint j = tid; j < hd; j += WG) {
            uint src = (t == 0u ? sin_ : sout) + hbase + j * hd;
            uint dst = sout + hbase + j * hd;
            float acc[8];
            [[unroll]] for (uint l = 0u; l < 8u; l++) acc[l] = 0.0;
            precise float tail = 0.0;
            for (uint i = 0u; i < n8; i += 8u) {
                [[unroll]] for (uint l = 0u; l < 8u; l++) {
                    precise float xs = p.state.v[src + i + l] * decay;
                    p.state.v[dst + i + l] = xs;
                    precise float pk = xs * kn[i + l];
                    precise float ac = acc[l] + pk;
                    acc[l] = ac;
                }
            }
            for (uint i = n8; i < hd; i++) {
                precise float xs = p.state.v[src + i] * decay;
                p.state.v[dst + i] = xs;
                precise float pk = xs * kn[i];
                tail = tail + pk;
            }
            precise float skj = lanes(acc) + tail;
            precise float dv = p.qkv.v[row + 2u * kd + h * hd + j] - skj;
            precise float d = dv * beta;
            [[unroll]] for (uint l = 0u; l < 8u; l++) acc[l] = 0.0;
            tail = 0.0;
            for (uint i = 0u; i < n8; i += 8u) {
                [[unroll]] for (uint l = 0u; l < 8u; l++) {
                    precise float dk = d * kn[i + l];
                    precise float xs = p.state.v[dst + i + l] + dk;
                    p.state.v[dst + i + l] = xs;
                    precise float pq = xs * qn[i + l];
                    precise float ac = acc[l] + pq;
                    acc[l] = ac;
                }
            }
            for (uint i = n8; i < hd; i++) {
                precise float dk = d * kn[i];
                precise float xs = p.state.v[dst + i] + dk;
                p.state.v[dst + i] = xs;
                precise float pq = xs * qn[i];
                tail = tail + pq;
            }
            precise float o = (lanes(acc) + tail) * p.scale;
            p.out_.v[(first + t) * nv * hd + h * hd + j] = o;
        }
        barrier();
    }
}

#version 450
#extension GL_GOOGLE_include_directive : require
// Each row's experts' outputs summed with their weights: out[t][c] = sum over t's chosen experts
// in ascending expert order of (w * scale[e]) * y[slot][c], from 0, one product and one add at a
// time (`precise`: no fma). That is model/forward.rs `moe`'s order (experts 0..n_expert, each
// adding into the rows that chose it with `add_scaled`), so given the same expert outputs the
// sums are the CPU's bits. One invocation per output value.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s y;
    U32s ids;
    F32s out_;
    F32s scale;
    uint width;
    uint n_used;
    uint count;
    uint has_scale;
} p;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (i >= p.count) {
        return;
    }
    uint t = i / p.width, c = i % p.width;
    uint s0 = t * p.n_used;
    precise float o = 0.0;
    uint last = 0u;
    for (uint k = 0u; k < p.n_used; k++) {
        // The next expert up (a row's experts are distinct).
        uint best = 0xFFFFFFFFu, bj = 0u;
        for (uint j = 0u; j < p.n_used; j++) {
            uint e = p.ids.v[2u * (s0 + j)];
            if ((k == 0u || e > last) && e < best) {
                best = e;
                bj = j;
            }
        }
        last = best;
        precise float a = uintBitsToFloat(p.ids.v[2u * (s0 + bj) + 1u]);
        if (p.has_scale != 0u) a = a * p.scale.v[best];
        precise float prod = a * p.y.v[(s0 + bj) * p.width + c];
        o = o + prod;
    }
    p.out_.v[i] = o;
}

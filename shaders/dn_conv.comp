#version 450
#extension GL_GOOGLE_include_directive : require
// A gated DeltaNet layer's short causal convolution (cpu/deltanet.rs `conv`), in place over the
// Q/K/V projection rows: channel c of a session's row t becomes silu(sum over taps j of
// input[t + j - (K - 1)][c] * w[j][c]), added tap by tap from the oldest and from zero, one
// product and one add at a time (`precise`, as the CPU rounds them), where the inputs before the
// pass's first row are the session's conv state (its last K - 1 inputs, oldest first, rows of
// cd). The state's update (the last K - 1 inputs of state and rows together) goes to conv_out.
// One invocation per channel and session walks the session's rows in order, keeping the inputs
// it still needs, so overwriting a row with its output never hides an input; a session's rows are
// computed the same whatever else the pass holds.
// meta: per session 6 words (first row, rows, conv_in, conv_out, ssm_in, ssm_out; the last four
// word offsets into `state`). Workgroups: x = channels / 64, y = session.
#include "common.glsl"

#define MAX_K 8u
layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s qkv;
    F32s conv_w;
    U32s meta;
    F32s state;
    uint cd;
    uint kernel;
} p;

void main() {
    uint c = gl_GlobalInvocationID.x;
    if (c >= p.cd) {
        return;
    }
    uint m = gl_WorkGroupID.y * 6u;
    uint first = p.meta.v[m], cnt = p.meta.v[m + 1u], cin = p.meta.v[m + 2u], cout = p.meta.v[m + 3u];
    uint hist = p.kernel - 1u;
    float win[MAX_K], w[MAX_K];
    [[unroll]] for (uint j = 0u; j < MAX_K; j++) {
        win[j] = j < hist ? p.state.v[cin + j * p.cd + c] : 0.0;
        w[j] = j <= hist ? p.conv_w.v[j * p.cd + c] : 0.0;
    }
    for (uint t = 0u; t < cnt; t++) {
        uint at = (first + t) * p.cd + c;
        float xin = p.qkv.v[at];
        precise float o = 0.0;
        [[unroll]] for (uint j = 0u; j < MAX_K; j++) {
            if (j < hist) {
                precise float pr = win[j] * w[j];
                o = o + pr;
            } else if (j == hist) {
                precise float pr = xin * w[j];
                o = o + pr;
            }
        }
        [[unroll]] for (uint j = 0u; j + 1u < MAX_K; j++) {
            if (j + 1u < hist) win[j] = win[j + 1u];
        }
        [[unroll]] for (uint j = 0u; j < MAX_K; j++) {
            if (j + 1u == hist) win[j] = xin;
        }
        precise float e = 1.0 + exp(-o);
        p.qkv.v[at] = div_rn(o, e);
    }
    [[unroll]] for (uint j = 0u; j < MAX_K; j++) {
        if (j < hist) p.state.v[cout + j * p.cd + c] = win[j];
    }
}

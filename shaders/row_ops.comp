#version 450
#extension GL_GOOGLE_include_directive : require
// The scaling ops of the one pass, one kernel with an op code (rows of `width`):
//   0 scale rows:  x[i] *= s[i / width]             (a query's temperature by position)
//   1 add scaled:  x[i] += s[i / width] * y[i]      (a shared expert under its gate)
//   2 scale:       x[i] *= a
//   3 scale cols:  x[i] = x[i] * a * y[i % width]   (gemma4's router input)
//   4 sigmoid:     x[i] = 1 / (1 + exp(-x[i]))
//   5 mul:         x[i] *= y[i]
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant) uniform P {
    F32s x;
    F32s y;
    F32s s;
    uint count;
    uint width;
    uint op;
    float a;
} p;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * 65535u * 64u;
    if (i >= p.count) {
        return;
    }
    float v = p.x.v[i];
    if (p.op == 0u) {
        v *= p.s.v[i / p.width];
    } else if (p.op == 1u) {
        v += p.s.v[i / p.width] * p.y.v[i];
    } else if (p.op == 2u) {
        v *= p.a;
    } else if (p.op == 3u) {
        v = v * p.a * p.y.v[i % p.width];
    } else if (p.op == 4u) {
        v = 1.0 / (1.0 + exp(-v));
    } else {
        v *= p.y.v[i];
    }
    p.x.v[i] = v;
}

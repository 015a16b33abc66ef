// Shared by every kernel: buffers are reached through device addresses passed as push constants
// (VK_KHR_buffer_device_address, core in Vulkan 1.2), so no kernel needs a descriptor set and a
// recorded step changes nothing but the contents of its metadata buffer.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_control_flow_attributes : require

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32s { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32s { uint v[]; };

// Byte i of the little-endian words starting at word `base`.
uint byte_at(U32s w, uint base, uint i) {
    return (w.v[base + (i >> 2)] >> ((i & 3u) * 8u)) & 0xFFu;
}

// v rounded to the nearest f16 (ties to even, past 65504 to infinity), as half::f16::from_f32
// and F16C round. In integer arithmetic rather than unpackHalf2x16(packHalf2x16(v)): NVIDIA's
// compiler folds that pair into nothing, which leaves v unrounded.
float round_f16(float v) {
    uint b = floatBitsToUint(v);
    uint s = b & 0x80000000u;
    uint a = b & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) {
        return v;
    }
    if (a >= 0x477FF000u) {
        return uintBitsToFloat(s | 0x7F800000u);
    }
    if (a < 0x38800000u) {
        // Below 2^-14: f16's subnormals, steps of 2^-24 (exact scalings by powers of two).
        return uintBitsToFloat(s | floatBitsToUint(roundEven(uintBitsToFloat(a) * 16777216.0) * 5.9604645e-8));
    }
    return uintBitsToFloat(s | ((a + 0x0FFFu + ((a >> 13) & 1u)) & 0xFFFFE000u));
}

// a / b rounded as IEEE division rounds, as the CPU divides: GLSL's `/` may be off by an ulp or
// two (NVIDIA's is). The reciprocal takes one Newton step, then the quotient one correction
// (Markstein's), each with a fused remainder; correct away from overflow and underflow.
float div_rn(float a, float b) {
    precise float y0 = 1.0 / b;
    precise float e = fma(-b, y0, 1.0);
    precise float y = fma(e, y0, y0);
    precise float q = a * y;
    precise float r = fma(-q, b, a);
    precise float res = fma(r, y, q);
    return res;
}

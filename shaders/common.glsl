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

float round_f16(float v) {
    return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x;
}

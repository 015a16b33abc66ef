// Dequantize one unit of 16 consecutive values of a weight row, for the block format this kernel
// variant is compiled for (-DFMT_...). Rows are repacked at upload (vulkan/weights.rs) so every
// block starts on a word: the quants first, the f16 scale (and min) after them, padded to a word.
//
// BW: words per block; UPB: units (16 values) per block.

#if defined(FMT_F32)
#define BW 16u
#define UPB 1u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + u * BW;
    [[unroll]] for (uint i = 0u; i < 16u; i++) o[i] = uintBitsToFloat(w.v[b + i]);
}
#elif defined(FMT_F16)
#define BW 8u
#define UPB 1u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + u * BW;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        vec2 h = unpackHalf2x16(w.v[b + i]);
        o[2u * i] = h.x;
        o[2u * i + 1u] = h.y;
    }
}
#elif defined(FMT_BF16)
#define BW 8u
#define UPB 1u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + u * BW;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        uint x = w.v[b + i];
        o[2u * i] = uintBitsToFloat(x << 16);
        o[2u * i + 1u] = uintBitsToFloat(x & 0xFFFF0000u);
    }
}
#elif defined(FMT_Q4_0) || defined(FMT_Q4_1)
// [qs: 16 bytes][d: f16][m: f16 (Q4_1) or padding]
#define BW 5u
#define UPB 2u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 1) * BW;
    uint sh = (u & 1u) * 4u;
    vec2 dm = unpackHalf2x16(w.v[b + 4u]);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w.v[b + i] >> sh;
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            float n = float((q >> (8u * k)) & 0xFu);
#if defined(FMT_Q4_0)
            o[4u * i + k] = (n - 8.0) * dm.x;
#else
            o[4u * i + k] = n * dm.x + dm.y;
#endif
        }
    }
}
#elif defined(FMT_Q5_0) || defined(FMT_Q5_1)
// [qs: 16 bytes][qh: 4 bytes][d: f16][m: f16 (Q5_1) or padding]
#define BW 6u
#define UPB 2u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 1) * BW;
    uint h = u & 1u;
    uint qh = w.v[b + 4u] >> (16u * h);
    vec2 dm = unpackHalf2x16(w.v[b + 5u]);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w.v[b + i] >> (4u * h);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint j = 4u * i + k;
            float n = float(((q >> (8u * k)) & 0xFu) | (((qh >> j) & 1u) << 4));
#if defined(FMT_Q5_0)
            o[j] = (n - 16.0) * dm.x;
#else
            o[j] = n * dm.x + dm.y;
#endif
        }
    }
}
#elif defined(FMT_Q8_0)
// [qs: 32 bytes][d: f16][padding]
#define BW 9u
#define UPB 2u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 1) * BW;
    float d = unpackHalf2x16(w.v[b + 8u]).x;
    uint q0 = (u & 1u) * 4u;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        int q = int(w.v[b + q0 + i]);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            o[4u * i + k] = float(bitfieldExtract(q, int(8u * k), 8)) * d;
        }
    }
}
#elif defined(FMT_Q4_K) || defined(FMT_Q5_K)
// As stored: [d, dmin: f16][scales: 12 bytes]([qh: 32 bytes] for Q5_K)[qs: 128 bytes]
#if defined(FMT_Q4_K)
#define BW 36u
#define QS 16u
#else
#define BW 44u
#define QS 48u
#endif
#define UPB 16u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 4) * BW;
    uint v = u & 15u;
    uint sb = v >> 1, half_ = v & 1u, j = sb >> 1, hi = sb & 1u;
    vec2 dm = unpackHalf2x16(w.v[b]);
    // get_scale_min_k4: six-bit scale and min of sub-block sb.
    uint sc, mn;
    if (sb < 4u) {
        sc = byte_at(w, b, 4u + sb) & 63u;
        mn = byte_at(w, b, 8u + sb) & 63u;
    } else {
        sc = (byte_at(w, b, 8u + sb) & 0xFu) | ((byte_at(w, b, sb) >> 6) << 4);
        mn = (byte_at(w, b, 8u + sb) >> 4) | ((byte_at(w, b, 4u + sb) >> 6) << 4);
    }
    float d = dm.x * float(sc), m = dm.y * float(mn);
    uint l0 = 16u * half_;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w.v[b + (QS + 32u * j + l0) / 4u + i] >> (4u * hi);
#if defined(FMT_Q5_K)
        uint qh = w.v[b + (16u + l0) / 4u + i] >> (2u * j + hi);
#endif
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint n = (q >> (8u * k)) & 0xFu;
#if defined(FMT_Q5_K)
            n |= ((qh >> (8u * k)) & 1u) << 4;
#endif
            o[4u * i + k] = d * float(n) - m;
        }
    }
}
#elif defined(FMT_Q6_K)
// [ql: 128 bytes][qh: 64 bytes][scales: 16 x int8][d: f16][padding]
#define BW 53u
#define UPB 16u
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 4) * BW;
    uint v = u & 15u;
    uint n = v >> 3, q = (v & 7u) >> 1, l0 = 16u * (v & 1u);
    float d = unpackHalf2x16(w.v[b + 52u]).x;
    int sc = bitfieldExtract(int(byte_at(w, b, 192u + 8u * n + (l0 >> 4) + 2u * q)), 0, 8);
    float ds = d * float(sc);
    uint qlb = 64u * n + l0 + (q & 1u) * 32u, qhb = 128u + 32u * n + l0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint ql = w.v[b + qlb / 4u + i] >> (4u * (q >> 1));
        uint qh = w.v[b + qhb / 4u + i] >> (2u * q);
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            int x = int(((ql >> (8u * k)) & 0xFu) | (((qh >> (8u * k)) & 3u) << 4)) - 32;
            o[4u * i + k] = ds * float(x);
        }
    }
}
#elif defined(FMT_MXFP4) || defined(FMT_IQ4_NL)
// [qs: 16 bytes][e: u8 (MXFP4) or d: f16 (IQ4_NL)][padding]; value j of a block is the low
// nibble of qs[j], value 16 + j its high nibble (Q4_0's order), read through the format's levels.
#define BW 5u
#define UPB 2u
#if defined(FMT_MXFP4)
// ggml's kvalues_mxfp4: twice the E2M1 values, with the scale halved to match (quant/mxfp4.rs).
const float LEVELS[16] = float[16](0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);
#else
// ggml's kvalues_iq4nl.
const float LEVELS[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
#endif
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 1) * BW;
    uint sh = (u & 1u) * 4u;
#if defined(FMT_MXFP4)
    // e8m0_half: 2^(e - 128) from its bits, the two smallest codes subnormal, as the CPU's.
    uint e = w.v[b + 4u] & 0xFFu;
    float d = uintBitsToFloat(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
#else
    float d = unpackHalf2x16(w.v[b + 4u]).x;
#endif
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w.v[b + i] >> sh;
        [[unroll]] for (uint k = 0u; k < 4u; k++) o[4u * i + k] = LEVELS[(q >> (8u * k)) & 0xFu] * d;
    }
}
#elif defined(FMT_IQ4_XS)
// As stored (34 words): [d: f16][scales_h: u16][scales_l: 4 bytes][qs: 128 bytes]; eight
// sub-blocks of 32 values laid out as IQ4_NL's quants, each scaled by d * (ls - 32) with the
// six-bit ls from scales_l (low four bits) and scales_h (high two).
#define BW 34u
#define UPB 16u
const float LEVELS[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
void dequant16(U32s w, uint row, uint u, out float o[16]) {
    uint b = row + (u >> 4) * BW;
    uint v = u & 15u;
    uint ib = v >> 1, sh = (v & 1u) * 4u;
    uint w0 = w.v[b];
    float d = unpackHalf2x16(w0).x;
    uint ls = ((byte_at(w, b, 4u + ib / 2u) >> (4u * (ib & 1u))) & 0xFu) | (((w0 >> (16u + 2u * ib)) & 3u) << 4);
    float dl = d * float(int(ls) - 32);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint q = w.v[b + 2u + 4u * ib + i] >> sh;
        [[unroll]] for (uint k = 0u; k < 4u; k++) o[4u * i + k] = dl * LEVELS[(q >> (8u * k)) & 0xFu];
    }
}
#else
#error "compile with one -DFMT_..."
#endif

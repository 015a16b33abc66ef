// Device K/V layouts, per codec. A row (one position, all KV heads) is row_words words:
//   f16:  two values per word.
//   q8_0: per 32 values Q8_WORDS words: the f16 scale in the low half of the first, then 32 i8.
//   tq4:  per 32 values Q4_WORDS words: the f16 scale, then ggml's q4_0 nibbles (byte j holds
//         values j and j + 16), in the rotated basis.
// Blocks are padded to whole words (the host's are 34 and 18 bytes) so every read is aligned.
#define Q8_WORDS 9u
#define Q4_WORDS 5u
#define MAX_HD 256u

#if defined(KV_Q8_0)
#define HEAD_WORDS(hd) ((hd) / 32u * Q8_WORDS)
#elif defined(KV_TQ4)
#define HEAD_WORDS(hd) ((hd) / 32u * Q4_WORDS)
#else
#define HEAD_WORDS(hd) ((hd) / 2u)
#endif

// x -> H x / sqrt(n) for `rows` vectors of n (a power of two) values in shared memory, as
// kv::codec::fwht sums them (the same pairs in the same order, then times `sc`, the host's
// f32 1/sqrt(n), since GLSL's sqrt and division need not round as the CPU's do); 64 threads.
#define FWHT_BODY(buf, rows, n, tid, sc)                                                   \
    for (uint len = 1u; len < n; len *= 2u) {                                          \
        for (uint r = 0u; r < rows; r++) {                                             \
            for (uint pi = tid; pi < n / 2u; pi += 64u) {                              \
                uint i = (pi / len) * 2u * len + pi % len;                             \
                float a = buf[r][i], b = buf[r][i + len];                              \
                buf[r][i] = a + b;                                                     \
                buf[r][i + len] = a - b;                                               \
            }                                                                          \
        }                                                                              \
        barrier();                                                                     \
    }                                                                                  \
    {                                                                                  \
        for (uint r = 0u; r < rows; r++) {                                             \
            for (uint i = tid; i < n; i += 64u) buf[r][i] *= sc;                       \
        }                                                                              \
        barrier();                                                                     \
    }


/* float8 e4m3 (vLLM's fp8 KV cache) read by the engine's C kernels: a code's value as
 * float32, and, where AVX-512 BF16 runs, a tile of codes as bf16 for the bf16 intrinsics.
 * Both exact (every e4m3 value is a float32 and a bf16 value). Included by
 * paged_attention.c after bf16.h. */
#include <stdint.h>

/* e4m3 (bias 7, no infinities, S.1111.111 NaN) as its value: the significand as an integer
 * (8 + m, or m when subnormal) times 2^(max(e, 1) - 10), built from normal floats only, so
 * the loop vectorises without subnormal operands. */
static inline float fp8_e4m3(uint8_t x) {
    const int e = (x >> 3) & 0xF, m = x & 7;
    bits32 pow2;
    pow2.u = (uint32_t)((e ? e : 1) + 117) << 23;
    const float v = (float)(e ? m + 8 : m) * pow2.f;
    return (x & 0x7F) == 0x7F ? __builtin_nanf("") : x & 0x80 ? -v : v;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* An fp8 tile's first n (a multiple of 32) values as bf16, the rest 0. Exact: an e4m3 value
 * is a bf16 value. A normal code's bf16 bits are its exponent and mantissa moved up 4 bits
 * and rebiased (+120 << 7); the 8 subnormal magnitudes (m x 2^-9) and the NaN code come
 * from a table, 32 codes per step. */
static inline void fp8_tile_bf16(const uint8_t *src, int n, uint16_t *dst, int size) {
    static const uint16_t subnormal[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40,
                                           0x3C60};
    const __m512i table = _mm512_loadu_si512(subnormal);
    for (int i = 0; i < n; i += 32) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i)));
        const __m512i em = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
        __m512i v = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
        v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)),
                                          em, table);
        v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(em, _mm512_set1_epi16(0x7F)),
                                  _mm512_set1_epi16(0x7FC0));
        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)),
                                                 8));
        _mm512_storeu_si512(dst + i, v);
    }
    for (int i = n; i < size; i++) dst[i] = 0;
}
#endif

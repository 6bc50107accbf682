/* The AVX512_BF16 path of gguf.c's bf16 tile (gguf_dequantize_bf16): a block's 32 values
 * 16 lanes at a time, rounded to bf16 by the conversion instruction. Included by gguf.c only
 * in the build that targets AVX512_BF16 (setup.py's avx512bf16 variant). */
#include <immintrin.h>

/* 16 float32 values as bfloat16, rounded to nearest even (AVX512_BF16). */
static inline void store_bf16(uint16_t *out, __m512 v) {
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
}

/* gguf_dequantize_bf16's contract (gguf.c): each block's 32 values computed as the portable
 * path computes them (a product, then a sum: no fused multiply-add), 16 lanes at a time. */
static void avx512_dequantize_bf16(int type, const uint8_t *w, int64_t stride, int64_t count,
                                 int64_t nb, uint16_t *out) {
    const int64_t bytes = block_bytes(type);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < nb; b++, out += QK) {
            const uint8_t *blk = w + i * stride + b * bytes;
            const __m512 d = _mm512_set1_ps(half(blk));
            __m512i lo, hi;
            if (type == GGUF_Q8_0) {
                lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
                hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)));
            } else {
                const __m128i c = _mm_loadu_si128((const __m128i *)(blk + (type == GGUF_Q4_1 ? 4 : 2)));
                lo = _mm512_cvtepu8_epi32(_mm_and_si128(c, m15));
                hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), m15));
                if (type == GGUF_Q4_0) {
                    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                    hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
                }
            }
            __m512 flo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
            __m512 fhi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
            if (type == GGUF_Q4_1) {
                const __m512 m = _mm512_set1_ps(half(blk + 2));
                flo = _mm512_add_ps(flo, m);
                fhi = _mm512_add_ps(fhi, m);
            }
            store_bf16(out, flo);
            store_bf16(out + 16, fhi);
        }
}

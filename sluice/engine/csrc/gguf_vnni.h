/* The AVX-512 VNNI path of gguf.c: two weight blocks (64 codes) per 512-bit step. A 4-bit
 * pair's codes are unpacked once, [low nibbles | high nibbles] per block, to line up with
 * the two activation blocks' 64 bytes, and every activation row of the call (VNNI_ROWS at a
 * time) takes them in one unsigned x signed byte dot-product instruction (vpdpbusd), whose
 * 16 int32 lanes are 8 per block: converted to float and scaled by each block's d_w d_a in
 * one multiply-add. Q8_0's signed codes go in as their magnitudes, their signs moved onto
 * the activations. The blocks' other term (Q4_1: m_w s_a; Q4_0: -8 d_w s_a) is one short dot
 * product per row over the blocks. An odd last block takes the portable step.
 * Included by gguf.c only in the build that targets AVX512_VNNI (setup.py's avx512bf16
 * variant); the other variants run the portable loops. */
#include <immintrin.h>
#include <stdlib.h>

#define VNNI_ROWS 4

/* Two 16-byte nibble groups -> [lo(a) | hi(a) | lo(b) | hi(b)], 64 unsigned codes. */
static inline __m512i unpack_q4_pair(const uint8_t *a, const uint8_t *b) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
        _mm_loadu_si128((const __m128i *)b), 1);
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    /* [lo(a) | lo(b) | hi(a) | hi(b)] -> lanes 0, 2, 1, 3 */
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i32x4(x, x, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __m512 pair_of(float s0, float s1) {
    return _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
}

/* gguf_dot's contract (gguf.c), for types with a kernel. */
static void vnni_dot(int type, const uint8_t *w, int64_t w_stride, int64_t outs, int64_t nb,
                     const int8_t *q, const float *d, const float *s, int64_t rows, float *y,
                     int64_t y_stride) {
    const int64_t bytes = type == GGUF_Q4_0 ? 18 : type == GGUF_Q4_1 ? 20 : 34;
    const int64_t pairs = nb / 2;
    /* each activation row's block scales as 512-bit pairs, [d(2p) x 8 | d(2p + 1) x 8] */
    __m512 *da = aligned_alloc(64, (size_t)(rows * (pairs ? pairs : 1)) * sizeof(__m512));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < pairs; p++)
            da[r * pairs + p] = pair_of(d[r * nb + 2 * p], d[r * nb + 2 * p + 1]);
    float dw[nb], other[nb]; /* a weight row's scales; its blocks' other coefficient */
    for (int64_t o = 0; o < outs; o++) {
        const uint8_t *wr = w + o * w_stride;
        for (int64_t b = 0; b < nb; b++) {
            dw[b] = half(wr + b * bytes);
            other[b] = type == GGUF_Q4_1 ? half(wr + b * bytes + 2)
                     : type == GGUF_Q4_0 ? -8.f * dw[b] : 0.f;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += VNNI_ROWS) {
            const int64_t n = rows - r0 < VNNI_ROWS ? rows - r0 : VNNI_ROWS;
            __m512 acc[VNNI_ROWS];
            for (int64_t i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t p = 0; p < pairs; p++) {
                const uint8_t *w0 = wr + 2 * p * bytes, *w1 = w0 + bytes;
                __m512i codes;
                __mmask64 negative = 0;
                if (type == GGUF_Q8_0) {
                    const __m512i c = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w0 + 2))),
                        _mm256_loadu_si256((const __m256i *)(w1 + 2)), 1);
                    negative = _mm512_movepi8_mask(c);
                    codes = _mm512_abs_epi8(c);
                } else {
                    const int off = type == GGUF_Q4_1 ? 4 : 2;
                    codes = unpack_q4_pair(w0 + off, w1 + off);
                }
                const __m512 wscale = pair_of(dw[2 * p], dw[2 * p + 1]);
                for (int64_t i = 0; i < n; i++) {
                    const int64_t r = r0 + i;
                    __m512i a = _mm512_loadu_si512((const void *)(q + (r * nb + 2 * p) * QK));
                    if (type == GGUF_Q8_0)
                        a = _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a);
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, a);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_mul_ps(wscale, da[r * pairs + p]), acc[i]);
                }
            }
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = r0 + i;
                float total = _mm512_reduce_add_ps(acc[i]);
                if (type != GGUF_Q8_0)
                    for (int64_t b = 0; b < 2 * pairs; b++) total += other[b] * s[r * nb + b];
                if (nb % 2) { /* the odd last block */
                    const int64_t b = nb - 1;
                    const uint8_t *wb = wr + b * bytes;
                    const int8_t *qr = q + (r * nb + b) * QK;
                    const float dr = d[r * nb + b], sr = s[r * nb + b];
                    total += type == GGUF_Q4_0 ? row_q4_0(wb, 1, qr, &dr, &sr)
                           : type == GGUF_Q4_1 ? row_q4_1(wb, 1, qr, &dr, &sr)
                                               : row_q8_0(wb, 1, qr, &dr, &sr);
                }
                y[r * y_stride + o] = total;
            }
        }
    }
    free(da);
}

/* 16 float32 values as bfloat16, rounded to nearest even (AVX512_BF16). */
static inline void store_bf16(uint16_t *out, __m512 v) {
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
}

/* gguf_dequantize_bf16's contract (gguf.c): each block's 32 values computed as the portable
 * path computes them (a product, then a sum: no fused multiply-add), 16 lanes at a time. */
static void vnni_dequantize_bf16(int type, const uint8_t *w, int64_t stride, int64_t count,
                                 int64_t nb, uint16_t *out) {
    const int64_t bytes = type == GGUF_Q4_0 ? 18 : type == GGUF_Q4_1 ? 20 : 34;
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

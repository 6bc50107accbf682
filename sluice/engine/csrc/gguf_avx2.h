/* The AVX2 path of gguf.c (llama.cpp's for x86-64-v3): one weight block (32 codes) per
 * 256-bit step. A 4-bit block's codes are unpacked once, [low nibbles | high nibbles], to
 * line up with the activation block's 32 bytes; unsigned x signed byte products summed in
 * pairs (vpmaddubsw, at most 2 x 255 x 127: no 16-bit saturation) and then in quads
 * (vpmaddwd) give 8 int32 lanes, converted to float and scaled by d_w d_a in one
 * multiply-add. Q8_0's signed codes go in as their magnitudes, their signs moved onto the
 * activations (vpsignb). The blocks' other term is gguf_avx2_dot's short dot per row.
 * Included by gguf.c in the builds with AVX2 and FMA (every x86-64 variant but portable). */
#include <immintrin.h>

static inline __m256i unpack_q4(const uint8_t *codes) {
    const __m128i c = _mm_loadu_si128((const __m128i *)codes), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), m), _mm_and_si128(c, m));
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* gguf_dot's contract (gguf.c), for types with a kernel. */
static void avx2_dot(int type, const uint8_t *w, int64_t w_stride, int64_t outs, int64_t nb,
                     const int8_t *q, const float *d, const float *s, int64_t rows, float *y,
                     int64_t y_stride) {
    const int64_t bytes = block_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t o = 0; o < outs; o++) {
        const uint8_t *wr = w + o * w_stride;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *qr = q + r * nb * QK;
            const float *dr = d + r * nb, *sr = s + r * nb;
            __m256 acc = _mm256_setzero_ps();
            float other = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = wr + b * bytes;
                const float dw = half(blk);
                __m256i a = _mm256_loadu_si256((const __m256i *)(qr + b * QK)), codes;
                if (type == GGUF_Q8_0) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 2));
                    codes = _mm256_sign_epi8(c, c);
                    a = _mm256_sign_epi8(a, c);
                } else {
                    codes = unpack_q4(blk + (type == GGUF_Q4_1 ? 4 : 2));
                    other += (type == GGUF_Q4_1 ? half(blk + 2) : -8.f * dw) * sr[b];
                }
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, a), ones);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dr[b]), acc);
            }
            y[r * y_stride + o] = hsum8(acc) + other;
        }
    }
}

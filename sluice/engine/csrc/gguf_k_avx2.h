/* The AVX2 path of gguf_k.c: one activation block (32 codes) per 256-bit step, as
 * gguf_avx2.h does for the 32-value types. A 32-byte load of a superblock's codes holds two
 * activation blocks' nibbles (Q4_K, Q5_K: low, high; Q6_K: the same, with 2 high bits from
 * qh); unsigned x signed byte products summed in pairs (vpmaddubsw: codes of at most 63,
 * at most 2 x 63 x 127, no 16-bit saturation) and then in quads (vpmaddwd) give 8 int32
 * lanes, converted to float and scaled by one multiply-add per block. Q6_K's 32 is taken
 * off as 32 x the activations' pair sums (a second vpmaddubsw), and vpmaddwd applies its
 * two sub-blocks' int8 scales (lanes 0-7: the first 16 values). Q4_K's and Q5_K's mins
 * meet the activation sums 8 lanes at a time.
 * Measured (one row of 4096 x 1024, one thread): two accumulators split the chain of
 * multiply-adds (Q4_K 0.186 -> 0.155 ms); the scales stay in registers (k4_scales' words),
 * where bytes stored and reloaded as a vector stalled store forwarding (0.155 -> 0.101);
 * Q5_K's fifth bits are shifted into place, not compared (0.147 -> 0.126); Q6_K's scale
 * pairs are one vpshufb and its 32 a second vpmaddubsw, not moved signs (0.178 -> 0.138).
 * Included by gguf_k.c in the builds with AVX2 and FMA (every x86-64 variant but
 * portable). */
#include <immintrin.h>

static inline float k_hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* A word's 8 bytes as 8 float lanes. */
static inline __m256 k_bytes_ps(uint64_t word) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)word)));
}

/* Each byte's bit `bit` moved to bit 4 (the other bits: any). */
static inline __m256i bit_to_4(__m256i v, int bit) {
    return bit < 4 ? _mm256_slli_epi16(v, 4 - bit) : _mm256_srli_epi16(v, bit - 4);
}

/* acc + scale x the 8 int32 quad sums of codes (unsigned) x a (signed), 32 bytes each. */
static inline __m256 k_block(__m256i codes, const int8_t *a, __m256i pairs, float scale,
                             __m256 acc) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, av), pairs);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc);
}

/* A row of nb superblocks of Q4_K (q5 0) or Q5_K (q5 1) against one activation row (q:
 * nb x 256 codes; d, s: nb x 8), as gguf_k.c's portable row_k4; inlined per type. */
static inline __attribute__((always_inline)) float k4_row(int q5, const uint8_t *w,
                                                          int64_t nb, const int8_t *q,
                                                          const float *d, const float *s) {
    const int64_t bytes = q5 ? 176 : 144;
    const __m256i m15 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes, q += QK_K, d += 8, s += 8) {
        uint64_t sc, m;
        k4_scales(w + 4, &sc, &m);
        mins = _mm256_fmadd_ps(_mm256_mul_ps(k_bytes_ps(m), _mm256_set1_ps(half(w + 2))),
                               _mm256_loadu_ps(s), mins);
        float scale[8];
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_mul_ps(k_bytes_ps(sc),
                                                            _mm256_set1_ps(half(w))),
                                              _mm256_loadu_ps(d)));
        const uint8_t *qs = w + (q5 ? 48 : 16);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16))
                              : _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* activation blocks 2p (low nibbles), 2p + 1 (high) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(v, m15);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
            if (q5) { /* bit 2p (2p + 1) of each qh byte: 16 more */
                lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(qh, 2 * p), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(qh, 2 * p + 1), sixteen));
            }
            acc = k_block(lo, q + 64 * p, ones, scale[2 * p], acc);
            acc_hi = k_block(hi, q + 64 * p + 32, ones, scale[2 * p + 1], acc_hi);
        }
    }
    return k_hsum8(_mm256_add_ps(acc, acc_hi)) - k_hsum8(mins);
}

static float row_k4(int type, const uint8_t *w, int64_t nb, const int8_t *q, const float *d,
                    const float *s) {
    return type == GGUF_Q5_K ? k4_row(1, w, nb, q, d, s) : k4_row(0, w, nb, q, d, s);
}

/* The same for Q6_K (gguf_k.c's portable row_q6_k). */
static float row_q6_k(const uint8_t *w, int64_t nb, const int8_t *q, const float *d) {
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    const __m256i m32 = _mm256_set1_epi8(32);
    const __m128i first8 = _mm_set_epi64x(0x0101010101010101, 0); /* bytes 8-15: 1 */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* two chains of adds */
    for (int64_t b = 0; b < nb; b++, w += 210, q += QK_K, d += 8) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(w + 192));
        float scale[8];
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half(w + 208)),
                                              _mm256_loadu_ps(d)));
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const int j = 4 * h + g;
                const __m256i ql = g % 2 ? ql1 : ql0;
                const __m256i low = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), m15);
                const __m256i high = _mm256_and_si256(bit_to_4(qh, 2 * g), m48); /* 16, 32 */
                const __m256i c = _mm256_or_si256(low, high);
                const __m256i av = _mm256_loadu_si256((const __m256i *)(q + QK * j));
                const __m256i pairs = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                    sc, _mm_add_epi8(first8, _mm_set1_epi8((char)(2 * j)))));
                const __m256i dot = _mm256_madd_epi16(  /* (c - 32) a, in pairs */
                    _mm256_sub_epi16(_mm256_maddubs_epi16(c, av), _mm256_maddubs_epi16(m32, av)),
                    pairs);
                acc[g % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[j]),
                                             acc[g % 2]);
            }
        }
    }
    return k_hsum8(_mm256_add_ps(acc[0], acc[1]));
}

/* The AVX-512 BF16 paths of paged_attention.c for its commonest shape (bf16, head_dim 64,
 * block_size 16). Few query rows (decodes): the key tile is read as stored by the bf16
 * dot-product instruction, and each value row is widened once for all of a GQA group's
 * rows. Many rows (prefill tiles): the key tile is rearranged once into dimension pairs,
 * and each row's 16 scores are 32 dot-product steps on a broadcast pair of its query.
 * Included by paged_attention.c after exp_poly and row_offset, only in the build that targets
 * AVX512_BF16 (setup.py's avx512bf16 variant); the other variants run the portable loops.
 */
#include <immintrin.h>

/* Lane t of the result: the sum of a[t]'s 16 lanes (a 16 x 16 transpose folded into adds). */
static inline __m512 hsum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: pairs of a[2i], a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: that lane's sums of a[4i..4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

/* One bf16 query row (64 dims) against a 16-key tile, by the bf16 dot-product instruction:
 * bf16 products are exact in float32, summed in float32 (denormal inputs read as zero).
 * Keys past the sequence's end get scores too; the caller never reads them. */
static inline void score_row_bf16_64x16(const uint16_t *qrow, const uint16_t *ktile, float scale,
                                        float *srow) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qrow);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qrow + 32);
    __m512 acc[16];
    for (int t = 0; t < 16; t++) {
        const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0,
                                          (__m512bh)_mm512_loadu_si512(ktile + t * 64));
        acc[t] = _mm512_dpbf16_ps(a, q1, (__m512bh)_mm512_loadu_si512(ktile + t * 64 + 32));
    }
    _mm512_storeu_ps(srow, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
}

static inline __m512 widen16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* exp_poly on 16 lanes (NaN stays NaN: max keeps its second operand when either is NaN). */
static inline __m512 exp_poly16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* softmax_update for `rows` (<= 4) rows over one 16-key bf16 tile: each value row is
 * widened once for all rows, whose accumulators stay in registers. The rows are an item's
 * rows first..first + rows - 1, and s, acc, m and l point at row `first`'s; visible0: keys
 * the item's row 0 sees in this block (row r sees visible0 + r / group). */
static inline __attribute__((always_inline)) void softmax_values_bf16_64x16(
        float *restrict s, const uint16_t *restrict vtile, float *restrict acc, float *m,
        float *l, int visible0, int group, int in_block, int first, const int rows) {
    __m512 a[4][4];
    for (int r = 0; r < rows; r++) {
        int visible = visible0 + (first + r) / group;
        visible = visible < 0 ? 0 : visible > in_block ? in_block : visible;
        const __mmask16 seen = (__mmask16)((1u << visible) - 1u);
        const __m512 sr = _mm512_loadu_ps(s + r * 16);
        const float block_max = visible ? _mm512_mask_reduce_max_ps(seen, sr) : m[r];
        const float new_max = block_max > m[r] ? block_max : m[r];
        const float correction = exp_poly(m[r] - new_max);
        const __m512 p = _mm512_maskz_mov_ps(seen, exp_poly16(
            _mm512_sub_ps(sr, _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(s + r * 16, p);
        m[r] = new_max;
        l[r] = l[r] * correction + _mm512_reduce_add_ps(p);
        for (int j = 0; j < 4; j++)
            a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * 64 + j * 16),
                                    _mm512_set1_ps(correction));
    }
    for (int t = 0; t < in_block; t++) {
        const __m512 v0 = widen16(vtile + t * 64), v1 = widen16(vtile + t * 64 + 16),
                     v2 = widen16(vtile + t * 64 + 32), v3 = widen16(vtile + t * 64 + 48);
        for (int r = 0; r < rows; r++) {
            const __m512 pt = _mm512_set1_ps(s[r * 16 + t]);
            a[r][0] = _mm512_fmadd_ps(pt, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pt, v1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(pt, v2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(pt, v3, a[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * 64 + j * 16, a[r][j]);
}

/* Scores of a few-row item's rows (q: [num_tokens, num_heads, 64]) against one key tile. */
static inline void scores_bf16_64x16(const uint16_t *q, const uint16_t *ktile, float *s, int rows,
                                     int q_start, int group, int kv_head, int num_heads,
                                     float scale) {
    for (int r = 0; r < rows; r++)
        score_row_bf16_64x16(q + row_offset(r, q_start, group, kv_head, num_heads, 64), ktile,
                             scale, s + r * 16);
}

/* softmax_values_bf16_64x16 over an item's rows r0..rows-1, four at a time with a constant
 * row count, so the accumulators are registers. */
static inline void values_bf16_64x16(float *s, const uint16_t *vtile, float *acc, float *m,
                                     float *l, int visible0, int group, int in_block, int r0,
                                     int rows) {
    for (int r = r0; r < rows; r += 4) {
        float *sr = s + r * 16, *ar = acc + r * 64, *mr = m + r, *lr = l + r;
        switch (rows - r) {
        case 1: softmax_values_bf16_64x16(sr, vtile, ar, mr, lr, visible0, group, in_block, r, 1);
            break;
        case 2: softmax_values_bf16_64x16(sr, vtile, ar, mr, lr, visible0, group, in_block, r, 2);
            break;
        case 3: softmax_values_bf16_64x16(sr, vtile, ar, mr, lr, visible0, group, in_block, r, 3);
            break;
        default: softmax_values_bf16_64x16(sr, vtile, ar, mr, lr, visible0, group, in_block, r, 4);
        }
    }
}

/* A 16-key bf16 tile [16, 64] as dimension pairs: pairs[j * 16 + t] holds key t's dimensions
 * 2j and 2j + 1 (one 32-bit lane), so row j of pairs is one vector of 16 keys. Keys past
 * in_block are zero. */
static inline void key_pairs_bf16_64x16(const uint16_t *ktile, int in_block, uint32_t *pairs) {
    const uint32_t *k = (const uint32_t *)ktile;
    for (int j = 0; j < 32; j++)
        for (int t = 0; t < 16; t++) pairs[j * 16 + t] = t < in_block ? k[t * 32 + j] : 0u;
}

/* Scores of n (<= 8) query rows against a tile of key pairs: two accumulator chains per row
 * (even and odd pairs), each step one broadcast pair of the row's query times 16 keys. */
static inline __attribute__((always_inline)) void score_pairs_bf16_64x16(
        const uint32_t *const *qrows, const uint32_t *pairs, float *s, float scale, const int n) {
    __m512 even[8], odd[8];
    for (int r = 0; r < n; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (int j = 0; j < 32; j += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(pairs + j * 16);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(pairs + (j + 1) * 16);
        for (int r = 0; r < n; r++) {
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32((int)qrows[r][j]), k0);
            odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32((int)qrows[r][j + 1]),
                                      k1);
        }
    }
    for (int r = 0; r < n; r++)
        _mm512_storeu_ps(s + r * 16, _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]),
                                                   _mm512_set1_ps(scale)));
}

/* Scores of a prefill tile's rows r0..rows-1 (q: [num_tokens, num_heads, 64]) against one key
 * tile, given as pairs (key_pairs_bf16_64x16). */
static inline void tile_scores_bf16_64x16(const uint16_t *q, const uint32_t *pairs, float *s,
                                          int r0, int rows, int q_start, int group, int kv_head,
                                          int num_heads, float scale) {
    for (; r0 < rows; r0 += 8) {
        const uint32_t *qrows[8];
        const int n = rows - r0 < 8 ? rows - r0 : 8;
        for (int i = 0; i < n; i++)
            qrows[i] = (const uint32_t *)(q + row_offset(r0 + i, q_start, group, kv_head,
                                                         num_heads, 64));
        float *sr = s + r0 * 16;
        switch (n) {
        case 8: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 8); break;
        case 7: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 7); break;
        case 6: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 6); break;
        case 5: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 5); break;
        case 4: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 4); break;
        case 3: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 3); break;
        case 2: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 2); break;
        default: score_pairs_bf16_64x16(qrows, pairs, sr, scale, 1);
        }
    }
}

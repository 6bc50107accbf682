/* llama.cpp's K-quants (its ggml-quants.c dequantize_row_q4_K, _q5_K, _q6_K) multiplied as
 * stored, against gguf.c's activation blocks of 32 (quantize_q8: scale d_a and sum s_a per
 * block): a superblock of 256 values spans eight activation blocks, and each block's
 * contribution is an integer dot product scaled once, as gguf.c's types.
 *   Q4_K, Q5_K: eight sub-blocks of 32 with 6-bit scales sc_j and mins m_j (packed in 12
 *     bytes, k4_scales), value d sc_j c - dmin m_j for the code c (4 bits; Q5_K: a fifth
 *     from qh): contribution d sc_j d_a sum(c q) - dmin m_j s_a.
 *   Q6_K: sixteen sub-blocks of 16 with int8 scales, value d sc (c - 32) for the 6-bit code
 *     c: two sub-blocks share an activation block, d d_a (sc_0 sum_lo + sc_1 sum_hi) with
 *     sum = sum((c - 32) q) over each half.
 * Where the codes sit (per activation block j of a superblock, its value l in 0..31):
 *   Q4_K: byte 16 + 32 (j / 2) + l of the block, low nibble for even j, high for odd;
 *   Q5_K: the same nibble at 48 + 32 (j / 2) + l, plus bit j of byte 16 + l as 16;
 *   Q6_K: with h = j / 4, g = j % 4: nibble of byte 64 h + 32 (g % 2) + l (low for g < 2),
 *     plus bits 2g, 2g + 1 of byte 128 + 32 h + l as 16 and 32; scales at 192 + 2j, + 1.
 * gguf_k_dequantize computes each value as the gguf package does (float32: the scale's
 * product first, then the code's, then the min; no fused multiply-add), so the float32
 * tile is exact. With AVX2 an activation block is one 256-bit step (gguf_k_avx2.h's rows);
 * the portable loops run elsewhere. */
#include "gguf.h"

/* llama.cpp's get_scale_min_k4 for the eight sub-blocks, as two words whose byte j is
 * sub-block j's scale (sc) and min (m): for j < 4 the low 6 bits of bytes j and j + 4; above,
 * byte j + 4's low (scale) and high (min) nibble, below the top 2 bits of bytes j - 4 and j.
 * (Words, not bytes: the AVX2 path converts them in registers.) */
static inline uint32_t le32(const uint8_t *p) {
    return p[0] | p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void k4_scales(const uint8_t *p, uint64_t *sc, uint64_t *m) {
    const uint32_t a = le32(p), b = le32(p + 4), c = le32(p + 8);
    *sc = (a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | (a >> 2 & 0x30303030u)) << 32;
    *m = (b & 0x3F3F3F3Fu) | (uint64_t)((c >> 4 & 0x0F0F0F0Fu) | (b >> 2 & 0x30303030u)) << 32;
}

static inline float byte_of(uint64_t word, int j) { return (float)(uint8_t)(word >> 8 * j); }

/* The 32 codes of a superblock's activation block j, unsigned (Q6_K: not yet less 32). */
static inline void k_codes(int type, const uint8_t *blk, int j, uint8_t c[QK]) {
    if (type == GGUF_Q6_K) {
        const int h = j / 4, g = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (g % 2), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < QK; l++)
            c[l] = (uint8_t)(((g < 2 ? ql[l] : ql[l] >> 4) & 15) | ((qh[l] >> 2 * g) & 3) << 4);
        return;
    }
    const uint8_t *qs = blk + (type == GGUF_Q5_K ? 48 : 16) + 32 * (j / 2);
    for (int l = 0; l < QK; l++) c[l] = (j % 2 ? qs[l] >> 4 : qs[l]) & 15;
    if (type == GGUF_Q5_K)
        for (int l = 0; l < QK; l++) c[l] |= (uint8_t)(((blk[16 + l] >> j) & 1) << 4);
}

static inline int32_t dot_u8(const uint8_t *c, const int8_t *a, int n) {
    int32_t sum = 0;
    for (int l = 0; l < n; l++) sum += c[l] * a[l];
    return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
#include "gguf_k_avx2.h" /* row_k4 and row_q6_k, one activation block per 256-bit step */
#else
/* A row of nb superblocks against one activation row (q: nb x 256 codes; d, s: nb x 8). */
static float row_k4(int type, const uint8_t *w, int64_t nb, const int8_t *q, const float *d,
                    const float *s) {
    const int64_t bytes = block_bytes(type);
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += bytes, q += QK_K, d += 8, s += 8) {
        const float dw = half(w), dmin = half(w + 2);
        uint64_t sc, m;
        uint8_t c[QK];
        k4_scales(w + 4, &sc, &m);
        /* unrolled: each block's shifts constant (1536 x 576, one row: Q5_K 0.214 -> 0.167
         * ms; Q6_K below 0.41 -> 0.30) */
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            k_codes(type, w, j, c);
            acc += dw * byte_of(sc, j) * d[j] * (float)dot_u8(c, q + j * QK, QK) -
                   dmin * byte_of(m, j) * s[j];
        }
    }
    return acc;
}

static float row_q6_k(const uint8_t *w, int64_t nb, const int8_t *q, const float *d) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 210, q += QK_K, d += 8) {
        const float dw = half(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        uint8_t c[QK];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            k_codes(GGUF_Q6_K, w, j, c);
            const int8_t *a = q + j * QK;
            int32_t lo = 0, hi = 0; /* its two sub-blocks of 16 */
            for (int l = 0; l < 16; l++) {
                lo += (c[l] - 32) * a[l];
                hi += (c[l + 16] - 32) * a[l + 16];
            }
            acc += dw * d[j] * (float)(sc[2 * j] * lo + sc[2 * j + 1] * hi);
        }
    }
    return acc;
}

#endif

/* gguf_dot's contract (gguf.c) for the K-quants; nb counts superblocks, so an activation
 * row is nb x 256 codes and nb x 8 scales and sums. */
void SLUICE_KERNEL(gguf_k_dot)(int type, const uint8_t *w, int64_t w_stride, int64_t outs,
                               int64_t nb, const int8_t *q, const float *d, const float *s,
                               int64_t rows, float *y, int64_t y_stride) {
    if (!gguf_is_k_quant(type)) return;
    for (int64_t o = 0; o < outs; o++) {
        const uint8_t *wr = w + o * w_stride;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *qr = q + r * nb * QK_K;
            const float *dr = d + r * nb * 8, *sr = s + r * nb * 8;
            y[r * y_stride + o] = type == GGUF_Q6_K ? row_q6_k(wr, nb, qr, dr)
                                                    : row_k4(type, wr, nb, qr, dr, sr);
        }
    }
}

/* gguf_dequantize's contract (gguf.c) for the K-quants: a row of nb superblocks. */
void SLUICE_KERNEL(gguf_k_dequantize)(int type, const uint8_t *w, int64_t nb, float *out) {
    const int64_t bytes = block_bytes(type);
    uint8_t c[QK];
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        if (type == GGUF_Q6_K) {
            const float dw = half(w + 208);
            const int8_t *sc = (const int8_t *)(w + 192);
            for (int j = 0; j < 8; j++, out += QK) {
                k_codes(type, w, j, c);
                for (int i = 0; i < 2; i++) { /* its two sub-blocks of 16 */
                    const float scale = dw * (float)sc[2 * j + i];
                    for (int l = 16 * i; l < 16 * i + 16; l++) out[l] = scale * (float)(c[l] - 32);
                }
            }
        } else if (type == GGUF_Q4_K || type == GGUF_Q5_K) {
            const float dw = half(w), dmin = half(w + 2);
            uint64_t sc, m;
            k4_scales(w + 4, &sc, &m);
            /* unrolled: a 64-row Q5_K tile 0.41 -> 0.38 ms (Q6_K's loop above: 0.49 -> 0.59) */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++, out += QK) {
                const float scale = dw * byte_of(sc, j), min = dmin * byte_of(m, j);
                k_codes(type, w, j, c);
                for (int l = 0; l < QK; l++) out[l] = scale * (float)c[l] - min;
            }
        }
    }
}

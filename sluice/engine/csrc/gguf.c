/* GGUF's quantized weights as the file stores them (llama.cpp's block formats), multiplied
 * without a dequantized copy: the policy is llama.cpp's. Activations are quantized per block
 * of 32 to 8 bits (quantize_q8: scale d = max|x| / 127, q = round(x / d), and the block's
 * sum s = d * sum(q), llama.cpp's Q8_1), and each weight block's contribution to an output
 * is an integer dot product of its codes with the activation codes, scaled once:
 *   Q4_0 (d; 32 4-bit codes c, value (c - 8) d):  d_w (d_a sum(c q) - 8 s_a)
 *   Q4_1 (d, m; codes c, value c d + m):          d_w d_a sum(c q) + m_w s_a
 *   Q8_0 (d; 32 int8 codes c, value c d):         d_w d_a sum(c q)
 * A 4-bit block's byte j holds code j (low nibble) and code j + 16 (high nibble). Scales are
 * IEEE half precision. The error against float32 is the activations' rounding to 8 bits
 * (relative 1/254 per element at most), as llama.cpp's; the tests state the bound.
 *
 * gguf_dot computes a range of output features for every activation row, weight row by
 * weight row, so a weight row is read from memory once per call and stays in cache while
 * each activation row uses it (batch 1 streams the weights once). Every row's result is a
 * float32 sum over the blocks. With AVX2 a block is one 256-bit step (gguf_avx2.h); the
 * portable loops run elsewhere. The K-quants (Q4_K, Q5_K, Q6_K: superblocks of 256 values
 * against the same activation blocks of 32) are gguf_k.c's; gguf_dot and gguf_dequantize
 * hand them over, and the bf16 tile rounds their float32 values. */
#include "gguf.h"

void SLUICE_KERNEL(quantize_q8)(const float *x, int64_t x_stride, int64_t rows, int64_t k,
                                int8_t *q, float *d, float *s) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * x_stride + b * QK;
            int8_t *qb = q + (r * nb + b) * QK;
            float amax = 0.f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(xb[j] * inv);
                qb[j] = (int8_t)v;
                sum += v;
            }
            d[r * nb + b] = scale;
            s[r * nb + b] = scale * (float)sum;
        }
    }
}

static inline int32_t dot_u4(const uint8_t *codes, const int8_t *a) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < QK / 2; j++) {
        lo += (codes[j] & 15) * a[j];
        hi += (codes[j] >> 4) * a[j + QK / 2];
    }
    return lo + hi;
}

static inline int32_t dot_s8(const int8_t *codes, const int8_t *a) {
    int32_t sum = 0;
    for (int j = 0; j < QK; j++) sum += codes[j] * a[j];
    return sum;
}

static float row_q4_0(const uint8_t *w, int64_t nb, const int8_t *q, const float *d,
                      const float *s) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 18)
        acc += half(w) * (d[b] * (float)dot_u4(w + 2, q + b * QK) - 8.f * s[b]);
    return acc;
}

static float row_q4_1(const uint8_t *w, int64_t nb, const int8_t *q, const float *d,
                      const float *s) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 20)
        acc += half(w) * d[b] * (float)dot_u4(w + 4, q + b * QK) + half(w + 2) * s[b];
    return acc;
}

static float row_q8_0(const uint8_t *w, int64_t nb, const int8_t *q, const float *d,
                      const float *s) {
    (void)s;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++, w += 34)
        acc += half(w) * d[b] * (float)dot_s8((const int8_t *)(w + 2), q + b * QK);
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#include "gguf_avx2.h"
#endif
#if defined(__AVX512BF16__)
#include "gguf_bf16.h"
#endif

/* y[r, o] for o in [0, outs) of the weight rows w (w_stride bytes apart, nb blocks each:
 * k = nb x block_values values) and activation rows r in [0, rows) quantized by
 * quantize_q8 (q [rows, k], d and s [rows, k / 32]); y's rows are y_stride floats apart.
 * An unknown type writes nothing. */
void SLUICE_KERNEL(gguf_dot)(int type, const uint8_t *w, int64_t w_stride, int64_t outs,
                             int64_t nb, const int8_t *q, const float *d, const float *s,
                             int64_t rows, float *y, int64_t y_stride) {
    if (gguf_is_k_quant(type)) {
        SLUICE_KERNEL(gguf_k_dot)(type, w, w_stride, outs, nb, q, d, s, rows, y, y_stride);
        return;
    }
    float (*row)(const uint8_t *, int64_t, const int8_t *, const float *, const float *) =
        type == GGUF_Q4_0 ? row_q4_0 : type == GGUF_Q4_1 ? row_q4_1
                                     : type == GGUF_Q8_0 ? row_q8_0 : 0;
    if (!row) return;
#if defined(__AVX2__) && defined(__FMA__)
    avx2_dot(type, w, w_stride, outs, nb, q, d, s, rows, y, y_stride);
#else
    for (int64_t o = 0; o < outs; o++)
        for (int64_t r = 0; r < rows; r++)
            y[r * y_stride + o] = row(w + o * w_stride, nb, q + r * nb * QK, d + r * nb,
                                      s + r * nb);
#endif
}

void SLUICE_KERNEL(gguf_dequantize)(int type, const uint8_t *w, int64_t nb, float *out);

/* float32 -> bfloat16, rounding to nearest even (NaN kept a NaN), as torch converts. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* `count` weight rows of nb blocks (stride bytes apart) as bfloat16, row after row: the
 * tile a batch's rows multiply in bf16 (gguf_bindings.cpp). A K-quant's superblock is its
 * float32 values (gguf_k.c's loops, vectorized by the compiler) rounded, 16 at a time with
 * AVX512_BF16: a 64-row 1536 x 576 Q4_K tile and its matmul take 0.36 ms there, against
 * 0.31 for Q4_1's hand-written path and 0.26 for bf16 weights. */
void SLUICE_KERNEL(gguf_dequantize_bf16)(int type, const uint8_t *w, int64_t stride,
                                         int64_t count, int64_t nb, uint16_t *out) {
#if defined(__AVX512BF16__)
    if (!gguf_is_k_quant(type)) {
        avx512_dequantize_bf16(type, w, stride, count, nb, out);
        return;
    }
#endif
    const int64_t values = block_values(type), bytes = block_bytes(type);
    float block[QK_K];
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < nb; b++, out += values) {
            SLUICE_KERNEL(gguf_dequantize)(type, w + i * stride + b * bytes, 1, block);
#if defined(__AVX512BF16__)
            for (int64_t j = 0; j < values; j += 16)
                store_bf16(out + j, _mm512_loadu_ps(block + j));
#else
            for (int64_t j = 0; j < values; j++) out[j] = to_bf16(block[j]);
#endif
        }
}

/* One weight row of nb blocks as float32 (an embedding lookup; the tests' reference). */
void SLUICE_KERNEL(gguf_dequantize)(int type, const uint8_t *w, int64_t nb, float *out) {
    if (gguf_is_k_quant(type)) {
        SLUICE_KERNEL(gguf_k_dequantize)(type, w, nb, out);
        return;
    }
    for (int64_t b = 0; b < nb; b++, out += QK) {
        if (type == GGUF_Q8_0) {
            const uint8_t *blk = w + b * 34;
            const float scale = half(blk);
            for (int j = 0; j < QK; j++) out[j] = (float)(int8_t)blk[2 + j] * scale;
        } else if (type == GGUF_Q4_0) {
            const uint8_t *blk = w + b * 18;
            const float scale = half(blk);
            for (int j = 0; j < QK / 2; j++) {
                out[j] = (float)((blk[2 + j] & 15) - 8) * scale;
                out[j + QK / 2] = (float)((blk[2 + j] >> 4) - 8) * scale;
            }
        } else if (type == GGUF_Q4_1) {
            const uint8_t *blk = w + b * 20;
            const float scale = half(blk), min = half(blk + 2);
            for (int j = 0; j < QK / 2; j++) {
                out[j] = (float)(blk[4 + j] & 15) * scale + min;
                out[j + QK / 2] = (float)(blk[4 + j] >> 4) * scale + min;
            }
        }
    }
}

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
 * portable loops run elsewhere. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8 }; /* GGMLQuantizationType values */
#define QK 32

/* Bytes of one block of a type with a kernel (Q4_0: half d + 16 code bytes; Q4_1: half d,
 * half m + 16; Q8_0: half d + 32). */
static inline int64_t block_bytes(int type) {
    return type == GGUF_Q4_0 ? 18 : type == GGUF_Q4_1 ? 20 : 34;
}

#if defined(__F16C__)
#include <immintrin.h>
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) { /* zero or subnormal: man x 2^-24 */
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7F800000u | (man << 13)
                                    : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

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

/* y[r, o] for o in [0, outs) of the weight rows w (w_stride bytes apart, nb blocks each)
 * and activation rows r in [0, rows) quantized by quantize_q8 (q [rows, nb x 32], d and s
 * [rows, nb]); y's rows are y_stride floats apart. An unknown type writes nothing. */
void SLUICE_KERNEL(gguf_dot)(int type, const uint8_t *w, int64_t w_stride, int64_t outs,
                             int64_t nb, const int8_t *q, const float *d, const float *s,
                             int64_t rows, float *y, int64_t y_stride) {
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
 * tile a batch's rows multiply in bf16 (gguf_bindings.cpp). */
void SLUICE_KERNEL(gguf_dequantize_bf16)(int type, const uint8_t *w, int64_t stride,
                                         int64_t count, int64_t nb, uint16_t *out) {
#if defined(__AVX512BF16__)
    avx512_dequantize_bf16(type, w, stride, count, nb, out);
    return;
#endif
    float row[QK];
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < nb; b++) {
            SLUICE_KERNEL(gguf_dequantize)(type, w + i * stride + b * block_bytes(type), 1, row);
            for (int j = 0; j < QK; j++) out[(i * nb + b) * QK + j] = to_bf16(row[j]);
        }
}

/* One weight row of nb blocks as float32 (an embedding lookup; the tests' reference). */
void SLUICE_KERNEL(gguf_dequantize)(int type, const uint8_t *w, int64_t nb, float *out) {
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

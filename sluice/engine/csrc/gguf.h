/* GGUF's block formats as the kernels read them (llama.cpp's; the type numbers are
 * GGMLQuantizationType's): the one owner of each type's block size, for gguf.c, gguf_k.c
 * and gguf_bindings.cpp. A type outside this list has no kernel (block_bytes 0). */
#pragma once
#include <stdint.h>

enum {
    GGUF_Q4_0 = 2,  /* 32 values: half d, 16 bytes of 4-bit codes */
    GGUF_Q4_1 = 3,  /* 32 values: half d, half m, 16 bytes of 4-bit codes */
    GGUF_Q8_0 = 8,  /* 32 values: half d, 32 int8 codes */
    GGUF_Q4_K = 12, /* 256 values: half d, half dmin, 12 bytes of 6-bit scales, 128 code bytes */
    GGUF_Q5_K = 13, /* 256 values: as Q4_K, then 32 bytes of fifth bits before the codes */
    GGUF_Q6_K = 14, /* 256 values: 128 bytes low nibbles, 64 high bits, 16 int8 scales, half d */
};

static inline int gguf_is_k_quant(int type) {
    return type == GGUF_Q4_K || type == GGUF_Q5_K || type == GGUF_Q6_K;
}

/* Values per block: 32, or a K-quant's superblock of 256. */
static inline int64_t block_values(int type) { return gguf_is_k_quant(type) ? 256 : 32; }

static inline int64_t block_bytes(int type) {
    switch (type) {
        case GGUF_Q4_0: return 18;
        case GGUF_Q4_1: return 20;
        case GGUF_Q8_0: return 34;
        case GGUF_Q4_K: return 144;
        case GGUF_Q5_K: return 176;
        case GGUF_Q6_K: return 210;
    }
    return 0;
}

#ifndef __cplusplus
/* The kernels' side, compiled once per ISA variant (isa.h). */
#include <math.h>
#include <string.h>

#include "isa.h"

#define QK 32    /* values per activation block (quantize_q8), and per Q4_0/Q4_1/Q8_0 block */
#define QK_K 256 /* values per K-quant superblock: eight activation blocks */

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

/* gguf_k.c's kernels, which gguf.c's gguf_dot and gguf_dequantize hand the K-quants to
 * (same arguments; nb counts superblocks). */
void SLUICE_KERNEL(gguf_k_dot)(int type, const uint8_t *w, int64_t w_stride, int64_t outs,
                               int64_t nb, const int8_t *q, const float *d, const float *s,
                               int64_t rows, float *y, int64_t y_stride);
void SLUICE_KERNEL(gguf_k_dequantize)(int type, const uint8_t *w, int64_t nb, float *out);
#endif

/* The decoder's elementwise steps in one call each on the CPU, bfloat16: RMSNorm and
 * rotate-half rotary embedding. In eager PyTorch they are 8 and ~12 ops per call, and at
 * small batches their dispatch, not their arithmetic, is what costs (docs/benchmarks.md).
 *
 * Each rounds where PyTorch's ops round, so results match the PyTorch path bit for bit
 * except for RMSNorm's sum of squares, whose order differs (float32 either way):
 *   rms_norm: y = bf16(w * bf16(x * 1 / sqrt(sum(x^2) / dim + eps)))
 *   rotary:   y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
 * Built with -ffp-contract=off: a fused multiply-add would round once where PyTorch
 * rounds twice.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "isa.h"

/* x, out: [rows, dim] (row stride x_stride / dim elements); w: [dim]. */
void SLUICE_KERNEL(rms_norm)(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                              uint16_t *out, int64_t rows, int dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = out + r * dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int d = 0; d < dim; d++) {
            const float v = widen(xr[d]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int d = 0; d < dim; d++)
            yr[d] = narrow(widen(w[d]) * widen(narrow(widen(xr[d]) * inv)));
    }
}

/* x: [tokens, heads, head_dim] with token stride x_stride; out: the same shape, contiguous;
 * cos, sin: [tokens, head_dim] (each half repeated, as RotaryEmbedding.cos_sin builds them). */
void SLUICE_KERNEL(rotary)(const uint16_t *x, int64_t x_stride, uint16_t *out,
                            const uint16_t *cos, const uint16_t *sin, int64_t tokens, int heads,
                            int head_dim) {
    const int half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < heads; h++) {
            const uint16_t *xh = x + t * x_stride + (int64_t)h * head_dim;
            uint16_t *yh = out + (t * heads + h) * head_dim;
            for (int d = 0; d < head_dim; d++) {
                const float rotated = d < half ? -widen(xh[d + half]) : widen(xh[d - half]);
                const float a = widen(narrow(widen(xh[d]) * widen(c[d])));
                const float b = widen(narrow(rotated * widen(s[d])));
                yh[d] = narrow(a + b);
            }
        }
    }
}

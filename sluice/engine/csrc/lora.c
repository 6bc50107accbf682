/* The LoRA delta of a step's rows on the CPU, bfloat16, in one call per layer:
 *   y[t] += B[s_t] (A[s_t] x[t])   for each row t whose slot s_t >= 0
 * with A [slots, w, in] (the parts' rank-r matrices one under another, w = parts x r) and
 * B [slots, w, out] block-diagonal: part j's r rows feed only part j's output columns,
 * so only those are read (lora/punica.py states the layout). The shrink h = A x and the
 * delta are accumulated in float32 and added to y with one rounding (zero-padded ranks
 * add nothing). Where torch's dense path multiplies every row by every slot in
 * use and every part by the whole block-diagonal B, this computes what each row needs.
 */
#include <stdint.h>

#include "bf16.h"
#include "isa.h"

/* Rows [0, rows) of x [rows, in] (row stride x_stride) and y [rows, out] (y_stride);
 * part_ends: the parts' cumulative output widths (the last is out); h [w], acc [out]:
 * float scratch. */
void SLUICE_KERNEL(lora_add)(const uint16_t *x, int64_t x_stride, uint16_t *y,
                              int64_t y_stride, const uint16_t *a, const uint16_t *b,
                              const int32_t *row_slots, int64_t rows, int in, int out,
                              int rank, const int32_t *part_ends, int parts, float *h,
                              float *acc) {
    const int w = parts * rank;
    for (int64_t t = 0; t < rows; t++) {
        const int32_t s = row_slots[t];
        if (s < 0) continue;
        const uint16_t *xr = x + t * x_stride;
        const uint16_t *as = a + (int64_t)s * w * in;
        int k = 0;
        for (; k + 4 <= w; k += 4) {  /* four of A's rows per pass over x */
            const uint16_t *a0 = as + (int64_t)k * in, *a1 = a0 + in, *a2 = a1 + in,
                           *a3 = a2 + in;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int i = 0; i < in; i++) {
                const float xv = widen(xr[i]);
                d0 += widen(a0[i]) * xv;
                d1 += widen(a1[i]) * xv;
                d2 += widen(a2[i]) * xv;
                d3 += widen(a3[i]) * xv;
            }
            h[k] = d0, h[k + 1] = d1, h[k + 2] = d2, h[k + 3] = d3;
        }
        for (; k < w; k++) {
            const uint16_t *ak = as + (int64_t)k * in;
            float d = 0.0f;
#pragma omp simd reduction(+ : d)
            for (int i = 0; i < in; i++) d += widen(ak[i]) * widen(xr[i]);
            h[k] = d;
        }
        const uint16_t *bs = b + (int64_t)s * w * out;
        for (int n = 0; n < out; n++) acc[n] = 0.0f;
        for (int j = 0, begin = 0; j < parts; begin = part_ends[j], j++) {
            const int end = part_ends[j];
            for (int r = j * rank; r < (j + 1) * rank; r++) {
                const float hv = h[r];
                const uint16_t *br = bs + (int64_t)r * out;
#pragma omp simd
                for (int n = begin; n < end; n++) acc[n] += hv * widen(br[n]);
            }
        }
        uint16_t *yr = y + t * y_stride;
#pragma omp simd
        for (int n = 0; n < out; n++) yr[n] = narrow(widen(yr[n]) + acc[n]);
    }
}

/* bfloat16 <-> float32 for the engine's C kernels, as torch casts: widening is exact,
 * narrowing rounds to nearest even, and a NaN stays NaN (quiet) instead of rounding
 * into infinity. */
#include <stdint.h>

typedef union { uint32_t u; float f; } bits32;

static inline float widen(uint16_t x) {
    bits32 v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t narrow(float f) {
    bits32 v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

// The kernels' instruction-set variants, chosen at run time (dispatch.cpp), shared by the
// files that register torch ops (torch_bindings.cpp, gguf_bindings.cpp).
//
// Policy: the library holds every variant setup.py built (SLUICE_ISAS, a macro it defines,
// best last); the first call uses the best one this CPU runs, unless select_cpu_isa named
// another (SLUICE_CPU_ISA, read by sluice/engine/kernels.py; the tests force each variant in
// turn).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

using RmsNormFn = void (*)(const uint16_t *, int64_t, const uint16_t *, uint16_t *, int64_t, int,
                           float);
using RotaryFn = void (*)(const uint16_t *, int64_t, uint16_t *, const uint16_t *,
                          const uint16_t *, int64_t, int, int);
using LoraAddFn = void (*)(const uint16_t *, int64_t, uint16_t *, int64_t, const uint16_t *,
                           const uint16_t *, const int32_t *, int64_t, int, int, int,
                           const int32_t *, int, float *, float *);
using AttentionFn = int (*)(const void *, void *, const void *, const void *, const int32_t *,
                            int64_t, const int32_t *, const int32_t *, const int32_t *,
                            const int32_t *, int, int, int, int, int, float, int, int, float,
                            float, int);
// gguf.c: activations to 8-bit blocks; quantized weight rows times them; rows dequantized
using QuantizeQ8Fn = void (*)(const float *, int64_t, int64_t, int64_t, int8_t *, float *,
                              float *);
using GgufDotFn = void (*)(int, const uint8_t *, int64_t, int64_t, int64_t, const int8_t *,
                           const float *, const float *, int64_t, float *, int64_t);
using GgufDequantizeFn = void (*)(int, const uint8_t *, int64_t, float *);
using GgufDequantizeBf16Fn = void (*)(int, const uint8_t *, int64_t, int64_t, int64_t,
                                      uint16_t *);

struct Variant {
    const char *name;
    RmsNormFn rms_norm;
    RotaryFn rotary;
    AttentionFn paged_attention;
    LoraAddFn lora_add;
    QuantizeQ8Fn quantize_q8;
    GgufDotFn gguf_dot;
    GgufDequantizeFn gguf_dequantize;
    GgufDequantizeBf16Fn gguf_dequantize_bf16;
};

// The variant in use (the best this CPU runs, or the one select_cpu_isa chose).
const Variant &current();

inline void check_cpu(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

template <typename T>
const T *in(const at::Tensor &t) {
    return static_cast<const T *>(t.const_data_ptr());
}

template <typename T>
T *out_of(at::Tensor &t) {
    return static_cast<T *>(t.mutable_data_ptr());
}

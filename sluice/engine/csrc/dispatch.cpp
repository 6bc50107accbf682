// The variant table (dispatch.h) and the ops that report and choose it:
// torch.ops.sluice.{cpu_isa, cpu_isas, select_cpu_isa}.
#include "dispatch.h"

#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#ifndef SLUICE_ISAS
#error "build with -DSLUICE_ISAS(X)=X(portable)... (setup.py does)"
#endif

#define SLUICE_DECLARE(isa)                                                              \
    extern "C" void sluice_rms_norm_##isa(const uint16_t *, int64_t, const uint16_t *,   \
                                          uint16_t *, int64_t, int, float);              \
    extern "C" void sluice_rotary_##isa(const uint16_t *, int64_t, uint16_t *,           \
                                        const uint16_t *, const uint16_t *, int64_t, int, \
                                        int);                                            \
    extern "C" int sluice_paged_attention_##isa(                                         \
        const void *, void *, const void *, const void *, const int32_t *, int64_t,      \
        const int32_t *, const int32_t *, const int32_t *, const int32_t *, int, int, int, \
        int, int, float, int, int, float, float, int);                                   \
    extern "C" void sluice_lora_add_##isa(const uint16_t *, int64_t, uint16_t *, int64_t, \
                                          const uint16_t *, const uint16_t *,             \
                                          const int32_t *, int64_t, int, int, int,        \
                                          const int32_t *, int, float *, float *);        \
    extern "C" void sluice_quantize_q8_##isa(const float *, int64_t, int64_t, int64_t,   \
                                             int8_t *, float *, float *);               \
    extern "C" void sluice_gguf_dot_##isa(int, const uint8_t *, int64_t, int64_t, int64_t, \
                                          const int8_t *, const float *, const float *,  \
                                          int64_t, float *, int64_t);                     \
    extern "C" void sluice_gguf_dequantize_##isa(int, const uint8_t *, int64_t, float *); \
    extern "C" void sluice_gguf_dequantize_bf16_##isa(int, const uint8_t *, int64_t, int64_t, \
                                                      int64_t, uint16_t *);
SLUICE_ISAS(SLUICE_DECLARE)

namespace {

#define SLUICE_ENTRY(isa)                                                                  \
    Variant{#isa, sluice_rms_norm_##isa, sluice_rotary_##isa, sluice_paged_attention_##isa, \
            sluice_lora_add_##isa, sluice_quantize_q8_##isa, sluice_gguf_dot_##isa,         \
            sluice_gguf_dequantize_##isa, sluice_gguf_dequantize_bf16_##isa},
const Variant kVariants[] = {SLUICE_ISAS(SLUICE_ENTRY)};

// Whether this CPU (and its OS, for the AVX-512 state) runs a variant's instructions; the
// names and -march levels are setup.py's.
bool runs(const std::string &isa) {
    if (isa == "portable") return true;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (isa == "avx2") return __builtin_cpu_supports("x86-64-v3");
    if (isa == "avx512") return __builtin_cpu_supports("x86-64-v4");
    if (isa == "avx512bf16")
        return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
#endif
    return false;
}

const Variant *best() {
    const Variant *pick = &kVariants[0];
    for (const Variant &v : kVariants)
        if (runs(v.name)) pick = &v;
    return pick;
}

std::atomic<const Variant *> selected{nullptr};

std::string cpu_isa() { return current().name; }

std::vector<std::string> cpu_isas() {
    std::vector<std::string> names;
    for (const Variant &v : kVariants)
        if (runs(v.name)) names.emplace_back(v.name);
    return names;
}

void select_cpu_isa(c10::string_view name) {
    const std::string wanted(name);
    for (const Variant &v : kVariants) {
        if (wanted == v.name) {
            TORCH_CHECK(runs(wanted), "this CPU cannot run the ", wanted, " kernels");
            selected.store(&v, std::memory_order_release);
            return;
        }
    }
    std::string built;
    for (const Variant &v : kVariants) built += std::string(built.empty() ? "" : ", ") + v.name;
    TORCH_CHECK(false, "no CPU kernel variant ", wanted, " (built: ", built, ")");
}

}  // namespace

const Variant &current() {
    const Variant *v = selected.load(std::memory_order_acquire);
    if (v == nullptr) {
        v = best();
        selected.store(v, std::memory_order_release);
    }
    return *v;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("cpu_isa() -> str", &cpu_isa);
    m.def("cpu_isas() -> str[]", &cpu_isas);
    m.def("select_cpu_isa(str name) -> ()", &select_cpu_isa);
}

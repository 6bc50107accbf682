// The engine's CPU kernels as torch ops: torch.ops.sluice.{rms_norm, rotary, paged_attention,
// lora_add}, each calling the instruction-set variant in use (dispatch.h). Arguments are
// checked here, so a bad call is a RuntimeError, never a read out of bounds. Imported as the
// module sluice.engine._C, which registers them (and the other files' ops).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "dispatch.h"

namespace {

// Rows (tokens) per task when an elementwise kernel is split over torch's threads: a row is
// ~0.15 us (SmolLM2's 576 wide), a parallel region a few us, so a decode batch stays on one
// thread and a prefill chunk spreads.
constexpr int64_t kRowsPerTask = 64;

// y = bf16(w * bf16(x / rms(x))) per row of bf16 x [rows, dim] (rows may be strided).
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    check_cpu(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
                "rms_norm takes bfloat16");
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, dim], each row contiguous");
    TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [dim]");
    at::Tensor y = at::empty(x.sizes(), x.options());
    const uint16_t *src = in<uint16_t>(x), *w = in<uint16_t>(weight);
    uint16_t *dst = out_of<uint16_t>(y);
    const int64_t stride = x.stride(0), dim = x.size(1);
    const RmsNormFn fn = current().rms_norm;
    at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
        fn(src + begin * stride, stride, w, dst + begin * dim, end - begin,
           static_cast<int>(dim), static_cast<float>(eps));
    });
    return y;
}

// Rotate-half rotary of bf16 x [tokens, heads, head_dim] (heads contiguous within a token);
// cos, sin: [tokens, (1,) head_dim]. The result is contiguous.
at::Tensor rotary(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
    check_cpu(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                    sin.scalar_type() == at::kBFloat16, "rotary takes bfloat16");
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
                "x: [tokens, heads, head_dim], heads contiguous within a token");
    const int64_t tokens = x.size(0), head_dim = x.size(2);
    for (const at::Tensor *t : {&cos, &sin})
        TORCH_CHECK(t->is_contiguous() && t->numel() == tokens * head_dim &&
                        t->size(0) == tokens && t->size(-1) == head_dim,
                    "cos, sin: [tokens, (1,) head_dim], contiguous");
    at::Tensor y = at::empty(x.sizes(), x.options());
    const uint16_t *src = in<uint16_t>(x), *c = in<uint16_t>(cos), *s = in<uint16_t>(sin);
    uint16_t *dst = out_of<uint16_t>(y);
    const int64_t stride = x.stride(0), heads = x.size(1);
    const RotaryFn fn = current().rotary;
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
        fn(src + begin * stride, stride, dst + begin * heads * head_dim, c + begin * head_dim,
           s + begin * head_dim, end - begin, static_cast<int>(heads),
           static_cast<int>(head_dim));
    });
    return y;
}

// Writes out's rows of the listed items (paged_attention.c says how an item is read). The
// caches hold q's dtype, or float8 e4m3 read as value x k_scale (keys) or v_scale (values);
// other caches ignore the scales.
void paged_attention(const at::Tensor &q, at::Tensor &out, const at::Tensor &key_cache,
                     const at::Tensor &value_cache, const at::Tensor &block_tables,
                     const at::Tensor &seq_rows, const at::Tensor &q_starts,
                     const at::Tensor &q_lens, const at::Tensor &seq_lens, double scale,
                     double k_scale, double v_scale) {
    check_cpu(q, "q");
    const auto dtype = q.scalar_type(), kv_dtype = key_cache.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "float32 or bfloat16 only");
    TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous(), "out: q's dtype, contiguous");
    TORCH_CHECK(kv_dtype == dtype || kv_dtype == at::kFloat8_e4m3fn,
                "the caches: q's dtype or float8_e4m3fn");
    for (const at::Tensor *t : {&key_cache, &value_cache})
        TORCH_CHECK(t->scalar_type() == kv_dtype && t->is_contiguous(),
                    "the caches: one dtype, contiguous");
    TORCH_CHECK(q.is_contiguous() && q.dim() == 3 && out.sizes() == q.sizes(),
                "q, out: [tokens, heads, head_dim]");
    TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                    key_cache.size(3) == q.size(2),
                "caches: [blocks, kv_heads, block_size, head_dim]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                    block_tables.stride(1) == 1, "block_tables: int32 rows");
    const int64_t items = seq_rows.numel();
    for (const at::Tensor *t : {&seq_rows, &q_starts, &q_lens, &seq_lens})
        TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == items,
                    "seq_rows, q_starts, q_lens, seq_lens: int32 [items]");
    // paged_attention.c's DTYPE_* codes
    const auto code = [](at::ScalarType t) {
        return t == at::kFloat8_e4m3fn ? 2 : t == at::kBFloat16 ? 1 : 0;
    };
    const int status = current().paged_attention(
        q.const_data_ptr(), out.mutable_data_ptr(), key_cache.const_data_ptr(),
        value_cache.const_data_ptr(), in<int32_t>(block_tables), block_tables.stride(0),
        in<int32_t>(seq_rows), in<int32_t>(q_starts), in<int32_t>(q_lens),
        in<int32_t>(seq_lens), static_cast<int>(items), static_cast<int>(q.size(1)),
        static_cast<int>(key_cache.size(1)), static_cast<int>(q.size(2)),
        static_cast<int>(key_cache.size(2)), static_cast<float>(scale), code(dtype),
        code(kv_dtype), static_cast<float>(k_scale), static_cast<float>(v_scale),
        at::get_num_threads());
    TORCH_CHECK(status == 0, "CPU paged attention failed (", status,
                "): head_dim and block_size at most 256, heads a multiple of kv_heads");
}

// y [rows, out] += each row's LoRA delta (lora.c): bf16 x [rows, in], a [slots, w, in],
// b [slots, w, out] (w = parts x rank), int32 row_slots [rows] (-1: none).
void lora_add(at::Tensor &y, const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
              const at::Tensor &row_slots, at::IntArrayRef part_sizes, int64_t rank) {
    check_cpu(x, "x");
    for (const at::Tensor *t : {static_cast<const at::Tensor *>(&y), &x, &a, &b})
        TORCH_CHECK(t->scalar_type() == at::kBFloat16, "lora_add takes bfloat16");
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1 &&
                    y.size(0) == x.size(0), "x [rows, in], y [rows, out]: rows contiguous");
    const int64_t parts = static_cast<int64_t>(part_sizes.size()), w = parts * rank;
    TORCH_CHECK(rank > 0 && parts > 0 && a.is_contiguous() && b.is_contiguous() &&
                    a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == w &&
                    b.size(1) == w && a.size(2) == x.size(1) && b.size(2) == y.size(1),
                "a [slots, parts x rank, in], b [slots, parts x rank, out], contiguous");
    std::vector<int32_t> ends;
    int64_t total = 0;
    for (int64_t size : part_sizes) ends.push_back(static_cast<int32_t>(total += size));
    TORCH_CHECK(total == y.size(1), "the parts' sizes add up to out");
    const int64_t rows = x.size(0), slots = a.size(0);
    TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() &&
                    row_slots.numel() == rows, "row_slots: int32 [rows]");
    const int32_t *rs = in<int32_t>(row_slots);
    for (int64_t t = 0; t < rows; t++)
        TORCH_CHECK(rs[t] < slots, "row ", t, " names slot ", rs[t], " of ", slots);
    const LoraAddFn fn = current().lora_add;
    uint16_t *dst = out_of<uint16_t>(y);
    const uint16_t *src = in<uint16_t>(x), *pa = in<uint16_t>(a), *pb = in<uint16_t>(b);
    const int64_t xs = x.stride(0), ys = y.stride(0), width = x.size(1), out = y.size(1);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(w + out);
        fn(src + begin * xs, xs, dst + begin * ys, ys, pa, pb, rs + begin, end - begin,
           static_cast<int>(width), static_cast<int>(out), static_cast<int>(rank), ends.data(),
           static_cast<int>(parts), scratch.data(), scratch.data() + w);
    });
}

}  // namespace

TORCH_LIBRARY(sluice, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
    m.def("paged_attention(Tensor q, Tensor(a!) out, Tensor key_cache, Tensor value_cache, "
          "Tensor block_tables, Tensor seq_rows, Tensor q_starts, Tensor q_lens, "
          "Tensor seq_lens, float scale, float k_scale=1.0, float v_scale=1.0) -> ()");
    m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots, "
          "int[] part_sizes, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("rotary", &rotary);
    m.impl("paged_attention", &paged_attention);
    m.impl("lora_add", &lora_add);
}

// `import sluice.engine._C` loads the library, whose static initialisers register the ops.
PyMODINIT_FUNC PyInit__C(void) {
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                                 "The engine's CPU kernels; see torch.ops.sluice.", -1, nullptr};
    return PyModule_Create(&module);
}

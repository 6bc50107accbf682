// GGUF's quantized weights as torch ops (gguf.c says how they multiply):
//   torch.ops.sluice.gguf_linear(x, w, type) -> y [rows, n] = x [rows, k] W^T, in x's dtype
//     (float32 or bfloat16) for W the file's blocks, uint8 [n, bytes per row];
//   torch.ops.sluice.gguf_dequantize(w, type, ids) -> float32 [len(ids), k]: rows of W (an
//     embedding lookup).
// Types are GGMLQuantizationType values: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13),
// Q6_K (14); their block sizes are gguf.h's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "dispatch.h"
#include "gguf.h"

namespace {

// Values per activation block (quantize_q8's d and s are per block).
constexpr int64_t kBlock = 32;
// Output features per task: a task of a decode step should still stream a few KiB of
// weights, so the threads share a layer without a parallel region per handful of rows.
constexpr int64_t kOutsPerTask = 32;

// Checks w and returns its blocks per row.
int64_t blocks_per_row(const at::Tensor &w, int64_t type) {
    check_cpu(w, "w");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
                "w: uint8 [n, bytes per row], contiguous");
    const int64_t bytes = block_bytes(static_cast<int>(type));
    TORCH_CHECK(bytes > 0, "GGUF type ", type, " has no kernel (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, ",
                "Q4_K = 12, Q5_K = 13, Q6_K = 14)");
    TORCH_CHECK(w.size(1) % bytes == 0, "a row of w is not whole blocks of ", bytes, " bytes");
    return w.size(1) / bytes;
}

// A batch of more rows multiplies a tile of dequantized weights (kTileOuts output features
// at a time, in x's dtype: float32 exactly as the gguf package dequantizes, bfloat16 rounded
// from it) with torch's GEMM, so each weight block is dequantized once for every row; fewer
// rows take the integer dot products, reading the blocks as stored.
constexpr int64_t kMaxDotRows = 4;
constexpr int64_t kTileOuts = 2048;

at::Tensor tiled(const at::Tensor &x, const at::Tensor &w, int64_t type, int64_t nb) {
    const int64_t n = w.size(0), k = nb * block_values(static_cast<int>(type));
    const int64_t stride = w.size(1);
    const Variant &v = current();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    for (int64_t start = 0; start < n; start += kTileOuts) {
        const int64_t count = std::min(kTileOuts, n - start);
        at::Tensor tile = at::empty({count, k}, x.options());
        const uint8_t *wp = in<uint8_t>(w) + start * stride;
        const bool bf16 = x.scalar_type() == at::kBFloat16;
        at::parallel_for(0, count, kOutsPerTask, [&](int64_t begin, int64_t end) {
            if (bf16) {
                v.gguf_dequantize_bf16(static_cast<int>(type), wp + begin * stride, stride,
                                       end - begin, nb, out_of<uint16_t>(tile) + begin * k);
                return;
            }
            for (int64_t i = begin; i < end; i++)
                v.gguf_dequantize(static_cast<int>(type), wp + i * stride, nb,
                                  out_of<float>(tile) + i * k);
        });
        y.narrow(1, start, count).copy_(at::linear(x, tile));
    }
    return y;
}

at::Tensor gguf_linear(const at::Tensor &x, const at::Tensor &w, int64_t type) {
    check_cpu(x, "x");
    const int64_t nb = blocks_per_row(w, type), n = w.size(0);
    const int64_t k = nb * block_values(static_cast<int>(type)), blocks = k / kBlock;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x: [rows, ", k, "]");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "x: float32 or bfloat16");
    const int64_t rows = x.size(0);
    if (rows > kMaxDotRows) return tiled(x, w, type, nb);
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
    at::Tensor d = at::empty({rows, blocks}, x.options().dtype(at::kFloat));
    at::Tensor s = at::empty({rows, blocks}, x.options().dtype(at::kFloat));
    at::Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
    const Variant &v = current();
    const float *src = in<float>(xf);
    int8_t *qp = out_of<int8_t>(q);
    float *dp = out_of<float>(d), *sp = out_of<float>(s), *yp = out_of<float>(y);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        v.quantize_q8(src + begin * k, k, end - begin, k, qp + begin * k, dp + begin * blocks,
                      sp + begin * blocks);
    });
    const uint8_t *wp = in<uint8_t>(w);
    const int64_t stride = w.size(1);
    at::parallel_for(0, n, kOutsPerTask, [&](int64_t begin, int64_t end) {
        v.gguf_dot(static_cast<int>(type), wp + begin * stride, stride, end - begin, nb, qp, dp,
                   sp, rows, yp + begin, n);
    });
    return y.to(x.scalar_type());
}

at::Tensor gguf_dequantize(const at::Tensor &w, int64_t type, const at::Tensor &ids) {
    const int64_t nb = blocks_per_row(w, type), n = w.size(0);
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids: int64 [m]");
    const at::Tensor idx = ids.contiguous();
    const int64_t m = idx.numel(), *ip = in<int64_t>(idx);
    for (int64_t i = 0; i < m; i++)
        TORCH_CHECK(0 <= ip[i] && ip[i] < n, "row ", ip[i], " of ", n);
    const int64_t k = nb * block_values(static_cast<int>(type));
    at::Tensor out = at::empty({m, k}, w.options().dtype(at::kFloat));
    const Variant &v = current();
    const uint8_t *wp = in<uint8_t>(w);
    float *op = out_of<float>(out);
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++)
            v.gguf_dequantize(static_cast<int>(type), wp + ip[i] * w.size(1), nb, op + i * k);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("gguf_linear(Tensor x, Tensor w, int type) -> Tensor");
    m.def("gguf_dequantize(Tensor w, int type, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("gguf_linear", &gguf_linear);
    m.impl("gguf_dequantize", &gguf_dequantize);
}

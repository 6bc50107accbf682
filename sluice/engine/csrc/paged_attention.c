/* Paged attention on the CPU, read through the block table: decodes, speculative
 * verification rows and prefill chunks (the caller splits a chunk into tiles of query rows).
 *
 * One work item is one (sequence or tile, KV head): its query rows are the q_len new tokens
 * times the query heads sharing that KV head. The item walks the sequence's block table once,
 * reading each [block_size, head_dim] key and value tile in place (the cache is head-major
 * within a block, sluice/engine/attention/backend.py), with an online softmax:
 *
 *   per block: s = q . K^T (scaled), masked causally (row of query i sees the first
 *   seq_len - q_len + i + 1 keys); m' = max(m, max s); p = exp(s - m');
 *   l = l * exp(m - m') + sum p; acc = acc * exp(m - m') + p V.
 *   out = acc / l.
 *
 * Scores: with few rows (decodes: the GQA group) a dot product per (row, key), reduced as a
 * tree; with many (TRANSPOSE_ROWS on, prefill tiles) the key tile is transposed once and
 * four rows at a time take head_dim broadcast multiply-adds over the block's keys. On
 * AVX512_BF16 the commonest shape (bf16, head_dim 64, block_size 16) has intrinsics for both
 * (cpu_attention_bf16.h).
 * Everything is accumulated in float32; bfloat16 is read by widening and written with
 * round-to-nearest-even, as torch casts. The cache may instead hold float8 e4m3 (vLLM's
 * --kv-cache-dtype fp8: stored = x / scale, one scale for a layer's keys and one for its
 * values); q and out keep the model's dtype. The scales are applied outside the tiles (the
 * key scale with the softmax scale, the value scale with the final 1 / l), so a tile reads
 * its stored values, exactly (fp8.h); the bf16 intrinsics take a tile converted to bf16.
 * Loops are shaped for the compiler's vectoriser (constant trip counts for the common
 * shapes, see attend_dispatch); exp is a polynomial (Cephes' expf: ~1 ulp) that vectorises
 * where libm's does not. Items are spread over
 * OpenMP threads (torch's own libgomp once torch is loaded).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "isa.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_FP8_E4M3 = 2 };
#define MAX_BLOCK 256
#define MAX_DIM 256
/* From this many query rows per (sequence, KV head) on, keys are transposed per block. */
#define TRANSPOSE_ROWS 16

static inline float exp_poly(float x) {
    /* x <= 0 (a score minus the running max); below -87 the result underflows anyway. */
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* n values from base[index:] as float32 (exactly). */
static inline void load_row(const void *base, int dtype, int64_t index, float *dst, int n) {
    if (dtype == DTYPE_FP8_E4M3) {
        const uint8_t *src = (const uint8_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = fp8_e4m3(src[i]);
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = widen(src[i]);
    } else {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *base, int dtype, int64_t index, const float *src, int n) {
    if (dtype == DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = narrow(src[i]);
    } else {
        memcpy((float *)base + index, src, (size_t)n * sizeof(float));
    }
}

/* A layer's paged cache: k and v [num_blocks, kv_heads, block_size, head_dim] in dtype;
 * an fp8 value means stored value x its scale. */
typedef struct {
    const void *k, *v;
    int dtype;
    float k_scale, v_scale;
} kv_cache_t;

/* Blocks sit anywhere in the cache, so the hardware prefetcher cannot run ahead of the
 * walk: the next block's tiles are requested while this one is computed. */
static inline void prefetch_tile(const kv_cache_t *kv, int64_t index, int count) {
    const int elem = kv->dtype == DTYPE_FP8_E4M3 ? 1 : kv->dtype == DTYPE_BF16 ? 2 : 4;
    const char *k = (const char *)kv->k + index * elem, *v = (const char *)kv->v + index * elem;
    for (int off = 0; off < count * elem; off += 64) {
        __builtin_prefetch(k + off);
        __builtin_prefetch(v + off);
    }
}

/* Folds one block's scores sr[0:n] of one query row into its running max m, sum l and
 * weighted values ar, vf holding the block's value rows. */
static inline __attribute__((always_inline)) void softmax_update(
        float *restrict sr, float *restrict ar, const float *restrict vf, float *m, float *l,
        const int n, const int head_dim) {
    float block_max = sr[0];
    for (int t = 1; t < n; t++) block_max = sr[t] > block_max ? sr[t] : block_max;
    const float new_max = block_max > *m ? block_max : *m;
    const float correction = exp_poly(*m - new_max);
    float sum = 0.0f;
    for (int t = 0; t < n; t++) {
        sr[t] = exp_poly(sr[t] - new_max);
        sum += sr[t];
    }
    *m = new_max;
    *l = *l * correction + sum;
    for (int d = 0; d < head_dim; d++) ar[d] *= correction;
    for (int t = 0; t < n; t++) {
        const float pt = sr[t];
        const float *vt = vf + t * head_dim;
        for (int d = 0; d < head_dim; d++) ar[d] += pt * vt[d];
    }
}

/* Scores of n <= 4 rows against a transposed key tile kt [head_dim, block_size]: four
 * independent accumulator chains sharing each load of kt. */
static inline __attribute__((always_inline)) void score_rows(
        const float *restrict qr, const float *restrict kt, float *restrict sr, int n,
        const int head_dim, const int block_size) {
    float *restrict s0 = sr, *restrict s1 = sr + block_size, *restrict s2 = sr + 2 * block_size,
          *restrict s3 = sr + 3 * block_size;
    if (n < 4) {
        for (int i = 0; i < n; i++) {
            float *restrict si = sr + i * block_size;
            for (int t = 0; t < block_size; t++) si[t] = 0.0f;
            for (int d = 0; d < head_dim; d++) {
                const float qd = qr[i * head_dim + d];
#pragma omp simd
                for (int t = 0; t < block_size; t++) si[t] += qd * kt[d * block_size + t];
            }
        }
        return;
    }
    for (int t = 0; t < block_size; t++) s0[t] = s1[t] = s2[t] = s3[t] = 0.0f;
    for (int d = 0; d < head_dim; d++) {
        const float *kd = kt + d * block_size;
        const float q0 = qr[d], q1 = qr[head_dim + d], q2 = qr[2 * head_dim + d],
                    q3 = qr[3 * head_dim + d];
#pragma omp simd
        for (int t = 0; t < block_size; t++) {
            s0[t] += q0 * kd[t];
            s1[t] += q1 * kd[t];
            s2[t] += q2 * kd[t];
            s3[t] += q3 * kd[t];
        }
    }
}

/* Where an item's row r (query token r / group, query head r % group of the KV head's
 * group) starts in q and out ([num_tokens, num_heads, head_dim]). */
static inline int64_t row_offset(int r, int q_start, int group, int kv_head, int num_heads,
                                 int head_dim) {
    return ((int64_t)(q_start + r / group) * num_heads + kv_head * group + r % group) * head_dim;
}

#if defined(__AVX512BF16__)
#include "paged_attention_bf16.h"
#define INTRINSICS(dtype, kv_dtype, head_dim, block_size) \
    ((dtype) == DTYPE_BF16 && (kv_dtype) != DTYPE_F32 && (head_dim) == 64 && (block_size) == 16)

#else
#define INTRINSICS(dtype, kv_dtype, head_dim, block_size) 0
#endif

/* One (sequence, KV head). q and out: [num_tokens, num_heads, head_dim] in dtype; kv: the
 * layer's cache; table: the sequence's blocks.
 * Always inlined so that the dispatcher's constant head_dim and block_size become constant
 * trip counts: the head_dim loops turn into a few whole vectors. */
static inline __attribute__((always_inline)) void attend_item(
        const void *q, void *out, const kv_cache_t *kv, const int32_t *table, int q_start,
        int q_len, int seq_len, int kv_head, int num_heads, int kv_heads,
        const int head_dim, const int block_size, float softmax_scale, int dtype,
        float *scratch) {
    const int group = num_heads / kv_heads;
    const int fp8 = kv->dtype == DTYPE_FP8_E4M3;
    const float scale = fp8 ? softmax_scale * kv->k_scale : softmax_scale;
    const int rows = q_len * group;
    float *qf = scratch;                      /* [rows, head_dim] */
    float *acc = qf + rows * head_dim;        /* [rows, head_dim] */
    float *m = acc + rows * head_dim;         /* [rows] */
    float *l = m + rows;                      /* [rows] */
    float *s = l + rows;                      /* [rows, block_size] scores, then weights */
    float *vf = s + rows * block_size;        /* [block_size, head_dim] */
    float *kt = vf + block_size * head_dim;   /* [head_dim, block_size]: keys transposed */
    float krow[MAX_DIM];
    /* bf16 intrinsics (cpu_attention_bf16.h) read q as stored: no float copy of it. */
    const int intrinsics = INTRINSICS(dtype, kv->dtype, head_dim, block_size);
#if defined(__AVX512BF16__)
    uint16_t k16[16 * 64], v16[16 * 64]; /* an fp8 block's tiles as bf16, for the intrinsics */
#endif

    for (int r = 0; r < rows; r++) {
        if (!intrinsics) {
            load_row(q, dtype, row_offset(r, q_start, group, kv_head, num_heads, head_dim),
                     qf + r * head_dim, head_dim);
            for (int d = 0; d < head_dim; d++) qf[r * head_dim + d] *= scale;
        }
        m[r] = -1e30f;
        l[r] = 0.0f;
    }
    memset(acc, 0, (size_t)rows * head_dim * sizeof(float));

    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; b++) {
        const int first = b * block_size;
        const int in_block = seq_len - first < block_size ? seq_len - first : block_size;
        const int64_t tile = (((int64_t)table[b] * kv_heads + kv_head) * block_size) * head_dim;
        /* The next block's tiles. The first KV head's item takes every head's (a block's keys,
         * and its values, are one run across heads), the others their own, by then cached:
         * one long run keeps more lines in flight than three short ones. */
        if (b + 1 < num_blocks) {
            const int whole = kv_head == 0;
            prefetch_tile(kv,
                          (((int64_t)table[b + 1] * kv_heads + kv_head) * block_size) * head_dim,
                          (whole ? kv_heads : 1) * block_size * head_dim);
        }
        /* Rows that see none of this block's keys are skipped (a causal tile's first rows at
         * its last blocks); they come first, so start past them. */
        int r_first = 0;
        while (r_first < rows && seq_len - q_len + r_first / group + 1 - first <= 0) r_first++;
#if defined(__AVX512BF16__)
        const uint16_t *ktile = (const uint16_t *)kv->k + tile;
        const uint16_t *vtile = (const uint16_t *)kv->v + tile;
        if (intrinsics && fp8) {
            fp8_tile_bf16((const uint8_t *)kv->k + tile, in_block * 64, k16, 16 * 64);
            fp8_tile_bf16((const uint8_t *)kv->v + tile, in_block * 64, v16, 16 * 64);
            ktile = k16;
            vtile = v16;
        }
        if (intrinsics && rows < TRANSPOSE_ROWS)
            scores_bf16_64x16((const uint16_t *)q, ktile, s, rows,
                              q_start, group, kv_head, num_heads, scale);
        else
#endif
        if (rows < TRANSPOSE_ROWS) {
            /* Few rows: a dot product per (row, key), reduced as a tree. */
            for (int t = 0; t < in_block; t++) {
                load_row(kv->k, kv->dtype, tile + (int64_t)t * head_dim, krow, head_dim);
                for (int r = 0; r < rows; r++) {
                    const float *qr = qf + r * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < head_dim; d++) dot += qr[d] * krow[d];
                    s[r * block_size + t] = dot;
                }
            }
#if defined(__AVX512BF16__)
        } else if (intrinsics) {
            /* Many bf16 rows: the key tile as dimension pairs, then bf16 dot products. */
            key_pairs_bf16_64x16(ktile, in_block, (uint32_t *)kt);
            tile_scores_bf16_64x16((const uint16_t *)q, (const uint32_t *)kt, s, r_first, rows,
                                   q_start, group, kv_head, num_heads, scale);
#endif
        } else {
            /* Many rows (a prefill tile): the key tile transposed once, then each row's scores
             * are head_dim broadcast multiply-adds over a whole block of keys. */
            for (int t = 0; t < in_block; t++) {
                load_row(kv->k, kv->dtype, tile + (int64_t)t * head_dim, krow, head_dim);
                for (int d = 0; d < head_dim; d++) kt[d * block_size + t] = krow[d];
            }
            for (int t = in_block; t < block_size; t++)
                for (int d = 0; d < head_dim; d++) kt[d * block_size + t] = 0.0f;
            for (int r0 = r_first; r0 < rows; r0 += 4)
                score_rows(qf + r0 * head_dim, kt, s + r0 * block_size,
                           rows - r0 < 4 ? rows - r0 : 4, head_dim, block_size);
        }
#if defined(__AVX512BF16__)
        if (intrinsics) {
            values_bf16_64x16(s, vtile, acc, m, l,
                              seq_len - q_len + 1 - first, group, in_block, r_first, rows);
            continue;
        }
#endif
        for (int t = 0; t < in_block; t++)
            load_row(kv->v, kv->dtype, tile + (int64_t)t * head_dim, vf + t * head_dim,
                     head_dim);
        for (int r = 0; r < rows; r++) {
            /* Keys this row may see in this block: causal for the row's query position. */
            int visible = seq_len - q_len + r / group + 1 - first;
            if (visible <= 0) continue;
            if (visible > in_block) visible = in_block;
            float *ar = acc + r * head_dim;
            float *sr = s + r * block_size;
            /* A whole block (the common case) gets constant trip counts. */
            if (visible == block_size)
                softmax_update(sr, ar, vf, m + r, l + r, block_size, head_dim);
            else
                softmax_update(sr, ar, vf, m + r, l + r, visible, head_dim);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *ar = acc + r * head_dim;
        const float inv = (fp8 ? kv->v_scale : 1.0f) / l[r];
        for (int d = 0; d < head_dim; d++) ar[d] *= inv;
        store_row(out, dtype, row_offset(r, q_start, group, kv_head, num_heads, head_dim), ar,
                  head_dim);
    }
}

#define ITEM_ARGS q, out, kv, table, q_start, q_len, seq_len, kv_head, num_heads, \
                  kv_heads
#define ITEM_TAIL scale, dtype, scratch

/* The common (head_dim, block_size) pairs get constant-size loops; others the general one. */
static void attend_dispatch(const void *q, void *out, const kv_cache_t *kv,
                            const int32_t *table, int q_start, int q_len, int seq_len,
                            int kv_head, int num_heads, int kv_heads, int head_dim,
                            int block_size, float scale, int dtype, float *scratch) {
    if (head_dim == 64 && block_size == 16)
        attend_item(ITEM_ARGS, 64, 16, ITEM_TAIL);
    else if (head_dim == 128 && block_size == 16)
        attend_item(ITEM_ARGS, 128, 16, ITEM_TAIL);
    else if (head_dim == 64)
        attend_item(ITEM_ARGS, 64, block_size, ITEM_TAIL);
    else if (head_dim == 128)
        attend_item(ITEM_ARGS, 128, block_size, ITEM_TAIL);
    else
        attend_item(ITEM_ARGS, head_dim, block_size, ITEM_TAIL);
}

/* Returns 0, or -1 for shapes this kernel does not take (the caller checks them first). */
int SLUICE_KERNEL(paged_attention)(const void *q, void *out, const void *k_cache,
                        const void *v_cache, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_rows, const int32_t *q_starts, const int32_t *q_lens,
                        const int32_t *seq_lens, int num_seqs, int num_heads, int kv_heads,
                        int head_dim, int block_size, float scale, int dtype, int kv_dtype,
                        float k_scale, float v_scale, int num_threads) {
    if (head_dim > MAX_DIM || block_size > MAX_BLOCK || num_heads % kv_heads != 0) return -1;
    const kv_cache_t kv_cache = {k_cache, v_cache, kv_dtype, k_scale, v_scale}, *kv = &kv_cache;
    int max_q = 1;
    for (int i = 0; i < num_seqs; i++) max_q = q_lens[i] > max_q ? q_lens[i] : max_q;
    const int max_rows = max_q * (num_heads / kv_heads);
    const size_t scratch_floats =
        (size_t)max_rows * (2 * head_dim + 2 + block_size) + (size_t)2 * head_dim * block_size;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scratch = (float *)malloc(scratch_floats * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_seqs * kv_heads; item++) {
            if (scratch == NULL) continue;
            const int i = item / kv_heads, h = item % kv_heads;
            attend_dispatch(q, out, kv, block_tables + (int64_t)seq_rows[i] * table_stride,
                            q_starts[i], q_lens[i], seq_lens[i], h, num_heads, kv_heads, head_dim, block_size,
                            scale, dtype, scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

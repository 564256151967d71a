/* fp32 CPU kernels of the engine (loaded by cpu_kernels.py through ctypes).
 *
 * Parallel loops use OpenMP; cpu_kernels.py loads this library after torch, so the OpenMP runtime is the
 * one torch already has and the kernels run on torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (softmax after subtracting the running maximum), relative error below 1e-7. Plain
 * arithmetic, so loops that call it vectorize (libm's expf is a scalar call per element). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;                                  /* e^-87 ~ 1.6e-38: the float floor */
    const float n = floorf(x * 1.44269504f + 0.5f);               /* x = n ln2 + r, |r| <= ln2 / 2 */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  /* ln2 split in two for accuracy */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* Blocks are scattered over the pool, so the hardware prefetcher stops at every block edge: ask for the
 * next block (one 64-byte line per 16 floats) while this one is processed, one row per row processed.
 * (Asking for the whole next block at once stalled on the full miss queue: a quarter of the kernel's
 * time sat on the prefetch instructions; spreading them made the kernel about 10% faster.) */
static inline void prefetch(const float *block, int64_t floats)
{
    for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(block + f, 0, 3);
}

/* Paged decode attention: one query token per sequence; keys and values are read in place from the KV
 * pool through each sequence's block table (no gathered copy).
 *
 * Layouts (element strides, row-major):
 *   q      [num_seqs][num_heads][head_dim], rows q_stride apart
 *   out    [num_seqs][num_heads][head_dim], rows out_stride apart
 *   k, v   [num_kv_heads][num_blocks][block_size][head_dim]  (one layer of the pool)
 *   tables [num_seqs][table_width]   block ids; lens [num_seqs] keys attended (the query's own included)
 * Query head h reads kv head h / (num_heads / num_kv_heads), as in grouped-query attention. Work items
 * are (sequence, kv head) pairs; each makes two passes, all keys then all values (measured faster here
 * than one pass with a running softmax, whose interleaved key and value reads defeat the prefetcher).
 * `scores` holds group * max_len floats.
 *
 * decode_item is inlined with head_dim a compile-time constant for the common sizes, so the dot products
 * and value updates unroll into straight vector code.
 */
static inline __attribute__((always_inline)) void decode_item(
    const float *qs, const float *keys, const float *values, const int64_t *table, int64_t n, float *os,
    float *scores, int64_t max_len, int64_t group, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t block_floats = block_size * head_dim;
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, b++) {           /* scores, block by block */
        const int64_t m = n - t0 < block_size ? n - t0 : block_size;
        const float *block = keys + table[b] * block_floats;
        const float *next = t0 + block_size < n ? keys + table[b + 1] * block_floats : NULL;
        for (int64_t i = 0; i < m; i++) {
            const float *key = block + i * head_dim;
            if (next) prefetch(next + i * head_dim, head_dim);
            for (int64_t j = 0; j < group; j++) {
                const float *qj = qs + j * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qj[d] * key[d];
                scores[j * max_len + t0 + i] = dot * scale;
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {                                    /* softmax per query head */
        float *sj = scores + j * max_len, top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) top = sj[t] > top ? sj[t] : top;
#pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) { sj[t] = exp_nonpositive(sj[t] - top); sum += sj[t]; }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) sj[t] *= inv;
    }
    memset(os, 0, sizeof(float) * group * head_dim);
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, b++) {           /* weighted values */
        const int64_t m = n - t0 < block_size ? n - t0 : block_size;
        const float *block = values + table[b] * block_floats;
        const float *next = t0 + block_size < n ? values + table[b + 1] * block_floats : NULL;
        for (int64_t i = 0; i < m; i++) {
            const float *val = block + i * head_dim;
            if (next) prefetch(next + i * head_dim, head_dim);
            for (int64_t j = 0; j < group; j++) {
                const float w = scores[j * max_len + t0 + i];
                float *oj = os + j * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) oj[d] += w * val[d];
            }
        }
    }
}

/* Returns 0, or -1 when a thread could not allocate its score buffer. */
int tf_paged_decode_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                              const int64_t *tables, int64_t table_width, const int64_t *lens,
                              float *out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                              float scale, int64_t max_len)
{
    const int64_t group = num_heads / num_kv_heads, head_stride = num_blocks * block_size * head_dim;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * group * max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                if (scores == NULL) continue;
                const float *qs = q + s * q_stride + kh * group * head_dim;
                const float *keys = k + kh * head_stride, *values = v + kh * head_stride;
                const int64_t *table = tables + s * table_width;
                float *os = out + s * out_stride + kh * group * head_dim;
                switch (head_dim) {
                case 64:
                    decode_item(qs, keys, values, table, lens[s], os, scores, max_len, group, 64, block_size, scale);
                    break;
                case 128:
                    decode_item(qs, keys, values, table, lens[s], os, scores, max_len, group, 128, block_size, scale);
                    break;
                default:
                    decode_item(qs, keys, values, table, lens[s], os, scores, max_len, group, head_dim, block_size,
                                scale);
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* RMSNorm of each row, optionally after adding a delta to the residual in place (as transformers does it:
 * x * rsqrt(mean(x^2) + eps), then times the weight):
 *   if delta: x[r] += delta[r];   out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight
 * Rows are strides apart (x_stride, delta_stride, out_stride); elements are contiguous. */
void tf_rms_norm(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, const float *weight,
                 float *out, int64_t out_stride, int64_t rows, int64_t dim, float eps)
{
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride, *o = out + r * out_stride, squares = 0.0f;
        if (delta) {
            const float *dr = delta + r * delta_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
        }
#pragma omp simd reduction(+:squares)
        for (int64_t i = 0; i < dim; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * weight[i];
    }
}

/* Paged decode attention for fp32 on CPU: one query token per sequence, keys and values read in place
 * from the KV pool through each sequence's block table (no gathered copy).
 *
 * Layouts (element strides, row-major):
 *   q      [num_seqs][num_heads][head_dim], rows q_stride apart
 *   out    [num_seqs][num_heads][head_dim], rows out_stride apart
 *   k, v   [num_kv_heads][num_blocks][block_size][head_dim]  (one layer of the pool)
 *   tables [num_seqs][table_width]   block ids; lens [num_seqs] keys attended (the query's own included)
 * Query head h reads kv head h / (num_heads / num_kv_heads), as in grouped-query attention.
 * Work items are (sequence, kv head) pairs shared out by OpenMP: the runtime is the one torch loaded,
 * so the kernel uses torch's threads. Scores go to a per-thread buffer of max_len floats per query head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Blocks are scattered over the pool, so the hardware prefetcher stops at every block edge: ask for the
 * next block (one cache line in 16 floats) while this one is processed. */
static inline void prefetch_block(const float *block, int64_t floats)
{
    for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(block + f, 0, 3);
}

/* e^x for x <= 0 (softmax after subtracting the row maximum), relative error below 1e-7. Plain
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

int tf_paged_decode_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                              const int64_t *tables, int64_t table_width, const int64_t *lens,
                              float *out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                              float scale, int64_t max_len)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;
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
                const int64_t n = lens[s];
                const int64_t *table = tables + s * table_width;
                const float *keys = k + kh * head_stride, *values = v + kh * head_stride;
                const float *qs = q + s * q_stride + kh * group * head_dim;
                float *os = out + s * out_stride + kh * group * head_dim;
                for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, b++) {     /* block by block */
                    const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                    const float *block = keys + table[b] * block_size * head_dim;
                    if (t0 + block_size < n) prefetch_block(keys + table[b + 1] * block_size * head_dim,
                                                            block_size * head_dim);
                    for (int64_t i = 0; i < m; i++) {
                        const float *key = block + i * head_dim;
                        for (int64_t j = 0; j < group; j++) {
                            const float *qj = qs + j * head_dim;
                            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
                            for (int64_t d = 0; d < head_dim; d++) dot += qj[d] * key[d];
                            scores[j * max_len + t0 + i] = dot * scale;
                        }
                    }
                }
                for (int64_t j = 0; j < group; j++) {
                    float *sj = scores + j * max_len, top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max:top)
                    for (int64_t t = 0; t < n; t++) top = sj[t] > top ? sj[t] : top;
#pragma omp simd reduction(+:sum)
                    for (int64_t t = 0; t < n; t++) { sj[t] = exp_nonpositive(sj[t] - top); sum += sj[t]; }
                    const float inv = 1.0f / sum;
#pragma omp simd
                    for (int64_t t = 0; t < n; t++) sj[t] *= inv;
                }
                memset(os, 0, sizeof(float) * group * head_dim);
                for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, b++) {
                    const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                    const float *block = values + table[b] * block_size * head_dim;
                    if (t0 + block_size < n) prefetch_block(values + table[b + 1] * block_size * head_dim,
                                                            block_size * head_dim);
                    for (int64_t i = 0; i < m; i++) {
                        const float *val = block + i * head_dim;
                        for (int64_t j = 0; j < group; j++) {
                            const float w = scores[j * max_len + t0 + i];
                            float *oj = os + j * head_dim;
#pragma omp simd
                            for (int64_t d = 0; d < head_dim; d++) oj[d] += w * val[d];
                        }
                    }
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* fp32 CPU kernels of the engine (loaded by cpu_kernels.py through ctypes).
 *
 * Parallel loops use OpenMP; cpu_kernels.py loads this library after torch, so the OpenMP runtime is the
 * one torch already has and the kernels run on torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

/* ---- Linear layers: y = x W^T, fp32 --------------------------------------------------------------------
 *
 * For the few-row matmuls of decoding, oneDNN (the fastest library torch offers on this AVX2 CPU) reached
 * 60-90 GFLOP/s; this plain register-blocked GEMM reaches 80-110 on the same shapes and matches it at
 * thousands of rows (numbers in docs/engine.md).
 *
 * The weight [N][K] is packed once into panels of 16 output columns, [N/16][K][16], so the 16 weights a
 * step of the inner loop needs are one cache line and a panel streams sequentially. Each call packs the
 * input rows in blocks of 6, [K][6], so the six values a step broadcasts are adjacent. The micro-kernel
 * keeps a 6 x 16 tile of the output in 12 AVX registers over the whole K loop: per k, two weight loads,
 * six broadcasts and twelve FMAs. Threads split the panels; rows go in chunks whose packed input stays in
 * L2. Every output is a plain k-ordered sum, so a row's result does not depend on the other rows.
 */
#define GEMM_NR 16
#define GEMM_MR 6

int tf_gemm_available(void)
{
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* w [n][k] row-major -> panels [n/16][k][16]; n % 16 == 0. */
void tf_pack_weight(const float *w, int64_t n, int64_t k, float *panels)
{
#pragma omp parallel for
    for (int64_t j = 0; j < n / GEMM_NR; j++)
        for (int64_t c = 0; c < GEMM_NR; c++) {
            const float *row = w + (j * GEMM_NR + c) * k;
            float *dst = panels + j * GEMM_NR * k + c;
            for (int64_t i = 0; i < k; i++) dst[i * GEMM_NR] = row[i];
        }
}

#if defined(__AVX2__) && defined(__FMA__)
/* c[r][0..15] (rows ldc apart) = sum over i < k of a[i * MR + r] * b[i * 16 + 0..15], for r < MR. On the
 * first row block of a chunk the panel comes from memory: prefetch 1 KB ahead, as the hardware prefetcher
 * stops at page edges. */
#define GEMM_TILE(MR)                                                                                          \
static inline __attribute__((always_inline)) void gemm_tile_##MR(const float *a, const float *b, int64_t k,   \
                                                                 float *c, int64_t ldc, int prefetch_b)       \
{                                                                                                             \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;                 \
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                 \
    for (int64_t i = 0; i < k; i++, a += MR, b += GEMM_NR) {                                                  \
        if (prefetch_b) _mm_prefetch((const char *)(b + 256), _MM_HINT_T0);                                   \
        const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);                                      \
        __m256 x = _mm256_broadcast_ss(a);                                                                    \
        c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);                                 \
        if (MR > 1) { x = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11); } \
        if (MR > 2) { x = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21); } \
        if (MR > 3) { x = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31); } \
        if (MR > 4) { x = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41); } \
        if (MR > 5) { x = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51); } \
    }                                                                                                         \
    _mm256_storeu_ps(c, c00); _mm256_storeu_ps(c + 8, c01);                                                   \
    if (MR > 1) { _mm256_storeu_ps(c + ldc, c10); _mm256_storeu_ps(c + ldc + 8, c11); }                       \
    if (MR > 2) { _mm256_storeu_ps(c + 2 * ldc, c20); _mm256_storeu_ps(c + 2 * ldc + 8, c21); }               \
    if (MR > 3) { _mm256_storeu_ps(c + 3 * ldc, c30); _mm256_storeu_ps(c + 3 * ldc + 8, c31); }               \
    if (MR > 4) { _mm256_storeu_ps(c + 4 * ldc, c40); _mm256_storeu_ps(c + 4 * ldc + 8, c41); }               \
    if (MR > 5) { _mm256_storeu_ps(c + 5 * ldc, c50); _mm256_storeu_ps(c + 5 * ldc + 8, c51); }               \
}
GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4) GEMM_TILE(5) GEMM_TILE(6)
#endif

/* y [m][n] (contiguous) = x [m][k] (rows ldx apart) W^T, with W packed by tf_pack_weight; `scratch` holds
 * m * k floats. Returns 0, or -1 when built without AVX2 + FMA (see tf_gemm_available). */
int tf_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels, int64_t n, float *y,
            float *scratch)
{
#if defined(__AVX2__) && defined(__FMA__)
    int64_t chunk = (65536 / (k > 0 ? k : 1)) / GEMM_MR * GEMM_MR;   /* rows whose packed input is ~256 KB */
    chunk = chunk < GEMM_MR ? GEMM_MR : chunk;
#pragma omp parallel
    {
#pragma omp for
        for (int64_t r0 = 0; r0 < m; r0 += GEMM_MR) {                  /* rows r0.. -> scratch[i][rows] */
            const int64_t mr = m - r0 < GEMM_MR ? m - r0 : GEMM_MR;
            float *dst = scratch + r0 * k;
            for (int64_t i = 0; i < k; i++)
                for (int64_t r = 0; r < mr; r++) dst[i * mr + r] = x[(r0 + r) * ldx + i];
        }
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < n / GEMM_NR; j++) {
                const float *b = panels + j * GEMM_NR * k;
                for (int64_t r0 = m0; r0 < m1; r0 += GEMM_MR) {
                    const float *a = scratch + r0 * k;
                    float *c = y + r0 * n + j * GEMM_NR;
                    const int first = r0 == m0;
                    switch (m - r0 < GEMM_MR ? m - r0 : GEMM_MR) {
                    case 6: gemm_tile_6(a, b, k, c, n, first); break;
                    case 5: gemm_tile_5(a, b, k, c, n, first); break;
                    case 4: gemm_tile_4(a, b, k, c, n, first); break;
                    case 3: gemm_tile_3(a, b, k, c, n, first); break;
                    case 2: gemm_tile_2(a, b, k, c, n, first); break;
                    default: gemm_tile_1(a, b, k, c, n, first);
                    }
                }
            }
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)k; (void)panels; (void)n; (void)y; (void)scratch;
    return -1;
#endif
}

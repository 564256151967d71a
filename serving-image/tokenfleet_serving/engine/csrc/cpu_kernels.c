/* fp32 CPU kernels of the engine (loaded by cpu_kernels.py through ctypes).
 *
 * Parallel loops use OpenMP; cpu_kernels.py loads this library after torch, so the OpenMP runtime is the
 * one torch already has and the kernels run on torch's threads.
 */
#define _GNU_SOURCE             /* clock_gettime, nanosleep, sched_yield, open/read for the channel's waits */
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
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

/* ---- int8 KV cache (engine/kv_quant.py): one bfloat16 scale per token and KV head ------------------------
 * x (head_dim floats) is stored as scale = bf16(max|x| / 127) (round to nearest even) and
 * q = clamp(round_half_even(x / scale), -127, 127), exactly as kv_quant.quantize does it in PyTorch, so both
 * paths write the same bits; it reads back as q * scale. */
static inline float bf16_to_float(uint16_t h)
{
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t float_to_bf16(float f)           /* round to nearest even (finite f) */
{
    union { float f; uint32_t u; } v = { .f = f };
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static void quantize_row(const float *x, int64_t n, int8_t *q, uint16_t *scale)
{
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const uint16_t s16 = float_to_bf16(top / 127.0f);
    float s = bf16_to_float(s16);
    s = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        float r = nearbyintf(x[i] / s);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[i] = (int8_t)r;
    }
    *scale = s16;
}

/* Prefetch the cache lines of `bytes` bytes from p. */
static inline void prefetch_bytes(const void *p, int64_t bytes)
{
    for (int64_t f = 0; f < bytes; f += 64) __builtin_prefetch((const char *)p + f, 0, 3);
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
 * decode_item is the portable version, inlined with head_dim a compile-time constant for the common sizes;
 * AVX2 + FMA builds run decode_item_avx2 (further down, next to the other 8-lane helpers) for any head_dim
 * that is a multiple of 8.
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

/* decode_item over an int8 cache: keys / values int8, ks / vs their scales (one per slot of this kv head); the
 * score of key t is scale * ks[t] * (q . k_t), the weight of value t is p_t * vs[t]. */
static inline __attribute__((always_inline)) void decode_item_i8(
    const float *qs, const int8_t *keys, const int8_t *values, const uint16_t *ks, const uint16_t *vs,
    const int64_t *table, int64_t n, float *os, float *scores, int64_t max_len, int64_t group, int64_t head_dim,
    int64_t block_size, float scale)
{
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const int8_t *key = keys + slot * head_dim;
        const float kscale = bf16_to_float(ks[slot]) * scale;
        for (int64_t j = 0; j < group; j++) {
            const float *qj = qs + j * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qj[d] * (float)key[d];
            scores[j * max_len + t] = dot * kscale;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * max_len, top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) top = sj[t] > top ? sj[t] : top;
#pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) { sj[t] = exp_nonpositive(sj[t] - top); sum += sj[t]; }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) sj[t] *= inv;
    }
    memset(os, 0, sizeof(float) * group * head_dim);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const int8_t *val = values + slot * head_dim;
        const float vscale = bf16_to_float(vs[slot]);
        for (int64_t j = 0; j < group; j++) {
            const float w = scores[j * max_len + t] * vscale;
            float *oj = os + j * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) oj[d] += w * (float)val[d];
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void decode_item_avx2(
    const float *qs, const float *keys, const float *values, const int64_t *table, int64_t n, float *os,
    float *scores, int64_t max_len, int64_t *at, int64_t group, int64_t head_dim, int64_t block_size,
    float scale);
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void decode_item_i8_avx2(
    const float *qs, const int8_t *keys, const int8_t *values, const uint16_t *ks, const uint16_t *vs,
    const int64_t *table, int64_t n, float *os, float *scores, int64_t max_len, int64_t *at, int64_t group,
    int64_t head_dim, int64_t block_size, float scale);
#endif

/* Returns 0, or -1 when a thread could not allocate its score buffer. */
static int paged_decode_attention_i8(const float *q, int64_t q_stride, const int8_t *k, const int8_t *v,
                                     const uint16_t *k_scales, const uint16_t *v_scales, const int64_t *tables,
                                     int64_t table_width, const int64_t *lens, float *out, int64_t out_stride,
                                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t num_blocks, int64_t block_size, float scale, int64_t max_len);

/* k_scales / v_scales NULL: k and v are fp32 pool layers; else int8 layers with one bf16 scale per slot
 * ([num_kv_heads][num_blocks][block_size]). */
int tf_paged_decode_attention(const float *q, int64_t q_stride, const void *k_any, const void *v_any,
                              const int64_t *tables, int64_t table_width, const int64_t *lens,
                              float *out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                              float scale, int64_t max_len, const uint16_t *k_scales, const uint16_t *v_scales)
{
    if (k_scales)
        return paged_decode_attention_i8(q, q_stride, k_any, v_any, k_scales, v_scales, tables, table_width, lens,
                                         out, out_stride, num_seqs, num_heads, num_kv_heads, head_dim, num_blocks,
                                         block_size, scale, max_len);
    const float *k = k_any, *v = v_any;
    const int64_t group = num_heads / num_kv_heads, head_stride = num_blocks * block_size * head_dim;
    int failed = 0;
#pragma omp parallel
    {
        int64_t *at = malloc(sizeof(int64_t) * max_len + sizeof(float) * group * max_len);   /* offsets, scores */
        float *scores = at ? (float *)(at + max_len) : NULL;
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
#if defined(__AVX2__) && defined(__FMA__)
                if (head_dim == 64) {
                    decode_item_avx2(qs, keys, values, table, lens[s], os, scores, max_len, at, group, 64, block_size,
                                     scale);
                    continue;
                }
                if (head_dim % 8 == 0) {
                    decode_item_avx2(qs, keys, values, table, lens[s], os, scores, max_len, at, group, head_dim,
                                     block_size, scale);
                    continue;
                }
#endif
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
        free(at);
    }
    return failed ? -1 : 0;
}

static int paged_decode_attention_i8(const float *q, int64_t q_stride, const int8_t *k, const int8_t *v,
                                     const uint16_t *k_scales, const uint16_t *v_scales, const int64_t *tables,
                                     int64_t table_width, const int64_t *lens, float *out, int64_t out_stride,
                                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t num_blocks, int64_t block_size, float scale, int64_t max_len)
{
    const int64_t group = num_heads / num_kv_heads, slots = num_blocks * block_size, head_stride = slots * head_dim;
    int failed = 0;
#pragma omp parallel
    {
        int64_t *at = malloc(sizeof(int64_t) * max_len + sizeof(float) * group * max_len);   /* slots, scores */
        float *scores = at ? (float *)(at + max_len) : NULL;
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                if (scores == NULL) continue;
                const float *qs = q + s * q_stride + kh * group * head_dim;
                const int8_t *keys = k + kh * head_stride, *values = v + kh * head_stride;
                const uint16_t *ks = k_scales + kh * slots, *vs = v_scales + kh * slots;
                const int64_t *table = tables + s * table_width;
                float *os = out + s * out_stride + kh * group * head_dim;
#if defined(__AVX2__) && defined(__FMA__)
                if (head_dim == 64) {
                    decode_item_i8_avx2(qs, keys, values, ks, vs, table, lens[s], os, scores, max_len, at, group, 64,
                                        block_size, scale);
                    continue;
                }
                if (head_dim % 8 == 0) {
                    decode_item_i8_avx2(qs, keys, values, ks, vs, table, lens[s], os, scores, max_len, at, group,
                                        head_dim, block_size, scale);
                    continue;
                }
#endif
                decode_item_i8(qs, keys, values, ks, vs, table, lens[s], os, scores, max_len, group, head_dim,
                               block_size, scale);
            }
        }
        free(at);
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
/* c[r][0..15] (rows ldc apart) = sum over i < k of a[i * a_step + r * a_row] * b[i * 16 + 0..15], for r < MR
 * (packed rows: a_step = MR, a_row = 1; plain rows: a_step = 1, a_row = their stride). On the
 * first row block of a chunk the panel comes from memory: prefetch 1 KB ahead, as the hardware prefetcher
 * stops at page edges. With pf, also ask for pf[0 .. 4k) (a quarter of the next panel) along the way. */
#define GEMM_TILE(MR)                                                                                          \
static inline __attribute__((always_inline)) void gemm_tile_##MR(const float *a, int64_t a_step,             \
    int64_t a_row, const float *b, int64_t k, float *c, int64_t ldc, int prefetch_b, const float *pf)         \
{                                                                                                             \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;                 \
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                 \
    _Pragma("GCC unroll 4")                                                                                  \
    for (int64_t i = 0; i < k; i++, a += a_step, b += GEMM_NR) {                                              \
        if (prefetch_b) _mm_prefetch((const char *)(b + 256), _MM_HINT_T0);                                   \
        if (pf) _mm_prefetch((const char *)(pf + 4 * i), _MM_HINT_T0);                                        \
        const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);                                      \
        __m256 x = _mm256_broadcast_ss(a);                                                                    \
        c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);                                 \
        if (MR > 1) { x = _mm256_broadcast_ss(a + 1 * a_row); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11); } \
        if (MR > 2) { x = _mm256_broadcast_ss(a + 2 * a_row); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21); } \
        if (MR > 3) { x = _mm256_broadcast_ss(a + 3 * a_row); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31); } \
        if (MR > 4) { x = _mm256_broadcast_ss(a + 4 * a_row); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41); } \
        if (MR > 5) { x = _mm256_broadcast_ss(a + 5 * a_row); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51); } \
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

#if defined(__AVX2__) && defined(__FMA__)
/* exp_nonpositive on 8 lanes (the compilers keep the scalar version's bit tricks scalar). */
static inline __m256 exp8_nonpositive(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* The largest of row[0..n-1] (n >= 1). */
static float row_max(const float *row, int64_t n)
{
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + i));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (; i < n; i++) top = row[i] > top ? row[i] : top;
    return top;
}

/* row[i] = e^(scale row[i] - top) for i < n and 0 for n <= i < width; returns the sum (top is at least
 * scale times every row[i < n]). */
static float exp_shifted(float *row, int64_t n, int64_t width, float scale, float top)
{
    const __m256 s8 = _mm256_set1_ps(scale), t8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(row + i), s8, t8));
        _mm256_storeu_ps(row + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, sum8);
    for (int j = 0; j < 8; j++) sum += lanes[j];
    for (; i < n; i++) { row[i] = exp_nonpositive(row[i] * scale - top); sum += row[i]; }
    for (; i < width; i++) row[i] = 0.0f;
    return sum;
}

/* The 8 lane sums of each of v[0..7], as one vector: lane i = v[i][0] + ... + v[i][7]. */
static inline __m256 lane_sums8(const __m256 *v)
{
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* decode_item (above) with AVX2, for head_dim a multiple of 8. In the portable version each dot product is
 * one chain of dependent FMAs ending in a horizontal sum, and each value update goes through memory. Here
 * 8 keys at a time get an accumulator each, summed across lanes together; the weighted values keep 64 dims
 * of one head's output in registers over all keys; the softmax runs 8 lanes wide. Measured (2 vCPUs, W1's
 * shapes): with the keys and values in L3 it reads them at 22 GB/s where the portable version read 15.6;
 * from DRAM both are bound by memory (+5-10 % alone, about 2 % of W1's decode steps in the engine).
 * Keys and values DECODE_AHEAD keys on are prefetched during the key pass, so up to about 2,000 keys (half
 * of L2) the value pass finds its values in cache. `at` receives the n keys' offsets in the pool layer. */
#define DECODE_AHEAD 32
static inline __attribute__((always_inline)) void decode_item_avx2(
    const float *qs, const float *keys, const float *values, const int64_t *table, int64_t n, float *os,
    float *scores, int64_t max_len, int64_t *at, int64_t group, int64_t head_dim, int64_t block_size,
    float scale)
{
    if (n == 0) {                                         /* nothing to attend: zeros, as the portable loop gives */
        memset(os, 0, sizeof(float) * group * head_dim);
        return;
    }
    for (int64_t t = 0, b = 0, off = 0; t < n; t++) {
        at[t] = (table[b] * block_size + off) * head_dim;
        if (++off == block_size) { off = 0; b++; }
    }
    for (int64_t t = 0; t < DECODE_AHEAD && t < n; t++) { prefetch(keys + at[t], head_dim); prefetch(values + at[t], head_dim); }
    for (int64_t j = 0; j < group; j++) {                                   /* scores, 8 keys at a time */
        const float *qj = qs + j * head_dim;
        float *sj = scores + j * max_len;
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            const float *key[8];
            __m256 acc[8];
            for (int i = 0; i < 8; i++) {
                key[i] = keys + at[t0 + i < n ? t0 + i : t0];
                acc[i] = _mm256_setzero_ps();
                if (j == 0 && t0 + i + DECODE_AHEAD < n) {
                    prefetch(keys + at[t0 + i + DECODE_AHEAD], head_dim);
                    prefetch(values + at[t0 + i + DECODE_AHEAD], head_dim);
                }
            }
            for (int64_t d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qj + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[i] + d), acc[i]);
            }
            const __m256 dots = lane_sums8(acc);
            if (t0 + 8 <= n) {
                _mm256_storeu_ps(sj + t0, dots);
            } else {
                float lanes[8];
                _mm256_storeu_ps(lanes, dots);
                memcpy(sj + t0, lanes, sizeof(float) * (n - t0));
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {                                   /* softmax, weighted values */
        float *sj = scores + j * max_len, *oj = os + j * head_dim;
        const float top = row_max(sj, n) * scale;
        const __m256 inv = _mm256_set1_ps(1.0f / exp_shifted(sj, n, n, scale, top));
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t vecs = head_dim - d0 < 64 ? (head_dim - d0) / 8 : 8;
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const float *val = values + at[t] + d0;
                const __m256 w = _mm256_broadcast_ss(sj + t);
                for (int v = 0; v < vecs; v++) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(val + 8 * v), acc[v]);
            }
            for (int v = 0; v < vecs; v++) _mm256_storeu_ps(oj + d0 + 8 * v, _mm256_mul_ps(acc[v], inv));
        }
    }
}

/* 8 int8 at p as 8 floats. */
static inline __m256 widen8_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* decode_item_i8 with AVX2 (head_dim a multiple of 8), laid out as decode_item_avx2: 8 keys' dot products at a
 * time, each times its key's scale; the weighted values in registers, each weight times its value's scale.
 * The int8 rows are a quarter of fp32's bytes, so fewer cache lines to fetch per key. `at` receives the n
 * keys' slots in the kv head's part of the pool layer. */
static inline __attribute__((always_inline)) void decode_item_i8_avx2(
    const float *qs, const int8_t *keys, const int8_t *values, const uint16_t *ks, const uint16_t *vs,
    const int64_t *table, int64_t n, float *os, float *scores, int64_t max_len, int64_t *at, int64_t group,
    int64_t head_dim, int64_t block_size, float scale)
{
    if (n == 0) {
        memset(os, 0, sizeof(float) * group * head_dim);
        return;
    }
    for (int64_t t = 0, b = 0, off = 0; t < n; t++) {
        at[t] = table[b] * block_size + off;
        if (++off == block_size) { off = 0; b++; }
    }
    for (int64_t t = 0; t < DECODE_AHEAD && t < n; t++) {
        prefetch_bytes(keys + at[t] * head_dim, head_dim);
        prefetch_bytes(values + at[t] * head_dim, head_dim);
    }
    for (int64_t j = 0; j < group; j++) {
        const float *qj = qs + j * head_dim;
        float *sj = scores + j * max_len;
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            const int8_t *key[8];
            float kscale[8];
            __m256 acc[8];
            for (int i = 0; i < 8; i++) {
                const int64_t slot = at[t0 + i < n ? t0 + i : t0];
                key[i] = keys + slot * head_dim;
                kscale[i] = bf16_to_float(ks[slot]) * scale;
                acc[i] = _mm256_setzero_ps();
                if (j == 0 && t0 + i + DECODE_AHEAD < n) {
                    prefetch_bytes(keys + at[t0 + i + DECODE_AHEAD] * head_dim, head_dim);
                    prefetch_bytes(values + at[t0 + i + DECODE_AHEAD] * head_dim, head_dim);
                }
            }
            for (int64_t d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qj + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, widen8_i8(key[i] + d), acc[i]);
            }
            const __m256 dots = _mm256_mul_ps(lane_sums8(acc), _mm256_loadu_ps(kscale));
            if (t0 + 8 <= n) {
                _mm256_storeu_ps(sj + t0, dots);
            } else {
                float lanes[8];
                _mm256_storeu_ps(lanes, dots);
                memcpy(sj + t0, lanes, sizeof(float) * (n - t0));
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {                       /* softmax (scores already scaled), values */
        float *sj = scores + j * max_len, *oj = os + j * head_dim;
        const float top = row_max(sj, n);
        const float inv = 1.0f / exp_shifted(sj, n, n, 1.0f, top);
        for (int64_t t = 0; t < n; t++) sj[t] *= bf16_to_float(vs[at[t]]);
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t vecs = head_dim - d0 < 64 ? (head_dim - d0) / 8 : 8;
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const int8_t *val = values + at[t] * head_dim + d0;
                const __m256 w = _mm256_broadcast_ss(sj + t);
                for (int v = 0; v < vecs; v++) acc[v] = _mm256_fmadd_ps(w, widen8_i8(val + 8 * v), acc[v]);
            }
            const __m256 inv8 = _mm256_set1_ps(inv);
            for (int v = 0; v < vecs; v++) _mm256_storeu_ps(oj + d0 + 8 * v, _mm256_mul_ps(acc[v], inv8));
        }
    }
}

/* m rows go through the tiles in ceil(m / 6) row blocks as even as can be: 6, 6, 5, 5, 5, 5 for 32 rows
 * rather than five of 6 and one of 2. A tile of fewer than 5 rows has too few accumulators to cover the
 * FMA latency, so it takes nearly as long as a full one. Block j starts at row_block_start(m, j). */
static inline int64_t row_blocks(int64_t m) { return (m + GEMM_MR - 1) / GEMM_MR; }
static inline int64_t row_block_start(int64_t m, int64_t j)
{
    const int64_t t = row_blocks(m), q = m / t, rem = m % t;
    return j * q + (j < rem ? j : rem);
}

/* One row block (mr <= 6 rows x[r], each k floats) interleaved by k: dst[i * mr + r] = x[r][i]. */
static void pack_block(const float *const *rows, int64_t mr, int64_t k, float *dst)
{
    for (int64_t r = 0; r < mr; r++) {
        const float *x = rows[r];
        for (int64_t i = 0; i < k; i++) dst[i * mr + r] = x[i];
    }
}

/* Rows x[r] (r < m, each k floats) packed block by block (blocks as above), block j at dst + start(j) k. */
static void pack_rows(const float *const *rows, int64_t m, int64_t k, float *dst)
{
    for (int64_t j = 0; j < row_blocks(m); j++) {
        const int64_t r0 = row_block_start(m, j);
        pack_block(rows + r0, row_block_start(m, j + 1) - r0, k, dst + r0 * k);
    }
}

/* c[r][0..15] (rows ldc apart) for r < m times one 16-column panel: of the rows packed by pack_rows
 * (lda = 0), or of plain rows lda floats apart. With `next` (the panel this thread takes next), row
 * blocks 1 to 4 each prefetch a quarter of it, so that it streams in from memory while this one is
 * computed from cache (measured: the 8 layers' linears went from 92 to 111 GFLOP/s at 32 rows, 110 to
 * 125 at 64, 2 vCPUs). */
static void gemm_panel(const float *a, int64_t lda, int64_t m, int64_t k, const float *panel, float *c,
                       int64_t ldc, int prefetch_panel, const float *next)
{
    for (int64_t j = 0; j < row_blocks(m); j++) {
        const int64_t r0 = row_block_start(m, j), mr = row_block_start(m, j + 1) - r0;
        const float *ar = lda ? a + r0 * lda : a + r0 * k;
        float *cr = c + r0 * ldc;
        const int first = prefetch_panel && r0 == 0;
        const float *pf = next && j >= 1 && j <= 4 ? next + (j - 1) * k * 4 : NULL;
#define TILE(MR) (lda ? gemm_tile_##MR(ar, 1, lda, panel, k, cr, ldc, first, pf)        /* constant strides  */ \
                      : gemm_tile_##MR(ar, MR, 1, panel, k, cr, ldc, first, pf))       /* for the packed rows */
        switch (mr) {
        case 6: TILE(6); break;
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        default: TILE(1);
        }
#undef TILE
    }
}
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
        const float *rows[GEMM_MR];
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {                  /* rows packed chunk by chunk */
            const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
#pragma omp for nowait
            for (int64_t j = 0; j < row_blocks(mc); j++) {
                const int64_t r0 = row_block_start(mc, j), mr = row_block_start(mc, j + 1) - r0;
                for (int64_t r = 0; r < mr; r++) rows[r] = x + (m0 + r0 + r) * ldx;
                pack_block(rows, mr, k, scratch + (m0 + r0) * k);
            }
        }
#pragma omp barrier
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < n / GEMM_NR; j++)
                gemm_panel(scratch + m0 * k, 0, mc, k, panels + j * GEMM_NR * k, y + m0 * n + j * GEMM_NR, n, 1,
                           j + 1 < n / GEMM_NR ? panels + (j + 1) * GEMM_NR * k : NULL);
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)k; (void)panels; (void)n; (void)y; (void)scratch;
    return -1;
#endif
}

/* ---- Linear layers with int8 weights: y = (x Q^T) * scale, fp32 arithmetic ---------------------------------
 *
 * Weight-only int8 (quantization.py): each output channel n has int8 weights Q[n][0..k) and one fp32 scale,
 * W[n][i] ~ scale[n] * Q[n][i]. The panels have the fp32 layout in bytes, [N/16][K][16] int8, so a panel is a
 * quarter of the bytes: decoding at a few rows is bound by reading the weights, and reads a quarter.
 * Every output is sum_i x[i] * (float)Q[n][i], a k-ordered sum in fp32 (an FMA chain on AVX2 builds), times
 * scale[n] once at the end. Both AVX2 strategies below compute exactly these operations in this order, so a
 * row's result is bitwise the same in any batch, as with the fp32 GEMM:
 *
 *  - up to INT8_DIRECT_ROWS rows, the tiles convert the int8 weights to fp32 in registers (per k: one 16-byte
 *    load, two widening conversions), so nothing but the int8 panel crosses the memory bus;
 *  - from INT8_DIRECT_ROWS rows on, each thread widens a panel to fp32 in its own buffer (it stays in L2)
 *    and runs the fp32 tiles over it for the rows: the conversion is then 1 / (2 m) of the work, and the
 *    fp32 tiles' 12 FMAs per k need no extra instructions. (Widening the whole weight once per call instead
 *    wrote and read 8 bytes per weight through memory: 3x slower than fp32 at 16-64 rows, measured.)
 *
 * Builds without AVX2 + FMA run a portable loop (one output panel of 16 channels at a time, all rows over it
 * while it sits in L1), which the compiler vectorizes with the ISA it has.
 */
#define INT8_DIRECT_ROWS 16

#if defined(__AVX2__) && defined(__FMA__)
static float *thread_buffer(size_t floats);        /* per thread, kept across calls (defined further down) */

static inline __m256 widen8(__m128i bytes)         /* the low 8 int8 of `bytes` as 8 floats */
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

/* c[r][0..15] = scale[0..15] * sum over i < k of a[i * a_step + r * a_row] * (float)b[i * 16 + 0..15], r < MR.
 * On the first row block the panel streams from memory: prefetch 1 KB ahead, one line per 4 k (a thread's
 * panels are adjacent, so near its end this fetches the start of the next one). */
#define GEMM_TILE_I8(MR)                                                                                       \
static inline __attribute__((always_inline)) void gemm_tile_i8_##MR(const float *a, int64_t a_step,           \
    int64_t a_row, const int8_t *b, int64_t k, float *c, int64_t ldc, const float *scale, int prefetch_b)     \
{                                                                                                             \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;                 \
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                 \
    _Pragma("GCC unroll 4")                                                                                  \
    for (int64_t i = 0; i < k; i++, a += a_step, b += GEMM_NR) {                                              \
        if (prefetch_b && (i & 3) == 0) _mm_prefetch((const char *)(b + 1024), _MM_HINT_T0);                  \
        const __m128i w = _mm_loadu_si128((const __m128i *)b);                                                \
        const __m256 b0 = widen8(w), b1 = widen8(_mm_unpackhi_epi64(w, w));                                   \
        __m256 x = _mm256_broadcast_ss(a);                                                                    \
        c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);                                 \
        if (MR > 1) { x = _mm256_broadcast_ss(a + 1 * a_row); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11); } \
        if (MR > 2) { x = _mm256_broadcast_ss(a + 2 * a_row); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21); } \
        if (MR > 3) { x = _mm256_broadcast_ss(a + 3 * a_row); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31); } \
        if (MR > 4) { x = _mm256_broadcast_ss(a + 4 * a_row); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41); } \
        if (MR > 5) { x = _mm256_broadcast_ss(a + 5 * a_row); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51); } \
    }                                                                                                         \
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);                                \
    _mm256_storeu_ps(c, _mm256_mul_ps(c00, s0)); _mm256_storeu_ps(c + 8, _mm256_mul_ps(c01, s1));             \
    if (MR > 1) { _mm256_storeu_ps(c + ldc, _mm256_mul_ps(c10, s0)); _mm256_storeu_ps(c + ldc + 8, _mm256_mul_ps(c11, s1)); } \
    if (MR > 2) { _mm256_storeu_ps(c + 2 * ldc, _mm256_mul_ps(c20, s0)); _mm256_storeu_ps(c + 2 * ldc + 8, _mm256_mul_ps(c21, s1)); } \
    if (MR > 3) { _mm256_storeu_ps(c + 3 * ldc, _mm256_mul_ps(c30, s0)); _mm256_storeu_ps(c + 3 * ldc + 8, _mm256_mul_ps(c31, s1)); } \
    if (MR > 4) { _mm256_storeu_ps(c + 4 * ldc, _mm256_mul_ps(c40, s0)); _mm256_storeu_ps(c + 4 * ldc + 8, _mm256_mul_ps(c41, s1)); } \
    if (MR > 5) { _mm256_storeu_ps(c + 5 * ldc, _mm256_mul_ps(c50, s0)); _mm256_storeu_ps(c + 5 * ldc + 8, _mm256_mul_ps(c51, s1)); } \
}
GEMM_TILE_I8(1) GEMM_TILE_I8(2) GEMM_TILE_I8(3) GEMM_TILE_I8(4) GEMM_TILE_I8(5) GEMM_TILE_I8(6)

/* The rows packed by pack_rows (m of them, k each) times one int8 panel, scaled: c rows ldc apart. */
static void gemm_panel_i8(const float *a, int64_t m, int64_t k, const int8_t *panel, const float *scale, float *c,
                          int64_t ldc)
{
    for (int64_t j = 0; j < row_blocks(m); j++) {
        const int64_t r0 = row_block_start(m, j), mr = row_block_start(m, j + 1) - r0;
        const float *ar = a + r0 * k;
        float *cr = c + r0 * ldc;
        const int pf = j == 0;
        switch (mr) {
        case 6: gemm_tile_i8_6(ar, 6, 1, panel, k, cr, ldc, scale, pf); break;
        case 5: gemm_tile_i8_5(ar, 5, 1, panel, k, cr, ldc, scale, pf); break;
        case 4: gemm_tile_i8_4(ar, 4, 1, panel, k, cr, ldc, scale, pf); break;
        case 3: gemm_tile_i8_3(ar, 3, 1, panel, k, cr, ldc, scale, pf); break;
        case 2: gemm_tile_i8_2(ar, 2, 1, panel, k, cr, ldc, scale, pf); break;
        default: gemm_tile_i8_1(ar, 1, 1, panel, k, cr, ldc, scale, pf);
        }
    }
}
#endif

/* y [m][n] (contiguous) = (x [m][k] (rows ldx apart) Q^T) * scales, Q packed as int8 panels [n/16][k][16].
 * `scratch` holds m * k floats (AVX2 builds). Returns 0, or -2 when a thread could not allocate its buffer. */
int tf_gemm_int8(const float *x, int64_t ldx, int64_t m, int64_t k, const int8_t *panels, const float *scales,
                 int64_t n, float *y, float *scratch)
{
#if defined(__AVX2__) && defined(__FMA__)
    int64_t chunk = (65536 / (k > 0 ? k : 1)) / GEMM_MR * GEMM_MR;   /* rows whose packed input is ~256 KB */
    chunk = chunk < GEMM_MR ? GEMM_MR : chunk;
    if (m < INT8_DIRECT_ROWS) chunk = m;                              /* the direct tiles take all rows at once */
    int failed = 0;
#pragma omp parallel
    {
        const float *rows[GEMM_MR];
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {                  /* rows packed chunk by chunk */
            const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
#pragma omp for nowait
            for (int64_t j = 0; j < row_blocks(mc); j++) {
                const int64_t r0 = row_block_start(mc, j), mr = row_block_start(mc, j + 1) - r0;
                for (int64_t r = 0; r < mr; r++) rows[r] = x + (m0 + r0 + r) * ldx;
                pack_block(rows, mr, k, scratch + (m0 + r0) * k);
            }
        }
#pragma omp barrier
        if (m < INT8_DIRECT_ROWS) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n / GEMM_NR; j++)
                gemm_panel_i8(scratch, m, k, panels + j * GEMM_NR * k, scales + j * GEMM_NR, y + j * GEMM_NR, n);
        } else {
            float *wide = thread_buffer((size_t)k * GEMM_NR);          /* one panel widened to fp32, in L2 */
            if (!wide) {
#pragma omp atomic write
                failed = 1;
            }
            for (int64_t m0 = 0; m0 < m; m0 += chunk) {
                const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
#pragma omp for schedule(static) nowait
                for (int64_t j = 0; j < n / GEMM_NR; j++) {
                    if (!wide) continue;
                    const int8_t *src = panels + j * GEMM_NR * k;
                    for (int64_t i = 0; i < k * GEMM_NR; i += 16) {
                        const __m128i w = _mm_loadu_si128((const __m128i *)(src + i));
                        _mm256_store_ps(wide + i, widen8(w));
                        _mm256_store_ps(wide + i + 8, widen8(_mm_unpackhi_epi64(w, w)));
                    }
                    float *c = y + m0 * n + j * GEMM_NR;
                    gemm_panel(scratch + m0 * k, 0, mc, k, wide, c, n, 0, NULL);
                    const __m256 s0 = _mm256_loadu_ps(scales + j * GEMM_NR), s1 = _mm256_loadu_ps(scales + j * GEMM_NR + 8);
                    for (int64_t r = 0; r < mc; r++, c += n) {
                        _mm256_storeu_ps(c, _mm256_mul_ps(_mm256_loadu_ps(c), s0));
                        _mm256_storeu_ps(c + 8, _mm256_mul_ps(_mm256_loadu_ps(c + 8), s1));
                    }
                }
            }
        }
    }
    return failed ? -2 : 0;
#else
    (void)scratch;
#pragma omp parallel for schedule(static) if (m * n * k >= 65536)
    for (int64_t j = 0; j < n / GEMM_NR; j++) {
        const int8_t *panel = panels + j * GEMM_NR * k;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * ldx;
            float acc[GEMM_NR] = {0};
            for (int64_t i = 0; i < k; i++) {
                const float xv = xr[i];
                const int8_t *w = panel + i * GEMM_NR;
#pragma omp simd
                for (int c = 0; c < GEMM_NR; c++) acc[c] += xv * (float)w[c];
            }
            float *yr = y + r * n + j * GEMM_NR;
            for (int c = 0; c < GEMM_NR; c++) yr[c] = acc[c] * scales[j * GEMM_NR + c];
        }
    }
    return 0;
#endif
}

/* ---- Prefill attention over the paged cache, fp32 -------------------------------------------------------
 *
 * Chunks of query tokens (prompt chunks, or new tokens after a prefix-cache hit) attend every key of their
 * sequence up to their own position, read from the pool through the block table; the chunk's own keys and
 * values are written to the pool before. Per (sequence, kv head) the keys are packed once into 16-key
 * panels [keys/16][head_dim][16] and the values into 16-dim panels [head_dim/16][keys][16]; then per
 * (sequence, kv head, block of query tokens) the scores S = Q K^T, a softmax with the causal limit of
 * each row, and P V run through the GEMM tiles above, ATTN_KEYS keys at a time with a running maximum
 * and sum per row (as flash attention does), so that the scores and the panels in use stay in the
 * core's L2 cache however long the context. Grouped-query heads of one kv head share the panels: their
 * rows go into one matmul.
 *
 * Sequence s: n_q[s] queries in rows q_row[s].. of q and out ([rows][num_heads][head_dim], rows q_stride /
 * out_stride apart), at positions starts[s].., with its block table at tables + s * table_width. `scratch`
 * holds 2 * num_kv_heads * head_dim * (sum over s of round16(starts[s] + n_q[s])) floats (what the sequences
 * that share packed keys use of it; the caller need not know which those are).
 * head_dim must be a multiple of 16. Returns 0, -1 when built without AVX2 + FMA, -2 when out of memory.
 */
#define ATTN_ROWS 96            /* query rows (tokens x grouped heads) per work item */
#define ATTN_KEYS 256           /* keys per step of a work item (a multiple of 16) */

#if defined(__AVX2__) && defined(__FMA__)
/* A per-thread buffer kept across calls and grown as needed (the calling threads are torch's OpenMP pool,
 * which lives as long as the process): fresh buffers of hundreds of KB per call cost page faults. It is
 * 64-byte aligned, as the GEMM tiles' aligned panel loads need. */
static float *thread_buffer(size_t floats)
{
    static __thread float *buf = NULL;
    static __thread size_t capacity = 0;
    if (capacity < floats) {
        const size_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
        free(buf);
        buf = aligned_alloc(64, bytes);
        capacity = buf ? bytes / sizeof(float) : 0;
    }
    return buf;
}

/* dst[c * dst_stride + j] = rows[j][c] for j, c < 8: eight rows' floats 0..7 as eight columns. */
static inline void transpose8(const float *const *rows, float *dst, int64_t dst_stride)
{
    __m256 r[8], t[8], u[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(rows[j]);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);           /* rows j, j+1 interleaved: columns 0 1 | 4 5 */
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);       /* columns 2 3 | 6 7 */
    }
    for (int j = 0; j < 8; j += 4) {                         /* four rows' column c in each half of u */
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);      /* 0 | 4 */
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);  /* 1 | 5 */
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);  /* 2 | 6 */
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);  /* 3 | 7 */
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
        _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
    }
}

/* Where key i of a sequence with block table `table` starts in one kv head's part of a pool layer. */
static inline int64_t key_offset(const int64_t *table, int64_t i, int64_t block_size, int64_t head_dim)
{
    return (table[i / block_size] * block_size + i % block_size) * head_dim;
}

/* Keys from..to-1 (from and to multiples of 16) of one kv head (at offset `at` in the pool layers k, v) of
 * the sequence with block table `table` and n keys, into key panels kp [(to - from) / 16][head_dim][16]
 * and value panels vp [head_dim / 16][to - from][16]; keys from n on are zeros. With `ahead` > 0 it also
 * asks for the same row `ahead` keys on (keys still to pack), one row per row packed: their blocks are
 * scattered over the pool, where the hardware prefetcher stops. Keys go eight at a time through an 8 x 8
 * transpose (head_dim is a multiple of 16). */
static void pack_kv(const void *k_any, const void *v_any, const uint16_t *ks, const uint16_t *vs,
                    const int64_t *table, int64_t at, int64_t from, int64_t to, int64_t n, int64_t head_dim,
                    int64_t block_size, int64_t ahead, float *kp, float *vp)
{
    const int64_t width = to - from;
    const float *k = k_any, *v = v_any;                 /* fp32 pool layers (ks == NULL) */
    const int8_t *k8 = k_any, *v8 = v_any;              /* int8 ones, with their scales ks, vs */
    float deq[2][8][head_dim];                          /* int8: eight keys' and values' rows, widened */
    for (int64_t i0 = from; i0 < to; i0 += 8) {
        const float *rows[8];
        for (int64_t i = i0; i < i0 + 8; i++) {
            float *vd = vp + (i - from) * 16;
            if (i >= n) {
                for (int64_t d0 = 0; d0 < head_dim; d0 += 16) memset(vd + d0 * width, 0, 16 * sizeof(float));
                continue;
            }
            const int64_t e = at + key_offset(table, i, block_size, head_dim);
            const float *vrow;
            if (ks) {
                const float kscale = bf16_to_float(ks[e / head_dim]), vscale = bf16_to_float(vs[e / head_dim]);
                float *kd = deq[0][i - i0], *vd2 = deq[1][i - i0];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) { kd[d] = (float)k8[e + d] * kscale; vd2[d] = (float)v8[e + d] * vscale; }
                rows[i - i0] = kd;
                vrow = vd2;
            } else {
                rows[i - i0] = k + e;
                vrow = v + e;
            }
            if (ahead > 0 && i + ahead < n) {
                const int64_t later = at + key_offset(table, i + ahead, block_size, head_dim);
                if (ks) {
                    prefetch_bytes(k8 + later, head_dim);
                    prefetch_bytes(v8 + later, head_dim);
                } else {
                    prefetch(k + later, head_dim);
                    prefetch(v + later, head_dim);
                }
            }
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16) memcpy(vd + d0 * width, vrow + d0, 16 * sizeof(float));
        }
        float *kd = kp + (i0 - from) / 16 * head_dim * 16 + i0 % 16;
        if (i0 + 8 <= n) {
            for (int64_t d = 0; d < head_dim; d += 8) {
                const float *at_d[8];
                for (int j = 0; j < 8; j++) at_d[j] = rows[j] + d;
                transpose8(at_d, kd + d * 16, 16);
            }
        } else {
            for (int64_t i = i0; i < i0 + 8; i++)
                for (int64_t d = 0; d < head_dim; d++) kd[d * 16 + i - i0] = i < n ? rows[i - i0][d] : 0.0f;
        }
    }
}
#endif

int tf_prefill_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                         const int64_t *tables, int64_t table_width, const int64_t *q_row, const int64_t *n_q,
                         const int64_t *starts, int64_t num_seqs, float *out, int64_t out_stride,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                         int64_t block_size, float scale, float *scratch, const uint16_t *k_scales,
                         const uint16_t *v_scales)
{
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t group = num_heads / num_kv_heads, head_stride = num_blocks * block_size * head_dim;
    const int64_t tokens_per_item = ATTN_ROWS / group > 0 ? ATTN_ROWS / group : 1;
    /* A sequence whose new tokens make one work item per kv head (a prefix-cache hit's few tokens) has its
     * keys packed by that item, ATTN_KEYS at a time while the next ones are fetched: the pool is read once
     * and the reads overlap the matmuls. Longer chunks share one packed copy among their items. */
    int64_t *panels_at = malloc(sizeof(int64_t) * (num_seqs + 1)), *first_item = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!panels_at || !first_item) { free(panels_at); free(first_item); return -2; }
    panels_at[0] = first_item[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t keys = (starts[s] + n_q[s] + 15) / 16 * 16, per_seq = (n_q[s] + tokens_per_item - 1) / tokens_per_item;
        panels_at[s + 1] = panels_at[s] + (per_seq > 1 ? 2 * num_kv_heads * keys * head_dim : 0);
        first_item[s + 1] = first_item[s] + num_kv_heads * per_seq;
    }
    int failed = 0;
#pragma omp parallel
    {
        /* 1. pack keys and values of every (sequence, kv head) of several work items */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                if ((n_q[s] + tokens_per_item - 1) / tokens_per_item == 1) continue;   /* packs in its item */
                const int64_t n = starts[s] + n_q[s], keys = (n + 15) / 16 * 16;
                float *kp = scratch + panels_at[s] + 2 * h * keys * head_dim;
                pack_kv(k, v, k_scales, v_scales, tables + s * table_width, h * head_stride, 0, keys, n, head_dim,
                        block_size, block_size, kp, kp + keys * head_dim);
            }
        /* 2. per (sequence, kv head, block of query tokens): softmax(Q K^T) V */
        const int64_t rows_max = tokens_per_item * group;
        float *work = thread_buffer((size_t)rows_max * (3 * head_dim + ATTN_KEYS + 3 + 2 * sizeof(float *) / sizeof(float))
                                    + 2 * ATTN_KEYS * head_dim + 2);
        float *own_k = work, *own_v = own_k + ATTN_KEYS * head_dim, *qpack = own_v + ATTN_KEYS * head_dim;
        float *o = qpack + rows_max * head_dim, *ob = o + rows_max * head_dim;
        float *sc = ob + rows_max * head_dim, *top = sc + rows_max * ATTN_KEYS, *sum = top + rows_max;
        float *corr = sum + rows_max;
        const float **rows = (const float **)(corr + rows_max + (rows_max & 1));   /* 8-byte aligned */
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first_item[num_seqs]; item++) {
            if (failed) continue;
            int64_t s = 0;
            while (first_item[s + 1] <= item) s++;
            const int64_t per_seq = (n_q[s] + tokens_per_item - 1) / tokens_per_item, shared = per_seq > 1;
            const int64_t h = (item - first_item[s]) / per_seq, t0 = (item - first_item[s]) % per_seq * tokens_per_item;
            const int64_t nt = n_q[s] - t0 < tokens_per_item ? n_q[s] - t0 : tokens_per_item, m = nt * group;
            const int64_t all_keys = (starts[s] + n_q[s] + 15) / 16 * 16;
            const int64_t n = starts[s] + t0 + nt, keys = (n + 15) / 16 * 16;   /* keys any row here sees */
            const int64_t *table = tables + s * table_width;
            const float *kp = scratch + panels_at[s] + 2 * h * all_keys * head_dim, *vp = kp + all_keys * head_dim;
            for (int64_t r = 0; r < m; r++) {                                 /* row r: token r / group */
                rows[r] = q + (q_row[s] + t0 + r / group) * q_stride + (h * group + r % group) * head_dim;
                top[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            pack_rows(rows, m, head_dim, qpack);
            memset(o, 0, sizeof(float) * m * head_dim);
            for (int64_t k0 = 0; k0 < keys; k0 += ATTN_KEYS) {
                const int64_t kb = keys - k0 < ATTN_KEYS ? keys - k0 : ATTN_KEYS;
                const float *kblock = kp + k0 * head_dim, *vblock = vp + k0 * 16;
                int64_t v_width = all_keys;
                if (!shared) {
                    pack_kv(k, v, k_scales, v_scales, table, h * head_stride, k0, k0 + kb, n, head_dim, block_size,
                            ATTN_KEYS, own_k, own_v);
                    kblock = own_k; vblock = own_v; v_width = kb;
                }
                for (int64_t p = 0; p < kb / 16; p++)
                    gemm_panel(qpack, 0, m, head_dim, kblock + p * head_dim * 16, sc + p * 16, kb, 0, NULL);
                for (int64_t r = 0; r < m; r++) {                             /* causal softmax, running */
                    float *row = sc + r * kb;
                    const int64_t seen = starts[s] + t0 + r / group + 1 - k0;    /* keys row r sees here */
                    if (seen <= 0) {
                        memset(row, 0, sizeof(float) * kb);
                        corr[r] = 1.0f;
                        continue;
                    }
                    const int64_t cnt = seen < kb ? seen : kb;
                    const float block_top = row_max(row, cnt) * scale;
                    const float new_top = block_top > top[r] ? block_top : top[r];
                    corr[r] = exp_nonpositive(top[r] - new_top);              /* ~0 on the first block */
                    sum[r] = sum[r] * corr[r] + exp_shifted(row, cnt, kb, scale, new_top);
                    top[r] = new_top;
                }
                for (int64_t d0 = 0; d0 < head_dim; d0 += 16)
                    gemm_panel(sc, kb, m, kb, vblock + d0 * v_width, ob + d0, head_dim, 0, NULL);
                for (int64_t r = 0; r < m; r++) {
                    float *acc = o + r * head_dim;
                    const float *part = ob + r * head_dim, c = corr[r];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) acc[d] = acc[d] * c + part[d];
                }
            }
            for (int64_t r = 0; r < m; r++) {
                float *dst = out + (q_row[s] + t0 + r / group) * out_stride + (h * group + r % group) * head_dim;
                const float *src = o + r * head_dim, inv = 1.0f / sum[r];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) dst[d] = src[d] * inv;
            }
        }
    }
    free(panels_at); free(first_item);
    return failed ? -2 : 0;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)tables; (void)table_width; (void)q_row; (void)n_q;
    (void)starts; (void)num_seqs; (void)out; (void)out_stride; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)num_blocks; (void)block_size; (void)scale; (void)scratch; (void)k_scales; (void)v_scales;
    return -1;
#endif
}

/* ---- SwiGLU activation: out[r][i] = silu(gu[r][i]) * gu[r][inter + i], fp32 ------------------------------
 * silu(g) = g * sigmoid(g), with sigmoid from e^-|g| (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e)
 * below. One pass over the gate/up matmul's output instead of torch's two. */
void tf_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out)
{
#pragma omp parallel for if (rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp8_nonpositive(_mm256_or_ps(x, sign));                  /* e^-|x| */
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, x), _mm256_add_ps(one, e));  /* x<0: e */
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) {
            const float x = g[i], e = exp_nonpositive(-fabsf(x));
            o[i] = x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
        }
    }
}

/* ---- Rotary position embedding, in place, fp32 ------------------------------------------------------------
 * Row t holds `heads` vectors of head_dim floats (rows row_stride apart); each is rotated for position
 * positions[t] as x * cos + rotate_half(x) * sin, where cos and sin are [max_positions][head_dim] tables whose
 * sin half for the first half-dimensions is negated (so rotate_half is a plain swap of halves). */
void tf_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
             const float *sin, const int64_t *positions)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows * heads * head_dim >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* ---- KV-cache write ------------------------------------------------------------------------------------------
 * Token t's keys and values (num_kv_heads vectors of head_dim floats from rows k + t * k_stride and
 * v + t * v_stride) go to cache slot slots[t] of one layer's pool, k_cache / v_cache
 * [num_kv_heads][slots_per_head][head_dim]. */
void tf_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                 int64_t rows, float *k_cache, float *v_cache, int64_t num_kv_heads, int64_t slots_per_head,
                 int64_t head_dim)
{
#pragma omp parallel for if (rows * num_kv_heads * head_dim >= 65536)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = (h * slots_per_head + slots[t]) * head_dim;
            memcpy(k_cache + at, k + t * k_stride + h * head_dim, sizeof(float) * head_dim);
            memcpy(v_cache + at, v + t * v_stride + h * head_dim, sizeof(float) * head_dim);
        }
}

/* The same into an int8 cache (k_cache / v_cache int8, k_scales / v_scales [num_kv_heads][slots_per_head]
 * bf16), quantized as quantize_row does it. */
void tf_write_kv_int8(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                      int64_t rows, int8_t *k_cache, int8_t *v_cache, uint16_t *k_scales, uint16_t *v_scales,
                      int64_t num_kv_heads, int64_t slots_per_head, int64_t head_dim)
{
#pragma omp parallel for if (rows * num_kv_heads * head_dim >= 65536)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t slot = h * slots_per_head + slots[t];
            quantize_row(k + t * k_stride + h * head_dim, head_dim, k_cache + slot * head_dim, k_scales + slot);
            quantize_row(v + t * v_stride + h * head_dim, head_dim, v_cache + slot * head_dim, v_scales + slot);
        }
}

/* ---- The decoder layers in one call ------------------------------------------------------------------------
 *
 * Runs every decoder layer of one engine step by calling the kernels above in the order model.py's
 * layer loop calls them, with the same arguments, so the result is bit for bit the same. From Python
 * the loop made about a dozen calls per layer, and between two calls the interpreter ran 40-120 us
 * (measured inside the engine: the kernels stream megabytes through the caches, and the interpreter's
 * own code and data come back from memory afterwards). Here the gaps are gone.
 *
 * x [rows][hidden] is the residual stream, updated in place. Rows 0..decodes-1 are one-token decodes; the
 * others belong to the prefill chunks. When keep < rows, the last layer finishes only rows keep_rows[]
 * (increasing): after its attention, which covers the decodes and the `sampled` chunks, those rows move
 * to the front of x, and the rest of the layer runs for them alone.
 */
struct tf_layer {                   /* one layer: packed weights (biases may be NULL) and its cache layer */
    const float *ln1, *ln2, *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    float *k_cache, *v_cache;
    /* per output channel scales of int8 weights (then qkv, o, gate_up and down point to int8 panels, as
     * tf_gemm_int8 takes them), or NULL for fp32 panels */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    /* an int8 cache: k_cache / v_cache hold int8 and these their bf16 scales; NULL for an fp32 cache */
    uint16_t *k_scales, *v_scales;
};

struct tf_chunks {                  /* prefill chunks, in runs whose packed keys share the scratch */
    int64_t count, table_width, runs;
    const int64_t *tables, *q_rows, *n_q, *starts;
    const int64_t *run_ends;        /* run r is chunks run_ends[r - 1] (0 for r = 0) .. run_ends[r] - 1 */
};

struct tf_step {
    int64_t rows, decodes, decode_width, decode_max_len, keep;
    const int64_t *positions, *slots, *decode_tables, *decode_lens, *keep_rows;
    struct tf_chunks prefill, sampled;
};

struct tf_shape {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, piece;
    float eps, scale;
    const float *cos, *sin;
};

struct tf_buffers {                 /* rows x: h, qkv, attn, gemm (rows x the widest input); piece x: the MLP */
    float *h, *qkv, *attn, *gemm, *delta, *gate_up, *act, *attn_scratch;
};

static void add_rows(float *x, const float *delta, int64_t rows, int64_t dim, int64_t delta_stride)
{
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        const float *dr = delta + r * delta_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
    }
}

/* ---- Sums across the ranks of one host over shared memory ------------------------------------------------------
 *
 * The same protocol as shm_channel.py (which owns the segment and shares the round counter with this code):
 * a header of one 64-byte line per rank (its published round, its pid), then per parity and rank one slot of
 * slot_bytes. A round s: write this rank's part into its slot s % 2, publish seq = s, wait until every rank's
 * seq >= s, read. The sum adds the slots in rank order, as shm_channel.py does, so every rank (and the
 * Python loop) holds the same bits.
 *
 * A wait spins (the ranks of a step arrive within microseconds of each other), then yields, then naps; every
 * 5 ms it checks that the ranks it waits for are live processes and that timeout_s has not passed. On
 * failure it returns -3 (a rank exited) or -4 (a rank is late), with that rank in failed_rank. */
struct tf_comm {
    int64_t rank, size, slot_bytes;
    int64_t *header;                /* size lines of 8 int64: [0] the published round, [1] the pid */
    char *slots;                    /* [2][size][slot_bytes] */
    int64_t *round;                 /* this rank's last round (process memory, shared with shm_channel.py) */
    const int64_t *pids;            /* every rank's pid, as this rank recorded them once all had attached */
    double timeout_s;
    double seconds;                 /* out: time spent in sums, waits included (added up) */
    int64_t failed_rank;            /* out: the rank a failed wait was for */
};

static double now_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int pid_alive(int64_t pid)     /* a process that exists and is not a zombie */
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    const int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    const ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char *end = strrchr(buf, ')');        /* the name may hold spaces and parentheses; the state follows */
    if (!end || end[1] != ' ') return 0;
    return end[2] != 'Z' && end[2] != 'X';
}

static inline int64_t seq_of(const struct tf_comm *c, int64_t r)
{
    return __atomic_load_n(c->header + r * 8, __ATOMIC_ACQUIRE);
}

/* Publish the next round and wait for every rank to publish it; returns 0 or -3 / -4. */
static int comm_round(struct tf_comm *c)
{
    const int64_t s = ++*c->round;
    __atomic_store_n(c->header + c->rank * 8, s, __ATOMIC_RELEASE);
    double started = 0, next_check = 0;
    for (int64_t spins = 0;; spins++) {
        int64_t late = -1;
        for (int64_t r = 0; r < c->size && late < 0; r++)
            if (seq_of(c, r) < s) late = r;
        if (late < 0) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins < 4096) continue;
        const double now = now_seconds();
        if (!started) started = now, next_check = now + 0.005;
        const double waited = now - started;
        if (waited < 0.02) {
            sched_yield();
        } else {
            const struct timespec nap = {0, waited < 1 ? 200000 : 2000000};
            nanosleep(&nap, NULL);
        }
        if (now >= next_check) {
            next_check = now + 0.005;
            for (int64_t r = 0; r < c->size; r++)
                if (seq_of(c, r) < s && !pid_alive(c->pids[r])) {
                    c->failed_rank = r;
                    return -3;
                }
            if (waited > c->timeout_s) {
                c->failed_rank = late;
                return -4;
            }
        }
    }
}

/* Where this rank's part of a sum of n floats can be written for the next round: its slot, when the part fits
 * (then tf_comm_sum skips a copy), else `fallback`. */
static float *comm_target(const struct tf_comm *c, int64_t n, float *fallback)
{
    if (!c || n * (int64_t)sizeof(float) > c->slot_bytes) return fallback;
    return (float *)(c->slots + ((*c->round + 1) % 2 * c->size + c->rank) * c->slot_bytes);
}

/* out[0..n) = the sum over the ranks of each one's x[0..n) (x may be this rank's slot, from comm_target; out
 * may be x). Returns 0 or the failed wait's code. */
int tf_comm_sum(struct tf_comm *c, const float *x, float *out, int64_t n)
{
    const double started = now_seconds();
    const int64_t step = c->slot_bytes / (int64_t)sizeof(float);
    int rc = 0;
    for (int64_t at = 0; at < n && !rc; at += step) {
        const int64_t m = n - at < step ? n - at : step;
        const int64_t parity = (*c->round + 1) % 2;
        float *mine = (float *)(c->slots + (parity * c->size + c->rank) * c->slot_bytes);
        if (x + at != mine) memcpy(mine, x + at, sizeof(float) * m);
        if ((rc = comm_round(c))) break;
        const float *a = (const float *)(c->slots + parity * c->size * c->slot_bytes);
        const float *b = (const float *)((const char *)a + c->slot_bytes);
        float *o = out + at;
#pragma omp parallel for if (m >= 262144)
        for (int64_t i = 0; i < m; i++) o[i] = a[i] + b[i];
        for (int64_t r = 2; r < c->size; r++) {
            const float *q = (const float *)((const char *)a + r * c->slot_bytes);
#pragma omp parallel for if (m >= 262144)
            for (int64_t i = 0; i < m; i++) o[i] += q[i];
        }
    }
    c->seconds += now_seconds() - started;
    return rc;
}

static int gemm_bias(const float *x, int64_t m, int64_t k, const float *panels, const float *scale,
                     const float *bias, int64_t n, float *y, float *scratch)
{
    const int rc = !m ? 0 : scale ? tf_gemm_int8(x, k, m, k, (const int8_t *)panels, scale, n, y, scratch)
                                  : tf_gemm(x, k, m, k, panels, n, y, scratch);
    if (bias) add_rows(y, bias, m, n, 0);
    return rc;
}

static int attend(const struct tf_shape *d, const struct tf_layer *L, const struct tf_step *s,
                  const struct tf_chunks *c, const struct tf_buffers *b)
{
    const int64_t hd = d->head_dim, width = (d->heads + 2 * d->kv_heads) * hd, out_width = d->heads * hd;
    if (s->decodes && tf_paged_decode_attention(b->qkv, width, L->k_cache, L->v_cache, s->decode_tables,
                                                s->decode_width, s->decode_lens, b->attn, out_width, s->decodes,
                                                d->heads, d->kv_heads, hd, d->num_blocks, d->block_size, d->scale,
                                                s->decode_max_len, L->k_scales, L->v_scales))
        return -2;
    for (int64_t r = 0, first = 0; r < c->runs; first = c->run_ends[r++]) {
        const int rc = tf_prefill_attention(b->qkv, width, L->k_cache, L->v_cache,
                                            c->tables + first * c->table_width, c->table_width, c->q_rows + first,
                                            c->n_q + first, c->starts + first, c->run_ends[r] - first, b->attn,
                                            out_width, d->heads, d->kv_heads, hd, d->num_blocks, d->block_size,
                                            d->scale, b->attn_scratch, L->k_scales, L->v_scales);
        if (rc) return rc;
    }
    return 0;
}

/* A row-parallel matmul's output: y = x W^T, summed over the ranks when `comm` is given (tensor parallelism:
 * each rank holds some input columns of W), then + bias (once), into out. With one rank it is gemm_bias. */
static int gemm_sum_bias(struct tf_comm *comm, const float *x, int64_t m, int64_t k, const float *panels,
                         const float *scale, const float *bias, int64_t n, float *out, float *scratch)
{
    if (!comm) return gemm_bias(x, m, k, panels, scale, bias, n, out, scratch);
    float *y = comm_target(comm, m * n, out);     /* straight into this rank's slot when it fits */
    int rc = gemm_bias(x, m, k, panels, scale, NULL, n, y, scratch);
    if (!rc) rc = tf_comm_sum(comm, y, out, m * n);
    if (!rc && bias) add_rows(out, bias, m, n, 0);
    return rc;
}

/* Returns 0, -1 when built without AVX2 + FMA, -2 when out of memory, -3 / -4 when a sum across the ranks
 * failed (`comm`: this rank's channel under tensor parallelism, else NULL; see tf_comm_sum). */
int tf_decoder_layers(const struct tf_shape *d, const struct tf_layer *layers, int64_t num_layers,
                      const struct tf_step *s, float *x, const struct tf_buffers *b, struct tf_comm *comm)
{
    const int64_t D = d->hidden, hd = d->head_dim, I = d->inter, qn = d->heads * hd, kvn = d->kv_heads * hd;
    const int64_t width = qn + 2 * kvn;
    if (!tf_gemm_available()) return -1;
    for (int64_t l = 0; l < num_layers; l++) {
        const struct tf_layer *L = layers + l;
        const int trim = l == num_layers - 1 && s->keep < s->rows;
        int64_t rows = s->rows;
        int rc;
        tf_rms_norm(x, D, NULL, 0, L->ln1, b->h, D, rows, D, d->eps);
        if ((rc = gemm_bias(b->h, rows, D, L->qkv, L->qkv_scale, L->qkv_bias, width, b->qkv, b->gemm))) return rc;
        tf_rope(b->qkv, rows, width, d->heads + d->kv_heads, hd, d->cos, d->sin, s->positions);
        if (L->k_scales)
            tf_write_kv_int8(b->qkv + qn, width, b->qkv + qn + kvn, width, s->slots, rows, (int8_t *)L->k_cache,
                             (int8_t *)L->v_cache, L->k_scales, L->v_scales, d->kv_heads, d->num_blocks * d->block_size, hd);
        else
            tf_write_kv(b->qkv + qn, width, b->qkv + qn + kvn, width, s->slots, rows, L->k_cache, L->v_cache,
                        d->kv_heads, d->num_blocks * d->block_size, hd);
        if ((rc = attend(d, L, s, trim ? &s->sampled : &s->prefill, b))) return rc;
        if (trim) {                                   /* keep_rows[i] >= i: moving rows forward in order is safe */
            for (int64_t i = 0; i < s->keep; i++) {
                memmove(x + i * D, x + s->keep_rows[i] * D, sizeof(float) * D);
                memmove(b->attn + i * qn, b->attn + s->keep_rows[i] * qn, sizeof(float) * qn);
            }
            rows = s->keep;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += d->piece) {   /* row pieces bound the MLP's wide intermediates */
            const int64_t p = rows - r0 < d->piece ? rows - r0 : d->piece;
            float *xr = x + r0 * D;
            if ((rc = gemm_sum_bias(comm, b->attn + r0 * qn, p, qn, L->o, L->o_scale, L->o_bias, D, b->delta,
                                  b->gemm)))
                return rc;
            tf_rms_norm(xr, D, b->delta, D, L->ln2, b->h, D, p, D, d->eps);     /* x += o(attn) first */
            if ((rc = gemm_bias(b->h, p, D, L->gate_up, L->gate_up_scale, L->gate_up_bias, 2 * I, b->gate_up, b->gemm)))
                return rc;
            tf_silu_mul(b->gate_up, p, I, b->act);
            if ((rc = gemm_sum_bias(comm, b->act, p, I, L->down, L->down_scale, L->down_bias, D, b->delta,
                                  b->gemm)))
                return rc;
            add_rows(xr, b->delta, p, D, D);
        }
    }
    return 0;
}

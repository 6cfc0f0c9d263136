/* Paged attention for a few query rows per sequence (decode steps), on the CPU.
 *
 * Query row r is token `row_token[r]` of the batch; it attends to the first `ctx_lens[r]` tokens of
 * sequence `row_seq[r]`, read in place from the
 * paged cache through the sequence's block table: nothing is gathered or copied. Work is split by
 * row, and by ranges of kv heads when there are fewer rows than threads; the query heads that share
 * a kv head read its keys and values once.
 * Scores, softmax and the weighted sum of values are float32 whatever the cache dtype, and the
 * order of every sum is fixed, so a row's result does not depend on the rest of the batch.
 *
 * Layouts (element strides, not bytes):
 *   q:      [tokens, q_heads, head_dim], token stride q_stride, heads contiguous
 *   k, v:   [num_blocks, block_size, kv_heads, head_dim] contiguous (one layer's keys or values)
 *   tables: [seqs, tables_stride] int32 block ids; row r reads tables[row_seq[r]]
 *   out:    [tokens, q_heads, head_dim] contiguous; only the rows' tokens are written
 * dtype: 0 float32, 1 bfloat16 (for q, k, v and out alike).
 *
 * Built by kernels/cpu_build.py with -O3 -march=native -fopenmp. The OpenMP runtime it binds to is the
 * one torch already loaded (same soname), so the kernel runs on torch's own thread pool instead of
 * competing with it for the cores.
 */
/* The max and exp loops of the softmax vectorise only when the compiler may ignore infinities, NaN and
 * the sign of zero in float comparisons (GCC; other compilers leave them scalar). Scores are finite and
 * the running maximum starts at -FLT_MAX, not -INFINITY; the bfloat16 rounding works on the bits. */
#pragma GCC optimize("finite-math-only", "no-signed-zeros")
#include <float.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1 /* bfloat16 rows with head_dim % 32 == 0 take the intrinsics below */
#endif
#if defined(__AVX2__)
#define HAVE_AVX2 1 /* float32 rows take the 8-lane intrinsics below, in plain C's order of every sum */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scalar.h"

#define LANES 16       /* partial sums per dot product: one 512-bit vector of float32 */
#define MAX_GROUP 16   /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define PREFETCH_TOKENS 16 /* how far ahead keys and values are asked for */

typedef struct {
    const void *q, *k, *v;
    const int32_t *tables, *row_token, *row_seq, *ctx_lens;
    void *out;
    int64_t q_stride, tables_stride;
    int rows, q_heads, kv_heads, head_dim, block_size, dtype;
    float scale;
    int parts; /* kv-head ranges per row: more work items than rows when rows are few */
} job_t;     /* work items are (row, kv-head range) pairs, row-major */

/* Loads n elements starting at element offset `off` of `base` as float32. */
static inline void load_row(const void *base, int64_t off, int n, int dtype, float *dst) {
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

#ifdef HAVE_AVX512_BF16
/* dot_key and add_value for bfloat16 rows with head_dim % 32 == 0 on CPUs with AVX512-BF16: the
 * query stays in bfloat16 (exact: it came from there) and VDPBF16PS multiplies pairs exactly and
 * sums them in float32. */
static inline float dot_key_bf16(const uint16_t *q, const uint16_t *k, int d) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
    return _mm512_reduce_add_ps(acc);
}

static inline void add_value_bf16(float *acc, float p, const uint16_t *v, int d) {
    const __m512 weight = _mm512_set1_ps(p);
    for (int i = 0; i < d; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + i)));
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(weight, x, _mm512_loadu_ps(acc + i)));
    }
}

/* The lane sums of 16 vectors: lane u of the result is the sum of v[u]'s lanes, in a fixed order (pairs
 * of lanes, then pairs of those, then across the four 128-bit quarters). */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* x[g]'s every quarter holds tokens 4g .. 4g + 3; add the quarters */
    const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xdd));
}
#endif

/* Whether bfloat16 rows of head_dim d take the AVX512-BF16 functions above. */
static inline int bf16_fast(int dtype, int d) {
#ifdef HAVE_AVX512_BF16
    return dtype == 1 && d % 32 == 0;
#else
    (void)dtype;
    (void)d;
    return 0;
#endif
}

/* Whether float32 rows take the AVX2 functions below (head_dim is a multiple of LANES). */
static inline int f32_fast(int dtype) {
#ifdef HAVE_AVX2
    return dtype == 0;
#else
    (void)dtype;
    return 0;
#endif
}

/* Dot product of a query row with one cached key: the float32 row `q` summed in LANES fixed partial
 * sums, or on the bf16_fast path the query's own bfloat16 row `q16`. */
static inline float dot_key(const float *q, const uint16_t *q16, const void *k, int64_t off, int d,
                            int dtype) {
#ifdef HAVE_AVX512_BF16
    if (bf16_fast(dtype, d)) return dot_key_bf16(q16, (const uint16_t *)k + off, d);
#else
    (void)q16;
#endif
    float acc[LANES] = {0};
    if (dtype == 1) {
        const uint16_t *kr = (const uint16_t *)k + off;
        for (int i = 0; i < d; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += q[i + j] * bf16_to_f32(kr[i + j]);
    } else {
        const float *kr = (const float *)k + off;
        for (int i = 0; i < d; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += q[i + j] * kr[i + j];
    }
    for (int w = LANES / 2; w > 0; w /= 2) /* pairwise: a short dependency chain that vectorizes */
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}


/* acc[0:d] += p * value row */
static inline void add_value(float *acc, float p, const void *v, int64_t off, int d, int dtype) {
#ifdef HAVE_AVX512_BF16
    if (bf16_fast(dtype, d)) {
        add_value_bf16(acc, p, (const uint16_t *)v + off, d);
        return;
    }
#endif
    if (dtype == 1) {
        const uint16_t *vr = (const uint16_t *)v + off;
        for (int i = 0; i < d; i++) acc[i] += p * bf16_to_f32(vr[i]);
    } else {
        const float *vr = (const float *)v + off;
        for (int i = 0; i < d; i++) acc[i] += p * vr[i];
    }
}

/* The cache row (in kv-head rows of head_dim elements) where token `t` of a sequence starts. */
static inline int64_t token_row(const job_t *j, const int32_t *table, int t) {
    return ((int64_t)table[t / j->block_size] * j->block_size + t % j->block_size) * j->kv_heads;
}

/* Asks for the cache lines of token `t`'s kv heads [h0, h1) a few tokens ahead of their use: block
 * tables scatter a sequence over memory, so the hardware prefetcher loses the stream at each block. */
static inline void prefetch_token(const job_t *j, const void *base, const int32_t *table, int t, int n,
                                  int h0, int h1) {
    if (t >= n) return;
    const int esize = j->dtype == 1 ? 2 : 4;
    const int64_t row = token_row(j, table, t) + h0;
    const char *p = (const char *)base + row * j->head_dim * esize;
    const int64_t bytes = (int64_t)(h1 - h0) * j->head_dim * esize;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

#ifdef HAVE_AVX512_BF16
/* Step 1 on the bf16_fast path for the cnt <= 16 tokens from t0: each token's products with a query
 * head stay a vector until sum_lanes16 reduces 16 of them together (one reduction per token would cost
 * more than its two VDPBF16PS). Writes scores[i * n + t] for the range's query heads i. */
static void scores16(const job_t *j, const int32_t *table, const uint16_t *q16, int t0, int cnt, int n, int h0,
                     int heads, float *scores) {
    const int d = j->head_dim, group = j->q_heads / j->kv_heads;
    int64_t rows[16];
    for (int u = 0; u < cnt; u++) rows[u] = token_row(j, table, t0 + u) + h0;
    const __mmask16 live = cnt >= 16 ? 0xffff : (__mmask16)((1u << cnt) - 1);
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int i = 0; i < heads; i++) {
        const uint16_t *qi = q16 + (int64_t)i * d;
        __m512 acc[16];
        for (int u = 0; u < 16; u++) {
            acc[u] = _mm512_setzero_ps();
            if (u >= cnt) continue;
            const uint16_t *kr = (const uint16_t *)j->k + (rows[u] + i / group) * d;
            for (int x = 0; x < d; x += 32)
                acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(qi + x),
                                          (__m512bh)_mm512_loadu_si512(kr + x));
        }
        _mm512_mask_storeu_ps(scores + (int64_t)i * n + t0, live, _mm512_mul_ps(sum_lanes16(acc), scale));
    }
}
#endif

#ifdef HAVE_AVX512_BF16
/* Step 3 for kv head h with its sums in registers: GROUP query heads x VECS 16-dim vectors, each value
 * row converted to float32 once for all the heads that share it. The same multiply-adds in the same
 * token order as add_value, so the result is the same to the bit. */
static inline __attribute__((always_inline)) void values_of_head(const job_t *j, const int32_t *table, int n,
                                                                 int h, const float *p, float *acc,
                                                                 const int GROUP, const int VECS) {
    __m512 sum[16];
    for (int x = 0; x < GROUP * VECS; x++) sum[x] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        prefetch_token(j, j->v, table, t + PREFETCH_TOKENS, n, h, h + 1);
        const uint16_t *vr = (const uint16_t *)j->v + (token_row(j, table, t) + h) * VECS * 16;
        for (int c = 0; c < VECS; c++) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * c)));
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
            for (int g = 0; g < GROUP; g++)
                sum[g * VECS + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[(int64_t)g * n + t]), x, sum[g * VECS + c]);
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < VECS; c++) _mm512_storeu_ps(acc + (int64_t)g * VECS * 16 + 16 * c, sum[g * VECS + c]);
}

/* Step 3 head by head for the shapes whose sums fit in registers (query heads per kv head x head_dim /
 * 16 <= 16, common ones listed); 0 for the others, which take the token-by-token loop. */
static int values_in_registers(const job_t *j, const int32_t *table, int n, int h0, int h1, const float *scores,
                               float *acc) {
    const int group = j->q_heads / j->kv_heads, vecs = j->head_dim / 16;
    const int shape = group * 100 + vecs;
    if (shape != 104 && shape != 204 && shape != 404 && shape != 108 && shape != 208) return 0;
    for (int h = h0; h < h1; h++) {
        const int64_t first = (int64_t)(h - h0) * group; /* the kv head's first query head in the item */
        const float *p = scores + first * n;
        float *a = acc + first * j->head_dim;
        switch (shape) {
        case 104: values_of_head(j, table, n, h, p, a, 1, 4); break;
        case 204: values_of_head(j, table, n, h, p, a, 2, 4); break;
        case 404: values_of_head(j, table, n, h, p, a, 4, 4); break;
        case 108: values_of_head(j, table, n, h, p, a, 1, 8); break;
        default: values_of_head(j, table, n, h, p, a, 2, 8); break;
        }
    }
    return 1;
}
#endif

#ifdef HAVE_AVX2
/* dot_key's lane tree for eight keys at once: s[u] holds key u's 16 partial sums folded once (lanes j
 * and j + 8 added, as dot_key's first step), and lane u of the result is the rest of the tree over
 * s[u]'s lanes, ((s_0 + s_4) + (s_2 + s_6)) + ((s_1 + s_5) + (s_3 + s_7)): the same adds, the same bits. */
static inline __m256 sum_lanes8(const __m256 s[8]) {
    __m256 t[4], r[2];
    for (int i = 0; i < 4; i++) /* lanes j + 4 onto j: key 2i in the low half, 2i + 1 in the high one */
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* lanes j + 2 onto j: keys 4i, 4i + 2 low; 4i + 1, 4i + 3 high */
        r[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    /* lane 1 onto lane 0: keys 0, 2, 4, 6 low, 1, 3, 5, 7 high; then into key order */
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(r[0], r[1], 0x88), _mm256_shuffle_ps(r[0], r[1], 0xdd));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Step 1 for float32 rows, the cnt <= 8 tokens from t0: dot_key's products and sums, each key's kept in
 * a vector until sum_lanes8 finishes eight of them together. Writes scores[i * n + t]. */
static void scores8_f32(const job_t *j, const int32_t *table, const float *q, int t0, int cnt, int n, int h0,
                        int heads, float *scores) {
    const int d = j->head_dim, group = j->q_heads / j->kv_heads;
    const float *rows[8];
    for (int u = 0; u < 8; u++) /* past cnt: token t0 again, its sums unused */
        rows[u] = (const float *)j->k + (token_row(j, table, t0 + (u < cnt ? u : 0)) + h0) * d;
    const __m256 scale = _mm256_set1_ps(j->scale);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int i = 0; i < heads; i++) {
        const float *qi = q + (int64_t)i * d;
        __m256 s[8];
        for (int u = 0; u < 8; u++) {
            const float *kr = rows[u] + (int64_t)(i / group) * d;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(); /* dot_key's lanes 0-7 and 8-15 */
            for (int x = 0; x < d; x += LANES) {
                a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(qi + x), _mm256_loadu_ps(kr + x)));
                b = _mm256_add_ps(b, _mm256_mul_ps(_mm256_loadu_ps(qi + x + 8), _mm256_loadu_ps(kr + x + 8)));
            }
            s[u] = _mm256_add_ps(a, b);
        }
        _mm256_maskstore_ps(scores + (int64_t)i * n + t0, live, _mm256_mul_ps(sum_lanes8(s), scale));
    }
}

/* Step 3 for float32 rows of kv head h: G query heads (scores p, sums acc, rows of n and head_dim) over
 * the V 8-float vectors of dimensions from x0, the sums in registers; add_value's multiplies and adds in
 * its token order, so the same bits. `ask`: prefetch the values ahead (the head's first pass). */
static inline __attribute__((always_inline)) void values_f32(const job_t *j, const int32_t *table, int n, int h,
                                                             const float *p, float *acc, int x0, int ask,
                                                             const int G, const int V) {
    const int d = j->head_dim;
    __m256 sum[12];
    for (int x = 0; x < G * V; x++) sum[x] = _mm256_setzero_ps();
    for (int t = 0; t < n; t++) {
        if (ask) prefetch_token(j, j->v, table, t + PREFETCH_TOKENS, n, h, h + 1);
        const float *vr = (const float *)j->v + (token_row(j, table, t) + h) * d + x0;
        __m256 w[3];
        for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(p[(int64_t)g * n + t]);
        for (int c = 0; c < V; c++) {
            const __m256 x = _mm256_loadu_ps(vr + 8 * c);
            for (int g = 0; g < G; g++) sum[g * V + c] = _mm256_add_ps(sum[g * V + c], _mm256_mul_ps(w[g], x));
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < V; c++) _mm256_storeu_ps(acc + (int64_t)g * d + x0 + 8 * c, sum[g * V + c]);
}

/* Step 3 for float32 rows, kv head by kv head: up to three of its query heads at a time, 32 dimensions
 * at a time (16 where head_dim leaves them), twelve sums or fewer in registers. */
static void values_f32_heads(const job_t *j, const int32_t *table, int n, int h0, int h1, const float *scores,
                             float *acc) {
    const int group = j->q_heads / j->kv_heads, d = j->head_dim;
    for (int h = h0; h < h1; h++)
        for (int g0 = 0; g0 < group; g0 += 3) {
            const int64_t first = (int64_t)(h - h0) * group + g0; /* the pass's first query head in the item */
            const float *p = scores + first * n;
            float *a = acc + first * d;
            const int heads = group - g0 < 3 ? group - g0 : 3;
            for (int x0 = 0; x0 < d; x0 += 32) {
                const int ask = g0 == 0 && x0 == 0, shape = heads * 10 + (d - x0 >= 32 ? 4 : 2);
                switch (shape) {
                case 14: values_f32(j, table, n, h, p, a, x0, ask, 1, 4); break;
                case 12: values_f32(j, table, n, h, p, a, x0, ask, 1, 2); break;
                case 24: values_f32(j, table, n, h, p, a, x0, ask, 2, 4); break;
                case 22: values_f32(j, table, n, h, p, a, x0, ask, 2, 2); break;
                case 34: values_f32(j, table, n, h, p, a, x0, ask, 3, 4); break;
                default: values_f32(j, table, n, h, p, a, x0, ask, 3, 2); break;
                }
            }
        }
}
#endif

/* One work item: query heads [qh0, qh1) of one row, over the kv heads they share. Scratch holds
 * (qh1 - qh0) * (ctx + head_dim * 2) floats. Keys and values are read token by token, each token's
 * kv heads of the range being contiguous, so the reads stream through every block in order. */
static void attend_item(const job_t *j, int item, float *scratch) {
    const int row = item / j->parts, part = item % j->parts;
    const int group = j->q_heads / j->kv_heads, d = j->head_dim;
    const int h0 = j->kv_heads * part / j->parts, h1 = j->kv_heads * (part + 1) / j->parts;
    const int heads = (h1 - h0) * group, qh0 = h0 * group;
    const int n = j->ctx_lens[row];
    const int32_t *table = j->tables + (int64_t)j->row_seq[row] * j->tables_stride;
    float *q = scratch, *acc = q + (int64_t)heads * d, *scores = acc + (int64_t)heads * d;

    for (int i = 0; i < heads; i++) {
        load_row(j->q, (int64_t)j->row_token[row] * j->q_stride + (int64_t)(qh0 + i) * d, d, j->dtype,
                 q + (int64_t)i * d);
        memset(acc + (int64_t)i * d, 0, (size_t)d * sizeof(float));
    }
    /* 1. scores of every cached key against the queries that share its kv head */
    const uint16_t *q16 = (const uint16_t *)j->q + (int64_t)j->row_token[row] * j->q_stride + (int64_t)qh0 * d;
#ifdef HAVE_AVX512_BF16
    if (bf16_fast(j->dtype, d)) {
        for (int t0 = 0; t0 < n; t0 += 16) {
            for (int u = 0; u < 16; u++) prefetch_token(j, j->k, table, t0 + 16 + u, n, h0, h1);
            scores16(j, table, q16, t0, n - t0 < 16 ? n - t0 : 16, n, h0, heads, scores);
        }
    } else
#endif
#ifdef HAVE_AVX2
    if (f32_fast(j->dtype)) {
        for (int t0 = 0; t0 < n; t0 += 8) {
            for (int u = 0; u < 8; u++) prefetch_token(j, j->k, table, t0 + PREFETCH_TOKENS + u, n, h0, h1);
            scores8_f32(j, table, q, t0, n - t0 < 8 ? n - t0 : 8, n, h0, heads, scores);
        }
    } else
#endif
        for (int t = 0; t < n; t++) {
            const int64_t base = token_row(j, table, t);
            prefetch_token(j, j->k, table, t + PREFETCH_TOKENS, n, h0, h1);
            for (int i = 0; i < heads; i++) {
                const int64_t off = (base + h0 + i / group) * d;
                scores[(int64_t)i * n + t] =
                    dot_key(q + (int64_t)i * d, q16 + (int64_t)i * d, j->k, off, d, j->dtype) * j->scale;
            }
        }
    /* 2. softmax weights, unnormalised */
    for (int i = 0; i < heads; i++) {
        float *s = scores + (int64_t)i * n, top = -FLT_MAX, sum = 0.0f;
        for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < n; t++) s[t] = exp_approx(s[t] - top);
        for (int t = 0; t < n; t++) sum += s[t];
        q[(int64_t)i * d] = 1.0f / sum; /* the query row is no longer needed: keep 1/sum there */
    }
    /* 3. weighted sum of values */
#ifdef HAVE_AVX512_BF16
    int done = bf16_fast(j->dtype, d) && values_in_registers(j, table, n, h0, h1, scores, acc);
#else
    int done = 0;
#endif
#ifdef HAVE_AVX2
    if (!done && f32_fast(j->dtype)) {
        values_f32_heads(j, table, n, h0, h1, scores, acc);
        done = 1;
    }
#endif
    for (int t = 0; t < n && !done; t++) {
        const int64_t base = token_row(j, table, t);
        prefetch_token(j, j->v, table, t + PREFETCH_TOKENS, n, h0, h1);
        for (int i = 0; i < heads; i++) {
            const int64_t off = (base + h0 + i / group) * d;
            add_value(acc + (int64_t)i * d, scores[(int64_t)i * n + t], j->v, off, d, j->dtype);
        }
    }
    for (int i = 0; i < heads; i++) {
        const float inv = q[(int64_t)i * d];
        const float *a = acc + (int64_t)i * d;
        const int64_t o = ((int64_t)j->row_token[row] * j->q_heads + qh0 + i) * d;
        if (j->dtype == 1) {
            uint16_t *dst = (uint16_t *)j->out + o;
            for (int x = 0; x < d; x++) dst[x] = f32_to_bf16(a[x] * inv);
        } else {
            float *dst = (float *)j->out + o;
            for (int x = 0; x < d; x++) dst[x] = a[x] * inv;
        }
    }
}

/* Returns 0 on success, 1 on bad arguments, 2 when scratch memory could not be had. */
int pd_paged_decode_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                              const int32_t *tables, int64_t tables_stride, const int32_t *row_token,
                              const int32_t *row_seq, const int32_t *ctx_lens, void *out, int rows,
                              int q_heads, int kv_heads, int head_dim, int block_size, float scale,
                              int dtype, int threads) {
    if (rows < 0 || kv_heads <= 0 || q_heads % kv_heads != 0 || q_heads / kv_heads > MAX_GROUP ||
        head_dim <= 0 || head_dim > MAX_HEAD_DIM || head_dim % LANES != 0 || block_size <= 0 ||
        (dtype != 0 && dtype != 1))
        return 1;
    int longest = 0;
    for (int r = 0; r < rows; r++) {
        if (ctx_lens[r] <= 0) return 1;
        if (ctx_lens[r] > longest) longest = ctx_lens[r];
    }
    if (threads < 1) threads = 1;
    int parts = rows >= threads ? 1 : (threads + rows - 1) / (rows > 0 ? rows : 1);
    if (parts > kv_heads) parts = kv_heads;
    const job_t job = {q, k, v, tables, row_token, row_seq, ctx_lens, out, q_stride, tables_stride,
                       rows, q_heads, kv_heads, head_dim, block_size, dtype, scale, parts};
    const int items = rows * parts;
    const size_t most_heads = (size_t)((kv_heads + parts - 1) / parts * (q_heads / kv_heads));
    const size_t scratch_floats = most_heads * ((size_t)longest + 2 * (size_t)head_dim);
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : status)
#endif
    {
        float *scratch = (float *)malloc(scratch_floats * sizeof(float));
        if (scratch == NULL) status = 2; /* this thread's items are skipped; the caller sees 2 */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int item = 0; item < items; item++)
            if (scratch != NULL) attend_item(&job, item, scratch);
        free(scratch);
    }
    return status;
}

/* pd_paged_decode_attention for float32 rows with the arguments of the prompt kernels' pd_paged_decode_rows,
 * for decoder_cpu.c on CPUs whose float32 decode rows take this kernel (no AVX-512: paged_attention_cpu.py). */
int pd_paged_decode_rows_f32(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *tables,
                             int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                             const int32_t *ctx_lens, void *out, int rows, int q_heads, int kv_heads, int head_dim,
                             int block_size, float scale, int threads) {
    return pd_paged_decode_attention(q, q_stride, k, v, tables, tables_stride, row_token, row_seq, ctx_lens, out,
                                     rows, q_heads, kv_heads, head_dim, block_size, scale, 0, threads);
}

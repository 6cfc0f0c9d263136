/* Causal attention of one sequence's prompt chunk over its paged cache, float32, in plain C that the
 * compiler vectorises for the CPU at hand (AVX2, AVX-512): the float32 twin of paged_prefill_cpu.c,
 * for CPUs without native bfloat16, where models compute in float32.
 *
 * The chunk's q_len queries are the last q_len of the sequence's seq_len cached tokens; query i
 * attends to keys 0 .. seq_len - q_len + i. As in the bfloat16 kernel:
 *   1. pack: each kv head's keys are read once through the block table into 16-key panels
 *      [dim][key], its values into contiguous rows [key][dim];
 *   2. tiles: work items are (kv head, 16 query tokens), rows = tokens x the query heads sharing the
 *      kv head; scores = Q K^T in MR-row x 16-key register blocks for every key the tile can see, an
 *      exact softmax per row with its causal limit, then P V in MR-row x 16-dim blocks (P stays
 *      float32);
 *   3. each output row is divided by its sum.
 * Every sum has a fixed order: the result does not depend on the thread count. pd_paged_decode_rows
 * (built with AVX-512 only) runs decode rows through the same steps as one-token chunks, so a
 * position gets the same bits whether it was decoded or prefilled.
 *
 * Layouts (element strides): q [q_len, q_heads, head_dim] with token stride q_stride, heads
 * contiguous; k, v [num_blocks, block_size, kv_heads, head_dim] contiguous; out [q_len, q_heads,
 * head_dim] contiguous.
 */
/* The softmax's max and exp loops vectorise only when the compiler may ignore infinities, NaN and the
 * sign of zero in float comparisons (GCC; others leave them scalar). Scores are finite and the running
 * maximum starts at -FLT_MAX. */
#pragma GCC optimize("finite-math-only", "no-signed-zeros")
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_avx512.h"
#include "cpu_scalar.h"

#define TILE_TOKENS 16
#define PANEL 16 /* keys per packed panel, and output dims per P V block */
#if defined(__AVX512F__)
#define MR 8 /* query rows per register block: 8 x 16 floats are 8 zmm accumulators */
#else
#define MR 4 /* 4 x 16 floats are 8 ymm accumulators */
#endif
#define MAX_GROUP 16

int pd_prefill_f32_supported(int head_dim) { return head_dim > 0 && head_dim <= 256 && head_dim % PANEL == 0; }

typedef struct {
    const float *q, *k, *v;
    const int32_t *table;
    float *out;
    int64_t q_stride;
    int q_len, seq_len, q_heads, kv_heads, head_dim, block_size;
    float scale;
    int64_t keys_padded; /* seq_len rounded up to PANEL */
    float *kp, *vp;      /* packed keys and values, kv_heads of each */
} job_t;

static inline int64_t head_size(const job_t *j) { return j->keys_padded * j->head_dim; }

/* Where token t's row of kv head h starts in the cache (in elements). */
static inline int64_t cache_row(const job_t *j, int t, int h) {
    return (((int64_t)j->table[t / j->block_size] * j->block_size + t % j->block_size) * j->kv_heads + h) *
           j->head_dim;
}

/* Step 1 for kv head h into kp and vp: keys to panels [key / PANEL][dim][key % PANEL] (with AVX-512,
 * sixteen keys that share a cache block go through a register transpose), values to rows [key][dim];
 * the keys' last panel is zero past seq_len (values past it are never read). */
static void pack_head(const job_t *j, int h, float *kp, float *vp) {
    const int d = j->head_dim, n = j->seq_len;
    if (n < j->keys_padded) memset(kp + (int64_t)(n / PANEL) * PANEL * d, 0, (size_t)PANEL * d * sizeof *kp);
    int t = 0;
#if defined(__AVX512F__)
    for (; t + PANEL <= n && j->block_size % PANEL == 0; t += PANEL) {
        const uint32_t *rows = (const uint32_t *)(j->k + cache_row(j, t, h));
        const int64_t stride = (int64_t)j->kv_heads * d; /* words from one token's row to the next */
        float *panel = kp + (int64_t)t * d;
        for (int c0 = 0; c0 < d; c0 += 16) {
            __m512i r[16];
            for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_si512(rows + u * stride + c0);
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(panel + (int64_t)(c0 + c) * PANEL, r[c]);
        }
    }
#endif
    for (; t < n; t++) {
        const float *krow = j->k + cache_row(j, t, h);
        float *panel = kp + (int64_t)(t / PANEL) * PANEL * d + t % PANEL;
        for (int c = 0; c < d; c++) panel[c * PANEL] = krow[c];
    }
    int block = 0, slot = 0; /* where token t lies, stepped along: a division per token costs more than the copy */
    for (t = 0; t < n; t++) {
        memcpy(vp + (int64_t)t * d, j->v + (((int64_t)j->table[block] * j->block_size + slot) * j->kv_heads + h) * d,
               (size_t)d * sizeof *vp);
        if (++slot == j->block_size) slot = 0, block++;
    }
}

/* The CPU's own vector of floats: 16 (a zmm) with AVX-512, 8 (a ymm) elsewhere (GCC vector extensions;
 * aligned(4) lets it be loaded from and stored to any float address). A 16-float panel row is NV of them:
 * a 64-byte vector type on AVX2 was lowered through the stack (a 512-token prompt at 7 GFLOP/s). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NV (PANEL / VW)
typedef float vecw __attribute__((vector_size(VW * 4), aligned(4)));

/* s[m][0:PANEL] = scale * q[m] . k for MR query rows against one key panel. */
static inline void qk_block(const float *q, int d, const float *panel, float scale, float *s, int64_t lds) {
    vecw acc[MR][NV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = (vecw){0};
    for (int c = 0; c < d; c++) {
        vecw b[NV];
        for (int v = 0; v < NV; v++) b[v] = *(const vecw *)(panel + c * PANEL + v * VW);
        for (int m = 0; m < MR; m++)
            for (int v = 0; v < NV; v++) acc[m][v] += q[m * d + c] * b[v];
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) *(vecw *)(s + m * lds + v * VW) = acc[m][v] * scale;
}

/* o[m][c0:c0+PANEL] = sum over keys of p[m][t] * v[t][c0:c0+PANEL], for MR rows. */
static inline void pv_block(const float *p, int64_t ldp, int keys, const float *vp, int d, int c0, float *o) {
    vecw acc[MR][NV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = (vecw){0};
    for (int t = 0; t < keys; t++) {
        vecw b[NV];
        for (int v = 0; v < NV; v++) b[v] = *(const vecw *)(vp + (int64_t)t * d + c0 + v * VW);
        for (int m = 0; m < MR; m++)
            for (int v = 0; v < NV; v++) acc[m][v] += p[m * ldp + t] * b[v];
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) *(vecw *)(o + m * d + c0 + v * VW) = acc[m][v];
}

/* Exact softmax weights of s[0:n] in place, zero from n to width; returns 1 / their sum. */
static float softmax_row(float *s, int n, int width) {
    float top = -FLT_MAX, sum = 0.0f;
    for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
    for (int t = 0; t < n; t++) s[t] = exp_approx(s[t] - top);
    for (int t = 0; t < n; t++) sum += s[t];
    memset(s + n, 0, (size_t)(width - n) * sizeof *s);
    return n > 0 ? 1.0f / sum : 0.0f;
}

/* Steps 2 and 3 for one work item: kv head h (packed in kp, vp), query tokens [t0, t0 + TILE_TOKENS). */
static void attend_tile(const job_t *j, int h, int t0, const float *kp, const float *vp, float *scores,
                        float *qpack, float *o) {
    const int d = j->head_dim, group = j->q_heads / j->kv_heads;
    const int tokens = j->q_len - t0 < TILE_TOKENS ? j->q_len - t0 : TILE_TOKENS;
    const int rows = tokens * group, rows_padded = (rows + MR - 1) / MR * MR;
    const int past = j->seq_len - j->q_len;
    const int keys = past + t0 + tokens;
    const int panels = (keys + PANEL - 1) / PANEL;
    const int64_t lds = (int64_t)panels * PANEL;

    memset(qpack, 0, (size_t)rows_padded * d * sizeof *qpack);
    for (int r = 0; r < rows; r++) {
        const float *src = j->q + (int64_t)(t0 + r / group) * j->q_stride + (int64_t)(h * group + r % group) * d;
        memcpy(qpack + (int64_t)r * d, src, (size_t)d * sizeof *src);
    }
    for (int m = 0; m < rows_padded; m += MR)
        for (int b = 0; b < panels; b++)
            qk_block(qpack + (int64_t)m * d, d, kp + (int64_t)b * PANEL * d, j->scale, scores + m * lds + b * PANEL,
                     lds);
    float inv[TILE_TOKENS * MAX_GROUP + MR];
    for (int r = 0; r < rows_padded; r++)
        inv[r] = softmax_row(scores + r * lds, r < rows ? past + t0 + r / group + 1 : 0, (int)lds);
    for (int m = 0; m < rows_padded; m += MR)
        for (int c0 = 0; c0 < d; c0 += PANEL) pv_block(scores + m * lds, lds, keys, vp, d, c0, o + (int64_t)m * d);
    for (int r = 0; r < rows; r++) {
        float *dst = j->out + ((int64_t)(t0 + r / group) * j->q_heads + h * group + r % group) * d;
        for (int c = 0; c < d; c++) dst[c] = o[(int64_t)r * d + c] * inv[r];
    }
}

/* Returns 0 on success, 1 on bad arguments, 2 when memory could not be had, 3 for an unsupported
 * head_dim (see pd_prefill_f32_supported). */
int pd_paged_prefill_f32(const float *q, int64_t q_stride, const float *k, const float *v, const int32_t *table,
                         float *out, int q_len, int seq_len, int q_heads, int kv_heads, int head_dim,
                         int block_size, float scale, int threads) {
    if (q_len <= 0 || seq_len < q_len || kv_heads <= 0 || q_heads % kv_heads != 0 ||
        q_heads / kv_heads > MAX_GROUP || block_size <= 0 || q_stride < (int64_t)q_heads * head_dim)
        return 1;
    if (!pd_prefill_f32_supported(head_dim)) return 3;
    if (threads < 1) threads = 1;
    job_t job = {q, k, v, table, out, q_stride, q_len, seq_len, q_heads, kv_heads, head_dim, block_size,
                 scale, (int64_t)(seq_len + PANEL - 1) / PANEL * PANEL, NULL, NULL};
    job.kp = (float *)malloc((size_t)head_size(&job) * 2 * kv_heads * sizeof(float));
    if (job.kp == NULL) return 2;
    job.vp = job.kp + head_size(&job) * kv_heads;
    const int group = q_heads / kv_heads, tiles = (q_len + TILE_TOKENS - 1) / TILE_TOKENS;
    const size_t rows_padded = (size_t)(TILE_TOKENS * group + MR - 1) / MR * MR;
    int status = 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++) pack_head(&job, h, job.kp + h * head_size(&job), job.vp + h * head_size(&job));
        float *scores = (float *)malloc(rows_padded * ((size_t)job.keys_padded + 2 * (size_t)head_dim) * sizeof(float));
        if (scores == NULL) status = 2;
        float *qpack = scores + rows_padded * (size_t)job.keys_padded, *o = qpack + rows_padded * (size_t)head_dim;
        /* one head's tiles in a row, so its packed keys and values stay in this core's cache; later
         * tiles see more keys, so each head's are handed out from the end, dynamically */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * tiles; item++) {
            const int h = item / tiles, tile = tiles - 1 - item % tiles;
            if (scores != NULL)
                attend_tile(&job, h, tile * TILE_TOKENS, job.kp + h * head_size(&job), job.vp + h * head_size(&job),
                            scores, qpack, o);
        }
        free(scores);
    }
    free(job.kp);
    return status;
}

#if defined(__AVX512F__)
#include "cpu_decode_rows.h"

/* Decode rows run through this kernel only with AVX-512: on AVX2 a decode row here took 1.5-1.8x the
 * decode kernel's time from 8 rows on (7 times before the blocks took the native width), so there
 * decode rows stay on paged_decode_cpu.c and the library has no pd_paged_decode_rows. */

/* Decode rows with this kernel's arithmetic, as pd_paged_decode_rows in paged_prefill_cpu.c: row r is
 * token row_token[r] of q, the last of the ctx_lens[r] cached tokens of sequence row_seq[r] (block
 * table tables[row_seq[r]]); each of its kv heads is packed and attended as a one-token chunk, so a
 * decode row gets to the bit what a prompt chunk ending at the same token gets. Layouts as
 * pd_paged_decode_attention's (paged_decode_cpu.c). Returns 0 on success, 1 on bad arguments, 2 when
 * memory could not be had, 3 for an unsupported head_dim. */
int pd_paged_decode_rows(const float *q, int64_t q_stride, const float *k, const float *v, const int32_t *tables,
                         int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                         const int32_t *ctx_lens, float *out, int rows, int q_heads, int kv_heads, int head_dim,
                         int block_size, float scale, int threads) {
    rows_plan_t plan;
    if (plan_rows(ctx_lens, rows, q_heads, kv_heads, head_dim, block_size, q_stride, MAX_GROUP, threads, &plan))
        return 1;
    if (!pd_prefill_f32_supported(head_dim)) return 3;
    const int parts = plan.parts, items = plan.items;
    const int group = q_heads / kv_heads, rows_padded = (group + MR - 1) / MR * MR;
    const size_t lds = (size_t)(plan.longest + PANEL - 1) / PANEL * PANEL;
    const size_t floats = 2 * lds * (size_t)head_dim + (size_t)rows_padded * (lds + 2 * (size_t)head_dim);
    int status = 0;
#pragma omp parallel num_threads(plan.threads) reduction(| : status)
    {
        float *kp = (float *)thread_scratch(floats * sizeof(float));
        if (kp == NULL) status = 2;
        float *vp = kp + lds * (size_t)head_dim, *scores = vp + lds * (size_t)head_dim;
        float *qpack = scores + (size_t)rows_padded * lds, *o = qpack + (size_t)rows_padded * head_dim;
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int r = item / parts, h0 = parts == 1 ? 0 : item % parts, h1 = parts == 1 ? kv_heads : h0 + 1;
            const int n = ctx_lens[r];
            const job_t job = {q + (int64_t)row_token[r] * q_stride, k, v, tables + (int64_t)row_seq[r] * tables_stride,
                               out + (int64_t)row_token[r] * q_heads * head_dim, q_stride, 1, n, q_heads, kv_heads,
                               head_dim, block_size, scale, (int64_t)(n + PANEL - 1) / PANEL * PANEL, NULL, NULL};
            for (int h = h0; h < h1 && kp != NULL; h++) {
                pack_head(&job, h, kp, vp);
                attend_tile(&job, h, 0, kp, vp, scores, qpack, o);
            }
        }
    }
    return status;
}
#endif /* __AVX512F__ */

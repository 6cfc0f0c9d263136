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
 * Every sum has a fixed order: the result does not depend on the thread count.
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

/* Step 1 for kv head h: keys to panels [key / PANEL][dim][key % PANEL], values to rows; zero past seq_len. */
static void pack_head(const job_t *j, int h) {
    const int d = j->head_dim;
    float *kp = j->kp + h * head_size(j), *vp = j->vp + h * head_size(j);
    memset(kp, 0, (size_t)head_size(j) * sizeof *kp);
    memset(vp, 0, (size_t)head_size(j) * sizeof *vp);
    for (int t = 0; t < j->seq_len; t++) {
        const int64_t row = ((int64_t)j->table[t / j->block_size] * j->block_size + t % j->block_size) *
                                j->kv_heads + h;
        float *panel = kp + (int64_t)(t / PANEL) * PANEL * d + t % PANEL;
        for (int c = 0; c < d; c++) panel[c * PANEL] = j->k[row * d + c];
        memcpy(vp + (int64_t)t * d, j->v + row * d, (size_t)d * sizeof *vp);
    }
}

/* 16 floats as one value: one zmm with AVX-512, two ymm with AVX2 (GCC vector extensions); aligned(4)
 * lets it be loaded from and stored to any float address. */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));

/* s[m][0:PANEL] = scale * q[m] . k for MR query rows against one key panel. */
static inline void qk_block(const float *q, int d, const float *panel, float scale, float *s, int64_t lds) {
    vec16 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = (vec16){0};
    for (int c = 0; c < d; c++) {
        const vec16 b = *(const vec16 *)(panel + c * PANEL);
        for (int m = 0; m < MR; m++) acc[m] += q[m * d + c] * b;
    }
    for (int m = 0; m < MR; m++) *(vec16 *)(s + m * lds) = acc[m] * scale;
}

/* o[m][c0:c0+PANEL] = sum over keys of p[m][t] * v[t][c0:c0+PANEL], for MR rows. */
static inline void pv_block(const float *p, int64_t ldp, int keys, const float *vp, int d, int c0, float *o) {
    vec16 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = (vec16){0};
    for (int t = 0; t < keys; t++) {
        const vec16 b = *(const vec16 *)(vp + (int64_t)t * d + c0);
        for (int m = 0; m < MR; m++) acc[m] += p[m * ldp + t] * b;
    }
    for (int m = 0; m < MR; m++) *(vec16 *)(o + m * d + c0) = acc[m];
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

/* Steps 2 and 3 for one work item: kv head h, query tokens [t0, t0 + TILE_TOKENS). */
static void attend_tile(const job_t *j, int h, int t0, float *scores, float *qpack, float *o) {
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
    const float *kp = j->kp + h * head_size(j), *vp = j->vp + h * head_size(j);
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
        for (int h = 0; h < kv_heads; h++) pack_head(&job, h);
        float *scores = (float *)malloc(rows_padded * ((size_t)job.keys_padded + 2 * (size_t)head_dim) * sizeof(float));
        if (scores == NULL) status = 2;
        float *qpack = scores + rows_padded * (size_t)job.keys_padded, *o = qpack + rows_padded * (size_t)head_dim;
        /* one head's tiles in a row, so its packed keys and values stay in this core's cache; later
         * tiles see more keys, so each head's are handed out from the end, dynamically */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * tiles; item++) {
            const int h = item / tiles, tile = tiles - 1 - item % tiles;
            if (scores != NULL) attend_tile(&job, h, tile * TILE_TOKENS, scores, qpack, o);
        }
        free(scores);
    }
    free(job.kp);
    return status;
}

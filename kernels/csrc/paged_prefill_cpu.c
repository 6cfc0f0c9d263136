/* Causal attention of one sequence's prompt chunk over its paged cache, bfloat16 on AVX512-BF16 CPUs.
 *
 * The chunk's q_len queries are the last q_len of the sequence's seq_len cached tokens; query i
 * attends to keys 0 .. seq_len - q_len + i. Three steps:
 *   1. pack: each kv head's keys and values are read once through the block table into layouts that
 *      VDPBF16PS consumes (pairs of bfloat16 in one 32-bit lane): keys as 64-key panels
 *      [pair of dims][key], values as [pair of keys][dim];
 *   2. tiles: work items are (kv head, 16 query tokens); an item's rows are its tokens times the
 *      query heads sharing the kv head. Scores = Q K^T for every key the tile can see (float32),
 *      then an exact softmax per row (its causal limit applied), then P V with P in bfloat16;
 *   3. the output row is divided by the row's float32 sum and rounded to bfloat16.
 * A tile sees all its keys at once (scores for 2 x 16 rows of a 2048-token prompt are 256 KiB, in
 * L2), so there is no online rescaling, and every sum has a fixed order: the result does not depend
 * on the thread count.
 *
 * Layouts (element strides):
 *   q:      [q_len, q_heads, head_dim] bfloat16, token stride q_stride, heads contiguous
 *   k, v:   [num_blocks, block_size, kv_heads, head_dim] bfloat16 contiguous (one layer)
 *   table:  the sequence's block ids (int32)
 *   out:    [q_len, q_heads, head_dim] bfloat16 contiguous
 *
 * Built by kernels/cpu_build.py with -O3 -march=native -fopenmp. On a CPU without AVX512-BF16 the
 * library still builds and pd_prefill_supported() returns 0: callers keep their fallback.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define TILE_TOKENS 16 /* query tokens per work item */
#define MR 4           /* query rows per register block */
#define PANEL 64       /* keys per packed key panel: four 16-lane vectors */
#define DIM_STEP 64    /* output dims per register block of P V */
#define MAX_GROUP 16

/* Whether this build serves heads of head_dim: AVX512-BF16, and whole 64-dim register blocks of P V. */
int pd_prefill_supported(int head_dim) {
#ifdef HAVE_AVX512_BF16
    return head_dim > 0 && head_dim <= 256 && head_dim % DIM_STEP == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

#ifdef HAVE_AVX512_BF16

/* exp(x) for x <= 0 in 16 lanes: the decode kernel's polynomial (within 2 ulp of expf), 2^n by scalef */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                          _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Softmax weights of one row of scores s[0:n] (n >= 1) into probs[0:width] in bfloat16, zero past n;
 * returns 1 / (their float32 sum). width is a multiple of 16 and s is readable up to it. */
static float softmax_row(const float *s, uint16_t *probs, int n, int width) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(s + t));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    int t = 0;
    for (; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 w = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t), peak)));
        sum = _mm512_add_ps(sum, w);
        _mm256_storeu_si256((__m256i *)(probs + t), (__m256i)_mm512_cvtneps_pbh(w));
    }
    memset(probs + t, 0, (size_t)(width - t) * sizeof *probs);
    return 1.0f / _mm512_reduce_add_ps(sum);
}

typedef struct {
    const uint16_t *q, *k, *v;
    const int32_t *table;
    uint16_t *out;
    int64_t q_stride;
    int q_len, seq_len, q_heads, kv_heads, head_dim, block_size;
    float scale;
    int64_t keys_padded;    /* seq_len rounded up to PANEL */
    uint32_t *kp, *vp;      /* packed keys and values, kv_heads of each */
} job_t;

static inline int64_t kp_size(const job_t *j) { return j->keys_padded * (j->head_dim / 2); }
static inline int64_t vp_size(const job_t *j) { return j->keys_padded / 2 * j->head_dim; }

/* Step 1 for kv head h: keys to panels [key / PANEL][dim pair][key % PANEL], values to
 * [key pair][dim] with the even key in the low half; zeros past seq_len. */
static void pack_head(const job_t *j, int h) {
    const int d = j->head_dim, pairs = d / 2;
    uint32_t *kp = j->kp + h * kp_size(j), *vp = j->vp + h * vp_size(j);
    memset(kp, 0, (size_t)kp_size(j) * sizeof *kp);
    memset(vp, 0, (size_t)vp_size(j) * sizeof *vp);
    for (int t = 0; t < j->seq_len; t++) {
        const int64_t row = ((int64_t)j->table[t / j->block_size] * j->block_size + t % j->block_size) *
                                j->kv_heads + h;
        const uint32_t *krow = (const uint32_t *)(j->k + row * d);
        uint32_t *panel = kp + (int64_t)(t / PANEL) * PANEL * pairs + t % PANEL;
        for (int p = 0; p < pairs; p++) panel[p * PANEL] = krow[p];
        const uint16_t *vrow = j->v + row * d;
        uint16_t *dst = (uint16_t *)(vp + (int64_t)(t / 2) * d) + (t & 1);
        for (int c = 0; c < d; c++) dst[2 * c] = vrow[c];
    }
}

/* Scores of MR packed query rows against one key panel: s[m][0:PANEL] = scale * q[m] . k. */
static inline void qk_block(const uint32_t *q, int pairs, const uint32_t *panel, float scale, float *s,
                            int64_t lds) {
    __m512 acc[MR][4];
    for (int m = 0; m < MR; m++)
        for (int x = 0; x < 4; x++) acc[m][x] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint32_t *kr = panel + p * PANEL;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kr), b1 = (__m512bh)_mm512_loadu_si512(kr + 16);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(kr + 32), b3 = (__m512bh)_mm512_loadu_si512(kr + 48);
        for (int m = 0; m < MR; m++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[m * pairs + p]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < MR; m++)
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(s + m * lds + 16 * x, _mm512_mul_ps(acc[m][x], sc));
}

/* o[m][c0:c0+DIM_STEP] = sum over key pairs of P's pair times the values' pair, for MR rows. */
static inline void pv_block(const uint32_t *p, int64_t ldp, int key_pairs, const uint32_t *vp, int d, int c0,
                            float *o, int ldo) {
    __m512 acc[MR][4];
    for (int m = 0; m < MR; m++)
        for (int x = 0; x < 4; x++) acc[m][x] = _mm512_setzero_ps();
    for (int kp = 0; kp < key_pairs; kp++) {
        const uint32_t *vr = vp + (int64_t)kp * d + c0;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(vr), b1 = (__m512bh)_mm512_loadu_si512(vr + 16);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(vr + 32), b3 = (__m512bh)_mm512_loadu_si512(vr + 48);
        for (int m = 0; m < MR; m++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)p[m * ldp + kp]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(o + m * ldo + c0 + 16 * x, acc[m][x]);
}

/* Step 2 and 3 for one work item: kv head h, query tokens [t0, t0 + TILE_TOKENS). */
static void attend_tile(const job_t *j, int h, int t0, float *scores, uint16_t *probs, uint32_t *qpack,
                        float *o, float *inv) {
    const int d = j->head_dim, pairs = d / 2, group = j->q_heads / j->kv_heads;
    const int tokens = j->q_len - t0 < TILE_TOKENS ? j->q_len - t0 : TILE_TOKENS;
    const int rows = tokens * group, rows_padded = (rows + MR - 1) / MR * MR;
    const int past = j->seq_len - j->q_len; /* cached tokens before the chunk */
    const int keys = past + t0 + tokens;     /* the most any row of the tile sees */
    const int panels = (keys + PANEL - 1) / PANEL;
    const int64_t lds = (int64_t)panels * PANEL; /* row stride of scores and probs */

    /* the tile's queries, row r = token r / group of head h * group + r % group; zero padding rows */
    memset(qpack, 0, (size_t)rows_padded * pairs * sizeof *qpack);
    for (int r = 0; r < rows; r++) {
        const uint16_t *src = j->q + (int64_t)(t0 + r / group) * j->q_stride + (int64_t)(h * group + r % group) * d;
        memcpy(qpack + (int64_t)r * pairs, src, (size_t)d * sizeof *src);
    }
    const uint32_t *kp = j->kp + h * kp_size(j), *vp = j->vp + h * vp_size(j);
    for (int m = 0; m < rows_padded; m += MR)
        for (int b = 0; b < panels; b++)
            qk_block(qpack + (int64_t)m * pairs, pairs, kp + (int64_t)b * PANEL * pairs, j->scale,
                     scores + m * lds + (int64_t)b * PANEL, lds);

    /* exact softmax per row over its causal range; probabilities past the range are zero */
    for (int r = 0; r < rows_padded; r++) {
        if (r < rows)
            inv[r] = softmax_row(scores + r * lds, probs + r * lds, past + t0 + r / group + 1, (int)lds);
        else
            memset(probs + r * lds, 0, (size_t)lds * sizeof *probs);
    }
    const int key_pairs = (keys + 1) / 2;
    for (int m = 0; m < rows_padded; m += MR)
        for (int c0 = 0; c0 < d; c0 += DIM_STEP)
            pv_block((const uint32_t *)(probs + m * lds), lds / 2, key_pairs, vp, d, c0, o + (int64_t)m * d, d);

    for (int r = 0; r < rows; r++) {
        uint16_t *dst = j->out + ((int64_t)(t0 + r / group) * j->q_heads + h * group + r % group) * d;
        const __m512 scale = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * d + c), scale)));
    }
}

#endif /* HAVE_AVX512_BF16 */

/* Returns 0 on success, 1 on bad arguments, 2 when memory could not be had, 3 when this CPU or
 * head_dim is not supported (see pd_prefill_supported). */
int pd_paged_prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                               const int32_t *table, void *out, int q_len, int seq_len, int q_heads,
                               int kv_heads, int head_dim, int block_size, float scale, int threads) {
    if (q_len <= 0 || seq_len < q_len || kv_heads <= 0 || q_heads % kv_heads != 0 ||
        q_heads / kv_heads > MAX_GROUP || block_size <= 0 || q_stride < (int64_t)q_heads * head_dim)
        return 1;
    if (!pd_prefill_supported(head_dim)) return 3;
#ifdef HAVE_AVX512_BF16
    if (threads < 1) threads = 1;
    job_t job = {q, k, v, table, out, q_stride, q_len, seq_len, q_heads, kv_heads, head_dim, block_size,
                 scale, (int64_t)(seq_len + PANEL - 1) / PANEL * PANEL, NULL, NULL};
    job.kp = (uint32_t *)malloc((size_t)(kp_size(&job) + vp_size(&job)) * kv_heads * sizeof(uint32_t));
    if (job.kp == NULL) return 2;
    job.vp = job.kp + kp_size(&job) * kv_heads;
    const int group = q_heads / kv_heads, tiles = (q_len + TILE_TOKENS - 1) / TILE_TOKENS;
    const int rows_padded = (TILE_TOKENS * group + MR - 1) / MR * MR;
    const size_t lds = (size_t)job.keys_padded;
    int status = 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++) pack_head(&job, h);
        float *scores = (float *)malloc(rows_padded * (lds * sizeof(float) + lds * sizeof(uint16_t) +
                                                       (size_t)head_dim * (2 + sizeof(float)) + sizeof(float)));
        if (scores == NULL) status = 2;
        uint16_t *probs = (uint16_t *)(scores + rows_padded * lds);
        uint32_t *qpack = (uint32_t *)(probs + rows_padded * lds);
        float *o = (float *)(qpack + rows_padded * (size_t)head_dim / 2);
        float *inv = o + rows_padded * (size_t)head_dim;
        /* one head's tiles in a row, so its packed keys and values stay in this core's cache; later
         * tiles see more keys, so each head's are handed out from the end, dynamically */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * tiles; item++) {
            const int h = item / tiles, tile = tiles - 1 - item % tiles;
            if (scores != NULL) attend_tile(&job, h, tile * TILE_TOKENS, scores, probs, qpack, o, inv);
        }
        free(scores);
    }
    free(job.kp);
    return status;
#else
    (void)q, (void)k, (void)v, (void)table, (void)out, (void)scale, (void)threads;
    return 3;
#endif
}

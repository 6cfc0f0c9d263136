/* Causal attention of one sequence's prompt chunk over its paged cache, bfloat16 on AVX512-BF16 CPUs.
 *
 * The chunk's q_len queries are the last q_len of the sequence's seq_len cached tokens; query i
 * attends to keys 0 .. seq_len - q_len + i. Three steps:
 *   1. view: each kv head's keys and values are found through the block table in the layouts that
 *      VDPBF16PS consumes (pairs of bfloat16 in one 32-bit lane): keys as 16-key groups
 *      [pair of dims][key], values as [pair of keys][dim]. A tiled cache (pd_store_kv_tiled) holds its
 *      blocks in these layouts and is read in place; a dense cache is packed into them first, which
 *      costs more than the arithmetic (the packing's loads stall: 15 against 30 GB/s on decode rows);
 *   2. tiles: work items are (kv head, 16 query tokens); an item's rows are its tokens times the
 *      query heads sharing the kv head. Scores = Q K^T for every key the tile can see (float32),
 *      then an exact softmax per row (its causal limit applied), then P V with P in bfloat16;
 *   3. the output row is divided by the row's float32 sum and rounded to bfloat16.
 * A tile sees all its keys at once (scores for 2 x 16 rows of a 2048-token prompt are 256 KiB, in
 * L2), so there is no online rescaling, and every sum has a fixed order: a row's result depends only
 * on its query and the keys and values it sees, not on the chunk around it nor the thread count.
 * pd_paged_decode_rows runs decode rows through the same steps as one-token chunks, so a position
 * gets the same bits whether it was decoded or prefilled.
 *
 * On CPUs with AMX (where the kernel grants the tile state, cpu_amx.h), both products of a dense or
 * tiled bfloat16 cache run on TDPBF16PS instead, for every row of every call, prompt tiles and decode
 * rows alike (attend_tile): one fixed chain of 16-input tile steps per sum, so the bits are again the
 * same decoded or prefilled, differing from the VDPBF16PS path's in their last bits. On the 2-core
 * Sapphire Rapids VM (SmolLM2's 9 x 3 heads of 64, one layer) a 2,048-token prompt took 18-29 ms
 * against 50-55 on VDPBF16PS and a 512-token one 1.6-1.9 against 3.9-4.1; decode rows, which read
 * their keys and values once and are bound by memory, 0.9-1.1x as fast (32 rows of 512 tokens:
 * 1.01 against 0.89 ms). An int8 cache stays on VPDPBUSD and VDPBF16PS (kv_int8.h).
 *
 * Layouts (element strides):
 *   q:      [q_len, q_heads, head_dim] bfloat16, token stride q_stride, heads contiguous
 *   k, v:   [num_blocks, block_size, kv_heads, head_dim] bfloat16 contiguous (one layer), or the same
 *           bytes per block tiled (the _tiled entry points; block_size a multiple of 16)
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
#include "cpu_avx512.h"
#include "cpu_decode_rows.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif
#include "cpu_amx.h" /* QK and PV on AMX tiles where the CPU has them (attend_tile) */

#define TILE_TOKENS 16 /* query tokens per work item */
#define MR 4           /* query rows per register block where a tile has few rows (decode rows) */
#define MR_WIDE 6      /* ... and where it has many: 6 x 4 accumulators read each key and value vector
                        * for 6 rows instead of 4, so a prompt tile moves 2/3 of the bytes per product */
#define PANEL 64       /* keys per packed key panel: four 16-lane vectors */
#define DIM_STEP 64    /* output dims per register block of P V */
#define MAX_GROUP 16
#define GROUP_KEYS 16 /* keys per key group: one 16-lane vector per pair of dims */
#define MAX_HEAD_DIM 256
/* How a cache holds its blocks: dense [block][token][kv head][dim], tiled in the kernel's layouts
 * (pd_store_kv_tiled), or tiled in int8 with a scale per row (kv_int8.h). */
enum { DENSE = 0, TILED = 1, INT8 = 2 };

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

/* Softmax weights of one row of scores s[0:n] * scale (n >= 1; scale 1 where s holds them scaled, as
 * qk_block stores them; each product rounded once, as qk_block's) into probs[0:width] in bfloat16, zero past n;
 * returns 1 / (their float32 sum). width is a multiple of 16 and s is readable up to it. With vs (an
 * int8 cache's value segments, kv_int8.h), each weight is first multiplied by its key's value scale:
 * block b's keys' scales lie just before vs[b], bs of them. */
static float softmax_row(const float *s, float scale, uint16_t *probs, int n, int width, const int8_t *const *vs,
                         int bs) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        top = _mm512_mask_max_ps(top, live, top, _mm512_mul_ps(_mm512_loadu_ps(s + t), sc));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    int t = 0;
    for (; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t), sc);
        const __m512 w = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(x, peak)));
        sum = _mm512_add_ps(sum, w);
        /* a stale row's scale (NaN, say) past n is masked out, never multiplied in */
        const __m512 p = vs == NULL ? w : _mm512_maskz_mul_ps(live, w, _mm512_loadu_ps((const float *)vs[t / bs] - bs + t % bs));
        _mm256_storeu_si256((__m256i *)(probs + t), (__m256i)_mm512_cvtneps_pbh(p));
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
    int amx;                /* products on AMX tiles of this many rows, configured by the caller (0: off) */
} job_t;

static inline int64_t kp_size(const job_t *j) { return j->keys_padded * (j->head_dim / 2); }
static inline int64_t vp_size(const job_t *j) { return j->keys_padded / 2 * j->head_dim; }

/* Where token t's row of kv head h starts in the cache (in elements). */
static inline int64_t cache_row(const job_t *j, int t, int h) {
    return (((int64_t)j->table[t / j->block_size] * j->block_size + t % j->block_size) * j->kv_heads + h) *
           j->head_dim;
}

/* Asks for the cache lines of tokens [t, t + 16) before n, every kv head's: block tables scatter a
 * sequence over memory, so the hardware prefetcher loses the stream at each block. A decode row packs
 * its heads one after the other, so the first head's pass brings the others' rows along. */
static inline void prefetch_rows(const job_t *j, const uint16_t *base, int t, int n) {
    const int64_t bytes = (int64_t)j->kv_heads * j->head_dim * 2;
    int block = t / j->block_size, slot = t % j->block_size; /* stepped, not divided, per token */
    for (int u = t; u < t + 16 && u < n; u++) {
        const char *row = (const char *)(base + ((int64_t)j->table[block] * j->block_size + slot) *
                                                    j->kv_heads * j->head_dim);
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
        if (++slot == j->block_size) slot = 0, block++;
    }
}

/* Step 1 for kv head h of a dense cache into kp and vp: keys to 16-key groups [key / 16][dim pair][key % 16],
 * values to [key pair][dim] with the even key in the low half; zeros past seq_len. Sixteen keys that
 * share a cache block go through a register transpose, two values' rows through one interleave. */
static void pack_head(const job_t *j, int h, uint32_t *kp, uint32_t *vp) {
    const int d = j->head_dim, pairs = d / 2, n = j->seq_len;
    const int64_t key_words = j->keys_padded * pairs, first_zero = (int64_t)n / GROUP_KEYS * GROUP_KEYS * pairs;
    memset(kp + first_zero, 0, (size_t)(key_words - first_zero) * 4);
    int t = 0;
    for (; t + 16 <= n && j->block_size % 16 == 0; t += 16) { /* 16 keys, all in one block */
        if (h == 0) prefetch_rows(j, j->k, t + 16, n);
        const uint32_t *rows = (const uint32_t *)(j->k + cache_row(j, t, h));
        const int64_t stride = (int64_t)j->kv_heads * pairs; /* words from one token's row to the next */
        uint32_t *group = kp + (int64_t)t * pairs;
        for (int p0 = 0; p0 < pairs; p0 += 16) {
            __m512i r[16];
            for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_si512(rows + u * stride + p0);
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(group + (int64_t)(p0 + p) * GROUP_KEYS, r[p]);
        }
    }
    for (; t < n; t++) { /* the rest one key at a time */
        const uint32_t *krow = (const uint32_t *)(j->k + cache_row(j, t, h));
        uint32_t *group = kp + (int64_t)t / GROUP_KEYS * GROUP_KEYS * pairs + t % GROUP_KEYS;
        for (int p = 0; p < pairs; p++) group[p * GROUP_KEYS] = krow[p];
    }
    /* values: words 0..15 of a 32-dim chunk take dims 0..15 of the even and odd key, words 16..31 the rest */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int64_t token_stride = (int64_t)j->kv_heads * d; /* elements from a token's row to the next */
    int block = 0, slot = 0; /* where token t2 lies, stepped along (a division per token costs more
                              * than the interleave) */
    for (int t2 = 0; t2 < j->keys_padded; t2 += 2) {
        uint32_t *dst = vp + (int64_t)(t2 / 2) * d;
        if (t2 >= n) {
            memset(dst, 0, (size_t)d * 4);
            continue;
        }
        if (h == 0 && t2 % 16 == 0) prefetch_rows(j, j->v, t2 + 16, n);
        const uint16_t *even = j->v + ((int64_t)j->table[block] * j->block_size + slot) * token_stride + h * d;
        if (++slot == j->block_size) slot = 0, block++;
        const uint16_t *odd = NULL;
        if (t2 + 1 < n) {
            odd = j->v + ((int64_t)j->table[block] * j->block_size + slot) * token_stride + h * d;
            if (++slot == j->block_size) slot = 0, block++;
        }
        for (int c = 0; c < d; c += 32) {
            const __m512i a = _mm512_loadu_si512(even + c);
            const __m512i b = odd ? _mm512_loadu_si512(odd + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* Where one kv head's keys and values are read: key group g (keys 16g .. 16g + 15, laid out [dim pair][16
 * keys]) at kg[g], for every group of keys_padded; value pairs in segments of seg_pairs pairs, segment
 * i at vs[i] (laid out [key pair][dim]). A dense cache is packed into scratch first and viewed as one
 * segment; a tiled cache is viewed in place. */
typedef struct {
    const uint32_t **kg, **vs;
    int seg_pairs;
} kv_view_t;

/* The view of kv head h packed by pack_head into kp and vp. */
static void packed_view(const job_t *j, const uint32_t *kp, const uint32_t *vp, kv_view_t *view) {
    const int pairs = j->head_dim / 2;
    for (int64_t g = 0; g < j->keys_padded / GROUP_KEYS; g++) view->kg[g] = kp + g * GROUP_KEYS * pairs;
    view->vs[0] = view->vs[1] = vp;
    view->seg_pairs = (int)(j->keys_padded / 2);
}

static const uint32_t ZERO_GROUP[GROUP_KEYS * MAX_HEAD_DIM / 2]; /* keys past a sequence's last block */

/* The view of kv head h of a tiled cache (see pd_store_kv_tiled), in place: each block's keys are
 * block_size / 16 groups, its values one segment. The values of a last block that the sequence does
 * not fill are copied into tail (block_size * head_dim / 2 words) with zeros past seq_len, since a zero
 * probability times a stale value there need not be zero; stale keys only give scores that the
 * softmax never reads. Groups past the last block read zeros. */
static void tiled_view(const job_t *j, int h, uint32_t *tail, kv_view_t *view) {
    const int bs = j->block_size, d = j->head_dim, n = j->seq_len, groups_per_block = bs / GROUP_KEYS;
    const int64_t head_words = (int64_t)bs * d / 2; /* one head's keys (or values) in one block */
    const int blocks = (n + bs - 1) / bs;
    const int64_t groups = j->keys_padded / GROUP_KEYS;
    const uint32_t *k = (const uint32_t *)j->k, *v = (const uint32_t *)j->v;
    for (int b = 0; b < blocks; b++) {
        const int64_t at = ((int64_t)j->table[b] * j->kv_heads + h) * head_words;
        for (int g = 0; g < groups_per_block && (int64_t)b * groups_per_block + g < groups; g++)
            view->kg[b * groups_per_block + g] = k + at + (int64_t)g * GROUP_KEYS * d / 2;
        view->vs[b] = v + at;
    }
    view->vs[blocks] = view->vs[blocks - 1]; /* what the last segment prefetches */
    for (int64_t g = (int64_t)blocks * groups_per_block; g < groups; g++) view->kg[g] = ZERO_GROUP;
    const int used = n - (blocks - 1) * bs; /* tokens of the last block */
    if (used < bs) {
        memcpy(tail, view->vs[blocks - 1], (size_t)head_words * 4);
        uint16_t *halves = (uint16_t *)tail; /* word [pair][dim] = even key's half, then the odd key's */
        for (int t = used; t < bs; t++)
            for (int c = 0; c < d; c++) halves[((int64_t)(t / 2) * d + c) * 2 + t % 2] = 0;
        view->vs[blocks - 1] = tail;
    }
    view->seg_pairs = bs / 2;
}

/* Scores of mr (a constant: MR or MR_WIDE) packed query rows against one key panel, the four 16-key
 * groups g[0..3] (each laid out [dim pair][16 keys]): s[m][0:PANEL] = scale * q[m] . k. Each row's sums
 * run over the pairs in order, whatever mr: a row's scores do not depend on the rows beside it. */
static inline __attribute__((always_inline)) void qk_block(const uint32_t *q, int pairs, const uint32_t *const *g,
                                                           float scale, float *s, int64_t lds, const int mr) {
    __m512 acc[MR_WIDE][4];
    for (int m = 0; m < mr; m++)
        for (int x = 0; x < 4; x++) acc[m][x] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        for (int x = 0; x < 4; x++) _mm_prefetch((const char *)(g[4 + x] + p * GROUP_KEYS), _MM_HINT_T0);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(g[0] + p * GROUP_KEYS);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(g[1] + p * GROUP_KEYS);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(g[2] + p * GROUP_KEYS);
        const __m512bh b3 = (__m512bh)_mm512_loadu_si512(g[3] + p * GROUP_KEYS);
        for (int m = 0; m < mr; m++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[m * pairs + p]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < mr; m++)
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(s + m * lds + 16 * x, _mm512_mul_ps(acc[m][x], sc));
}

/* 16 dims of a key pair's values (two bfloat16 a word, the even key's low) at v, as VDPBF16PS takes
 * them: read as they are, or (int8) 32 int8 values widened exactly to bfloat16. */
static inline __m512bh value_pairs(const char *v, int int8) {
    if (!int8) return (__m512bh)_mm512_loadu_si512(v);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)v)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + 16))));
    return _mm512_cvtne2ps_pbh(b, a);
}

/* o[m][c0:c0+DIM_STEP] = sum over key pairs of P's pair times the values' pair, for mr rows (a constant:
 * MR or MR_WIDE; each row's sum runs over the pairs in order, whatever mr). Key pairs
 * come in segments of seg_pairs, segment i at vs[i] laid out [key pair][dim] (bfloat16, or int8 where
 * int8: an int8 cache's values, widened as they are read); the sum runs over the pairs in order
 * whatever the segments. */
static inline __attribute__((always_inline)) void pv_block(const uint32_t *p, int64_t ldp, int key_pairs,
                                                           const void *const *vs, int seg_pairs, int d, int c0,
                                                           float *o, int ldo, int int8, const int mr) {
    const int64_t value = int8 ? 1 : 2, row = 2 * (int64_t)d * value; /* bytes a value, a key pair */
    __m512 acc[MR_WIDE][4];
    for (int m = 0; m < mr; m++)
        for (int x = 0; x < 4; x++) acc[m][x] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < key_pairs; k0 += seg_pairs) {
        const char *seg = (const char *)vs[k0 / seg_pairs] + 2 * c0 * value;
        const char *next = (const char *)vs[k0 / seg_pairs + 1] + 2 * c0 * value;
        const int end = key_pairs - k0 < seg_pairs ? key_pairs - k0 : seg_pairs;
        for (int i = 0; i < end; i++) {
            const char *vr = seg + i * row;
            for (int64_t x = 0; x < 2 * value; x++) _mm_prefetch(next + i * row + 64 * x, _MM_HINT_T0);
            const __m512bh b0 = value_pairs(vr, int8), b1 = value_pairs(vr + 32 * value, int8);
            const __m512bh b2 = value_pairs(vr + 64 * value, int8), b3 = value_pairs(vr + 96 * value, int8);
            for (int m = 0; m < mr; m++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)p[m * ldp + k0 + i]);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
                acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
                acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(o + m * ldo + c0 + 16 * x, acc[m][x]);
}

/* Asks for the values of key panel b, into L2, while the panel's scores are computed: P V reads them
 * next. A block table scatters a sequence over memory, so the hardware prefetcher loses the stream at
 * every block, and the few rows of a decode tile multiply too little to hide a miss: without this, a
 * decode row took its compute plus its reads (the score loops ask for the next panel's keys).
 * Values come in segments of seg_pairs key pairs, segment i at vs[i], pair_bytes a pair. */
static inline void prefetch_panel_values(const void *const *vs, int seg_pairs, int64_t pair_bytes, int b,
                                         int keys) {
    const int first = b * PANEL / 2, last = ((b + 1) * PANEL < keys ? (b + 1) * PANEL : keys + 1) / 2;
    for (int pair = first; pair < last;) { /* a segment's run of the panel's pairs at a time */
        const int seg = pair / seg_pairs, at = pair % seg_pairs;
        const int run = seg_pairs - at < last - pair ? seg_pairs - at : last - pair;
        const char *values = (const char *)vs[seg] + at * pair_bytes;
        for (int64_t off = 0; off < run * pair_bytes; off += 64) _mm_prefetch(values + off, _MM_HINT_T1);
        pair += run;
    }
}

/* Where a tile of `rows` query rows ends once padded to whole row blocks: blocks of MR_WIDE, then
 * one of MR for a remainder of 1 to MR rows (so a decode row's group of up to MR rows is one block of
 * MR, as before). Padding rows hold zero queries and zero weights. */
static inline int tile_rows_end(int rows) {
    const int wide = rows / MR_WIDE * MR_WIDE, rest = rows - wide;
    return rest == 0 ? wide : rest <= MR ? wide + MR : wide + MR_WIDE;
}

/* Rows of scratch a tile of up to `rows` rows needs: tile_rows_end's, a multiple of MR for the int8
 * cache's tiles (kv_int8.h), which take blocks of MR only, or whole AMX tiles of 16 rows for a prompt
 * tile on the tiles (attend_tile; a decode row's tile there is only its own rows). */
static inline int tile_rows_room(int rows) {
    const int by_mr = (rows + MR - 1) / MR * MR, end = tile_rows_end(rows), by_tile = (rows + 15) / 16 * 16;
    const int most = end > by_mr ? end : by_mr;
    return most > by_tile ? most : by_tile;
}

/* Step 3: the tile's rows of o (rows, MR-padded, d wide, the query heads sharing kv head h of tokens
 * t0 ...) divided by their sums and written to out in bfloat16. */
static void write_rows(const job_t *j, int h, int t0, int rows, int group, const float *o, const float *inv) {
    const int d = j->head_dim;
    for (int r = 0; r < rows; r++) {
        uint16_t *dst = j->out + ((int64_t)(t0 + r / group) * j->q_heads + h * group + r % group) * d;
        const __m512 scale = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * d + c), scale)));
    }
}

#ifdef HAVE_AMX
/* Steps 2 and 3 on AMX tiles (TDPBF16PS): both products of the attention in steps of 16 inputs (8
 * pairs), which a block of 16 keys holds whatever the cache's block size. One configuration for both,
 * with m rows a tile (16 for prompt tiles, padded with zero queries; a decode row's query heads, a
 * tile of their own): tile 0 a step of the rows (8 pairs of query dims, or of probabilities), 1 to 3
 * a step of 8 pairs of 16 columns (keys of a key group, or dims of the values), 4 to 7 the float32
 * sums of the rows by 64 columns. A tile's rows never mix, so a row's sums do not depend on m. */
#define AMX_AHEAD 2 /* panels ahead whose keys qk_amx asks for */

static inline void amx_configure_attention(int m) {
    const uint8_t rows[8] = {(uint8_t)m, 8, 8, 8, (uint8_t)m, (uint8_t)m, (uint8_t)m, (uint8_t)m};
    static const uint16_t colsb[8] = {32, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(rows, colsb);
}

/* qk_block's sums for the tiles' rows of packed queries (row stride pairs words) against the four key
 * groups g, not yet scaled (softmax_row scales them as it reads them, as qk_block's are scaled): each runs
 * over the dims in tile steps of 16, from the first to the last, whatever the rows. */
static void qk_amx(const uint32_t *q, int pairs, const uint32_t *const *g, const uint32_t *const *ahead, float *s,
                   int64_t lds) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int p0 = 0; p0 < pairs; p0 += 8) {
        for (int x = 0; x < 4 && ahead != NULL; x++) /* a later panel's keys: the tiles outrun a nearer ask */
            for (int l = 0; l < 8; l++) _mm_prefetch((const char *)(ahead[x] + (p0 + l) * GROUP_KEYS), _MM_HINT_T0);
        _tile_loadd(0, q + p0, pairs * 4);
        _tile_loadd(1, g[0] + p0 * GROUP_KEYS, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, g[1] + p0 * GROUP_KEYS, 64);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, g[2] + p0 * GROUP_KEYS, 64);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, g[3] + p0 * GROUP_KEYS, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, s, lds * 4);
    _tile_stored(5, s + 16, lds * 4);
    _tile_stored(6, s + 32, lds * 4);
    _tile_stored(7, s + 48, lds * 4);
}

/* pv_block for the tiles' rows of probabilities p (row stride ldp elements): key pairs in steps of 8
 * from the first, each step within one segment (seg_pairs a multiple of 8), over key_pairs rounded up
 * to 8 (the probabilities there are zero, the values finite: zeros past a sequence's end). */
static void pv_amx(const uint16_t *p, int64_t ldp, int key_pairs, const void *const *vs, int seg_pairs, int d, int c0,
                   float *o, int ldo) {
    const int64_t row = 4 * (int64_t)d; /* bytes a key pair */
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int k0 = 0; k0 < key_pairs; k0 += 8) {
        const char *v = (const char *)vs[k0 / seg_pairs] + (k0 % seg_pairs) * row + 4 * c0;
        _tile_loadd(0, p + 2 * k0, ldp * 2);
        _tile_loadd(1, v, row);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, v + 64, row);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, v + 128, row);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, v + 192, row);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, o + c0, ldo * 4);
    _tile_stored(5, o + c0 + 16, ldo * 4);
    _tile_stored(6, o + c0 + 32, ldo * 4);
    _tile_stored(7, o + c0 + 48, ldo * 4);
}
#endif

/* A thread's tiles around its share of a call's work items (amx: the call's job_t.amx). */
static inline void amx_begin(int amx) {
#ifdef HAVE_AMX
    if (amx) amx_configure_attention(amx);
#else
    (void)amx;
#endif
}

static inline void amx_end(int amx) {
#ifdef HAVE_AMX
    if (amx) _tile_release();
#else
    (void)amx;
#endif
}

/* Step 2 and 3 for one work item: kv head h (read through view), query tokens [t0, t0 + TILE_TOKENS). */
static void attend_tile(const job_t *j, int h, int t0, const kv_view_t *view, float *scores, uint16_t *probs,
                        uint32_t *qpack, float *o, float *inv) {
    const int d = j->head_dim, pairs = d / 2, group = j->q_heads / j->kv_heads;
    const int tokens = j->q_len - t0 < TILE_TOKENS ? j->q_len - t0 : TILE_TOKENS;
    const int tm = j->amx; /* AMX tiles of tm rows, for every row of every call where the CPU has them */
    const int rows = tokens * group, rows_padded = tm ? (rows + tm - 1) / tm * tm : tile_rows_end(rows);
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
    for (int m = 0, mr; m < rows_padded; m += mr) {
        mr = tm ? tm : rows_padded - m >= MR_WIDE ? MR_WIDE : MR;
        for (int b = 0; b < panels; b++) {
            if (m == 0)
                prefetch_panel_values((const void *const *)view->vs, view->seg_pairs, 4 * (int64_t)d, b, keys);
            const uint32_t *qm = qpack + (int64_t)m * pairs;
            float *sm = scores + m * lds + (int64_t)b * PANEL;
#ifdef HAVE_AMX
            if (tm)
                qk_amx(qm, pairs, view->kg + 4 * b, b + AMX_AHEAD < panels ? view->kg + 4 * (b + AMX_AHEAD) : NULL,
                       sm, lds);
            else
#endif
            if (mr == MR_WIDE)
                qk_block(qm, pairs, view->kg + 4 * b, j->scale, sm, lds, MR_WIDE);
            else
                qk_block(qm, pairs, view->kg + 4 * b, j->scale, sm, lds, MR);
        }
    }

    /* exact softmax per row over its causal range; probabilities past the range are zero */
    for (int r = 0; r < rows_padded; r++) {
        if (r < rows)
            inv[r] = softmax_row(scores + r * lds, tm ? j->scale : 1.0f, probs + r * lds, past + t0 + r / group + 1,
                                 (int)lds, NULL, 0);
        else
            memset(probs + r * lds, 0, (size_t)lds * sizeof *probs);
    }
    const int key_pairs = (keys + 1) / 2;
    for (int m = 0, mr; m < rows_padded; m += mr) {
        mr = tm ? tm : rows_padded - m >= MR_WIDE ? MR_WIDE : MR;
        const uint32_t *pm = (const uint32_t *)(probs + m * lds);
        for (int c0 = 0; c0 < d; c0 += DIM_STEP) {
#ifdef HAVE_AMX
            if (tm)
                pv_amx(probs + m * lds, lds, key_pairs, (const void *const *)view->vs, view->seg_pairs, d, c0,
                       o + (int64_t)m * d, d);
            else
#endif
            if (mr == MR_WIDE)
                pv_block(pm, lds / 2, key_pairs, (const void *const *)view->vs, view->seg_pairs, d, c0,
                         o + (int64_t)m * d, d, 0, MR_WIDE);
            else
                pv_block(pm, lds / 2, key_pairs, (const void *const *)view->vs, view->seg_pairs, d, c0,
                         o + (int64_t)m * d, d, 0, MR);
        }
    }
    write_rows(j, h, t0, rows, group, o, inv);
}

/* Pointers of one kv head's view of a sequence of n tokens (kv_view_t), and the tail copy, in words. */
static inline size_t view_words(int n, int head_dim, int block_size) {
    const size_t groups = (size_t)(n + PANEL - 1) / PANEL * PANEL / GROUP_KEYS, blocks = (size_t)(n + block_size - 1) / block_size;
    return (groups + 4 + blocks + 1) * sizeof(uint32_t *) / sizeof(uint32_t) + (size_t)block_size * head_dim / 2;
}

#include "kv_int8.h"

/* Lays out view for head h of job j in `space` (view_words words): packed into kp/vp for a dense
 * cache, in place for a tiled one. */
static void head_view(const job_t *j, int h, int layout, uint32_t *space, uint32_t *kp, uint32_t *vp,
                      kv_view_t *view) {
    const int64_t groups = j->keys_padded / GROUP_KEYS;
    view->kg = (const uint32_t **)space;
    view->vs = view->kg + groups + 4;
    for (int x = 0; x < 4; x++) view->kg[groups + x] = ZERO_GROUP; /* what the last panel prefetches */
    if (layout == TILED) {
        const int blocks = (j->seq_len + j->block_size - 1) / j->block_size;
        tiled_view(j, h, (uint32_t *)(view->vs + blocks + 1), view);
    } else {
        pack_head(j, h, kp, vp);
        packed_view(j, kp, vp, view);
    }
}

/* A head's view of any layout, and the tile over it. */
typedef union {
    kv_view_t bf16; /* a dense or tiled cache */
#ifdef HAVE_INT8_KV
    int8_view_t int8;
#endif
} head_views_t;

static inline size_t view_words_of(int n, int head_dim, int block_size, int layout) {
#ifdef HAVE_INT8_KV
    if (layout == INT8) return int8_view_words(n, block_size);
#endif
    (void)layout;
    return view_words(n, head_dim, block_size);
}

static void any_view(const job_t *j, int h, int layout, uint32_t *space, uint32_t *kp, uint32_t *vp,
                     head_views_t *view) {
#ifdef HAVE_INT8_KV
    if (layout == INT8) {
        int8_view(j, h, space, &view->int8);
        return;
    }
#endif
    head_view(j, h, layout, space, kp, vp, &view->bf16);
}

/* widened: room for keys_padded / 2 * head_dim words where a prompt tile over an int8 cache widens its
 * values once (NULL: each row block widens them as it reads them) */
static void any_tile(const job_t *j, int h, int t0, int layout, const head_views_t *view, float *scores,
                     uint16_t *probs, uint32_t *qpack, float *o, float *inv, uint32_t *widened) {
#ifdef HAVE_INT8_KV
    if (layout == INT8) {
        attend_tile_int8(j, h, t0, &view->int8, scores, probs, qpack, o, inv, widened);
        return;
    }
#endif
    (void)layout, (void)widened;
    attend_tile(j, h, t0, &view->bf16, scores, probs, qpack, o, inv);
}

#endif /* HAVE_AVX512_BF16 */

/* Whether bfloat16 attention of a dense or tiled cache runs its products on AMX tiles (attend_tile):
 * want 1 or 0 asks for them or not (where granted), -1 only reads; returns 1 when they are used from
 * now on. For comparing the two paths; the default is on. An int8 cache's tiles stay on VDPBF16PS. */
int pd_prefill_amx(int want) { return amx_switch(want); }

static int prefill(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *table, void *out,
                   int q_len, int seq_len, int q_heads, int kv_heads, int head_dim, int block_size, float scale,
                   int threads, int layout) {
    if (q_len <= 0 || seq_len < q_len || kv_heads <= 0 || q_heads % kv_heads != 0 ||
        q_heads / kv_heads > MAX_GROUP || block_size <= 0 || q_stride < (int64_t)q_heads * head_dim ||
        (layout != DENSE && block_size % GROUP_KEYS != 0))
        return 1;
    if (!pd_prefill_supported(head_dim)) return 3;
#ifdef HAVE_AVX512_BF16
    if (threads < 1) threads = 1;
    job_t job = {q, k, v, table, out, q_stride, q_len, seq_len, q_heads, kv_heads, head_dim, block_size,
                 scale, (int64_t)(seq_len + PANEL - 1) / PANEL * PANEL, NULL, NULL,
                 layout != INT8 && amx_on() ? 16 : 0};
    const size_t per_view = view_words_of(seq_len, head_dim, block_size, layout);
    const size_t packed = layout == DENSE ? (size_t)(kp_size(&job) + vp_size(&job)) : 0;
    uint32_t *space = (uint32_t *)malloc((packed + per_view) * kv_heads * sizeof(uint32_t));
    if (space == NULL) return 2;
    head_views_t *views = (head_views_t *)malloc(sizeof(head_views_t) * kv_heads);
    if (views == NULL) {
        free(space);
        return 2;
    }
    const int group = q_heads / kv_heads, tiles = (q_len + TILE_TOKENS - 1) / TILE_TOKENS;
    const int rows_padded = tile_rows_room(TILE_TOKENS * group);
    const size_t lds = (size_t)job.keys_padded;
    int status = 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++) {
            uint32_t *mine = space + (packed + per_view) * h;
            any_view(&job, h, layout, mine + packed, mine, mine + kp_size(&job), &views[h]);
        }
        const size_t widen = layout == INT8 ? lds / 2 * (size_t)head_dim : 0; /* words */
        float *scores = (float *)malloc(rows_padded * (lds * sizeof(float) + lds * sizeof(uint16_t) +
                                                       (size_t)head_dim * (2 + sizeof(float)) + sizeof(float)) +
                                        widen * sizeof(uint32_t));
        if (scores == NULL) status = 2;
        uint16_t *probs = (uint16_t *)(scores + rows_padded * lds);
        uint32_t *qpack = (uint32_t *)(probs + rows_padded * lds);
        float *o = (float *)(qpack + rows_padded * (size_t)head_dim / 2);
        float *inv = o + rows_padded * (size_t)head_dim;
        uint32_t *widened = widen ? (uint32_t *)(inv + rows_padded) : NULL;
        /* one head's tiles in a row, so its keys and values stay in this core's cache; later tiles see
         * more keys, so each head's are handed out from the end, dynamically */
        amx_begin(job.amx);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * tiles; item++) {
            const int h = item / tiles, tile = tiles - 1 - item % tiles;
            if (scores != NULL)
                any_tile(&job, h, tile * TILE_TOKENS, layout, &views[h], scores, probs, qpack, o, inv, widened);
        }
        amx_end(job.amx);
        free(scores);
    }
    free(views);
    free(space);
    return status;
#else
    (void)q, (void)k, (void)v, (void)table, (void)out, (void)scale, (void)threads;
    return 3;
#endif
}

/* Returns 0 on success, 1 on bad arguments, 2 when memory could not be had, 3 when this CPU or
 * head_dim is not supported (see pd_prefill_supported). k, v: a dense cache. */
int pd_paged_prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v,
                               const int32_t *table, void *out, int q_len, int seq_len, int q_heads,
                               int kv_heads, int head_dim, int block_size, float scale, int threads) {
    return prefill(q, q_stride, k, v, table, out, q_len, seq_len, q_heads, kv_heads, head_dim, block_size, scale,
                   threads, DENSE);
}

/* pd_paged_prefill_attention over a tiled cache (pd_store_kv_tiled); block_size a multiple of 16. */
int pd_paged_prefill_tiled(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *table,
                           void *out, int q_len, int seq_len, int q_heads, int kv_heads, int head_dim,
                           int block_size, float scale, int threads) {
    return prefill(q, q_stride, k, v, table, out, q_len, seq_len, q_heads, kv_heads, head_dim, block_size, scale,
                   threads, TILED);
}

#ifdef HAVE_INT8_KV
/* pd_paged_prefill_attention over an int8 cache (pd_store_kv_int8, kv_int8.h); block_size a multiple of
 * 16. Only built where the CPU has AVX512-BF16 and AVX512-VNNI. */
int pd_paged_prefill_int8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *table,
                          void *out, int q_len, int seq_len, int q_heads, int kv_heads, int head_dim, int block_size,
                          float scale, int threads) {
    return prefill(q, q_stride, k, v, table, out, q_len, seq_len, q_heads, kv_heads, head_dim, block_size, scale,
                   threads, INT8);
}
#endif

static int decode_rows(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *tables,
                       int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                       const int32_t *ctx_lens, void *out, int rows, int q_heads, int kv_heads, int head_dim,
                       int block_size, float scale, int threads, int layout) {
    rows_plan_t plan;
    if (plan_rows(ctx_lens, rows, q_heads, kv_heads, head_dim, block_size, q_stride, MAX_GROUP, threads, &plan) ||
        (layout != DENSE && block_size % GROUP_KEYS != 0))
        return 1;
    if (!pd_prefill_supported(head_dim)) return 3;
#ifdef HAVE_AVX512_BF16
    const int parts = plan.parts, items = plan.items;
    const int group = q_heads / kv_heads, rows_padded = tile_rows_room(group);
    const size_t lds = (size_t)(plan.longest + PANEL - 1) / PANEL * PANEL;
    const size_t packed = layout == DENSE ? lds * (size_t)head_dim : 0; /* words of packed keys and values */
    const size_t per_view = view_words_of(plan.longest, head_dim, block_size, layout);
    const size_t tile = rows_padded * (lds * sizeof(float) + lds * sizeof(uint16_t) +
                                       (size_t)head_dim * (2 + sizeof(float)) + sizeof(float));
    /* a decode row's tile is its group of query heads: tiles of that many rows, no padding */
    const int amx = layout != INT8 && amx_on() ? group : 0;
    int status = 0;
#pragma omp parallel num_threads(plan.threads) reduction(| : status)
    {
        amx_begin(amx);
        uint32_t *kp = (uint32_t *)thread_scratch((packed + per_view) * sizeof(uint32_t) + tile);
        if (kp == NULL) status = 2;
        uint32_t *vp = kp + packed / 2, *space = kp + packed;
        float *scores = (float *)(space + per_view);
        uint16_t *probs = (uint16_t *)(scores + rows_padded * lds);
        uint32_t *qpack = (uint32_t *)(probs + rows_padded * lds);
        float *o = (float *)(qpack + rows_padded * (size_t)head_dim / 2);
        float *inv = o + rows_padded * (size_t)head_dim;
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int r = item / parts, h0 = parts == 1 ? 0 : item % parts, h1 = parts == 1 ? kv_heads : h0 + 1;
            const int n = ctx_lens[r];
            const job_t job = {(const uint16_t *)q + (int64_t)row_token[r] * q_stride, k, v,
                               tables + (int64_t)row_seq[r] * tables_stride,
                               (uint16_t *)out + (int64_t)row_token[r] * q_heads * head_dim, q_stride, 1, n, q_heads,
                               kv_heads, head_dim, block_size, scale, (int64_t)(n + PANEL - 1) / PANEL * PANEL,
                               NULL, NULL, amx};
            for (int h = h0; h < h1 && kp != NULL; h++) {
                head_views_t view;
                any_view(&job, h, layout, space, kp, vp, &view);
                any_tile(&job, h, 0, layout, &view, scores, probs, qpack, o, inv, NULL);
            }
        }
        amx_end(amx);
    }
    return status;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)tables, (void)tables_stride, (void)row_token, (void)row_seq;
    (void)ctx_lens, (void)out, (void)scale, (void)threads, (void)layout;
    return 3;
#endif
}

/* Decode rows with this kernel's arithmetic: row r is token row_token[r] of q, the last of the
 * ctx_lens[r] cached tokens of sequence row_seq[r] (block table tables[row_seq[r]]). For each of a
 * row's kv heads, its thread packs the head's keys and values into scratch and runs the
 * tile of a one-token chunk, so a decode row gets to the bit what a prompt chunk ending at the same
 * token gets: a sequence's KV and logits do not depend on how its tokens were split into steps.
 * Layouts as pd_paged_decode_attention's (paged_decode_cpu.c); bfloat16 only. Returns 0 on success,
 * 1 on bad arguments, 2 when memory could not be had, 3 when this CPU or head_dim is not supported. */
int pd_paged_decode_rows(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *tables,
                         int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                         const int32_t *ctx_lens, void *out, int rows, int q_heads, int kv_heads, int head_dim,
                         int block_size, float scale, int threads) {
    return decode_rows(q, q_stride, k, v, tables, tables_stride, row_token, row_seq, ctx_lens, out, rows, q_heads,
                       kv_heads, head_dim, block_size, scale, threads, DENSE);
}

/* pd_paged_decode_rows over a tiled cache (pd_store_kv_tiled), read in place: nothing is packed. */
int pd_paged_decode_rows_tiled(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *tables,
                               int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                               const int32_t *ctx_lens, void *out, int rows, int q_heads, int kv_heads,
                               int head_dim, int block_size, float scale, int threads) {
    return decode_rows(q, q_stride, k, v, tables, tables_stride, row_token, row_seq, ctx_lens, out, rows, q_heads,
                       kv_heads, head_dim, block_size, scale, threads, TILED);
}

#ifdef HAVE_INT8_KV
/* pd_paged_decode_rows over an int8 cache (pd_store_kv_int8), read in place. */
int pd_paged_decode_rows_int8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *tables,
                              int64_t tables_stride, const int32_t *row_token, const int32_t *row_seq,
                              const int32_t *ctx_lens, void *out, int rows, int q_heads, int kv_heads, int head_dim,
                              int block_size, float scale, int threads) {
    return decode_rows(q, q_stride, k, v, tables, tables_stride, row_token, row_seq, ctx_lens, out, rows, q_heads,
                       kv_heads, head_dim, block_size, scale, threads, INT8);
}
#endif

/* The paged KV write into a tiled cache: cache[slot[r]] = key[r], value[r] for rows of kv_heads *
 * head_dim bfloat16 values (row r of key at key + r * key_stride, in elements). A tiled block holds,
 * per kv head, its keys as block_size / 16 groups [dim pair][16 keys] and its values as [key pair][dim],
 * each word a pair of bfloat16 (the lower dim, or the even key, in the low half): the layouts the
 * kernel above multiplies with VDPBF16PS, so attention reads the cache in place. A block has the
 * dense layout's size, so blocks move between like caches as bytes. Returns 0, or 1 for bad arguments. */
int pd_store_kv_tiled(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                      void *v_cache, const int64_t *slots, int64_t num_slots, int rows, int kv_heads, int head_dim,
                      int block_size, int threads) {
    const int width = kv_heads * head_dim, pairs = head_dim / 2;
    if (rows < 0 || kv_heads <= 0 || head_dim <= 0 || head_dim % 2 || block_size <= 0 || block_size % GROUP_KEYS ||
        key_stride < width || value_stride < width || num_slots % block_size)
        return 1;
    for (int r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    const int64_t head_words = (int64_t)block_size * pairs;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * kv_heads >= 16) schedule(static)
    for (int r = 0; r < rows; r++) {
        const int64_t block = slots[r] / block_size;
        const int t = (int)(slots[r] % block_size);
        const uint32_t *krow = (const uint32_t *)((const uint16_t *)key + r * key_stride);
        const uint16_t *vrow = (const uint16_t *)value + r * value_stride;
        for (int h = 0; h < kv_heads; h++) {
            uint32_t *kb = (uint32_t *)k_cache + (block * kv_heads + h) * head_words;
            uint32_t *kg = kb + (int64_t)(t / GROUP_KEYS) * GROUP_KEYS * pairs + t % GROUP_KEYS;
            for (int p = 0; p < pairs; p++) kg[p * GROUP_KEYS] = krow[h * pairs + p];
            uint16_t *vb = (uint16_t *)((uint32_t *)v_cache + (block * kv_heads + h) * head_words);
            uint16_t *vpair = vb + (int64_t)(t / 2) * head_dim * 2 + t % 2;
            for (int c = 0; c < head_dim; c++) vpair[2 * c] = vrow[h * head_dim + c];
        }
    }
    return 0;
}

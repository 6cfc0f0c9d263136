/* The int8 KV cache of the bfloat16 prompt kernel (paged_prefill_cpu.c): writing it and attending over it.
 *
 * A key or value row (one token, one kv head, head_dim values) is stored as head_dim int8 values and one
 * float32 scale: scale = max |x| / 127, q = x / scale rounded half to even (0 when the row is all zero).
 * A block of one layer's keys (or values) holds block_size * (head_dim + 4) bytes per kv head, the
 * bytes of a [block_size, kv_heads, head_dim + 4] int8 tensor, so blocks move between like caches as
 * bytes. Keys come in 16-key groups, each its 16 scales then its values [dim quad][16 keys][4 dims]
 * stored as q + 128 (VPDPBUSD's unsigned operand); values as the block's block_size scales then
 * [key pair][dim][2 keys] (VDPBF16PS's pairs once widened). Scales sit before the values they scale,
 * so a read that streams the values has them in the same run of memory.
 *
 * Attention reads the rows in place, at one byte a value. Scores: each query row is quantized by the
 * same rule, its products with a key group summed exactly in int32 on VPDPBUSD, then scaled by the
 * query's and the key's scales in float32. Values: the softmax multiplies each probability by its
 * value's scale before rounding it to bfloat16, and P V runs on VDPBF16PS over the int8 values
 * widened exactly to bfloat16. Every sum has a fixed order, so a row's result depends only on its
 * query and the rows it sees: decode rows and prompt chunks get the same bits, in any batch.
 * kernels/kv_int8_ref.py is the torch twin of the layout and the write. Included by paged_prefill_cpu.c
 * after attend_tile. */
#ifndef PDFABRIC_KV_INT8_H
#define PDFABRIC_KV_INT8_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cpu_scalar.h" /* quad_t */

#define INT8_SCALE_BYTES 4    /* a float32 scale a row: head_dim + 4 bytes a row */
#define INT8_MAX_HEAD_DIM 256

#if defined(HAVE_AVX512_BF16) && defined(__AVX512VNNI__)
#define HAVE_INT8_KV 1

/* Bytes of one kv head's rows in one block, and of one 16-key group of them (scales, then values). */
static inline int64_t int8_head_bytes(int block_size, int head_dim) {
    return (int64_t)block_size * (head_dim + INT8_SCALE_BYTES);
}
static inline int64_t int8_group_bytes(int head_dim) { return 16 * (int64_t)(head_dim + INT8_SCALE_BYTES); }

/* Quantizes one row of n bfloat16 values (n a multiple of 16) into q (strided: q[i * step]) and returns
 * its scale: scale = max |x| / 127, q = x / scale rounded half to even (all 0 when scale is 0). */
static inline float quantize_row_int8(const uint16_t *x, int n, int8_t *q, int step) {
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(widen_bf16x16(x + i, 0xffff)));
    const float scale = _mm512_reduce_max_ps(top) / 127.0f;
    for (int i = 0; i < n; i += 16) {
        int8_t lanes[16];
        __m512 r = _mm512_setzero_ps();
        if (scale > 0.0f) {
            r = _mm512_roundscale_ps(_mm512_div_ps(widen_bf16x16(x + i, 0xffff), _mm512_set1_ps(scale)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        }
        const __m128i packed = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
        if (step == 1) {
            _mm_storeu_si128((__m128i *)(q + i), packed);
            continue;
        }
        _mm_storeu_si128((__m128i *)lanes, packed);
        for (int u = 0; u < 16; u++) q[(int64_t)(i + u) * step] = lanes[u];
    }
    return scale;
}

/* The paged KV write into an int8 cache: cache[slot[r]] = key[r], value[r] quantized, rows of kv_heads *
 * head_dim bfloat16 values (row r of key at key + r * key_stride, in elements). Arguments as
 * pd_store_kv_tiled's; k_cache and v_cache are one layer's int8 blocks as laid out above. Returns 0, or
 * 1 for bad arguments. */
int pd_store_kv_int8(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                     void *v_cache, const int64_t *slots, int64_t num_slots, int rows, int kv_heads, int head_dim,
                     int block_size, int threads) {
    const int width = kv_heads * head_dim;
    if (rows < 0 || kv_heads <= 0 || head_dim <= 0 || head_dim % 4 || head_dim > INT8_MAX_HEAD_DIM || block_size <= 0 ||
        block_size % 16 ||
        key_stride < width || value_stride < width || num_slots % block_size)
        return 1;
    for (int r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    const int64_t head_bytes = int8_head_bytes(block_size, head_dim), scales = (int64_t)block_size * 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * kv_heads >= 16) schedule(static)
    for (int r = 0; r < rows; r++) {
        const int64_t block = slots[r] / block_size;
        const int t = (int)(slots[r] % block_size);
        for (int h = 0; h < kv_heads; h++) {
            int8_t *kb = (int8_t *)k_cache + (block * kv_heads + h) * head_bytes;
            int8_t *vb = (int8_t *)v_cache + (block * kv_heads + h) * head_bytes;
            /* key t: group t / 16 (its scale at t % 16), [dim quad][16 keys][4 dims] as q + 128 */
            int8_t row[INT8_MAX_HEAD_DIM];
            const float ks =
                quantize_row_int8((const uint16_t *)key + r * key_stride + h * head_dim, head_dim, row, 1);
            uint8_t *kg = (uint8_t *)kb + (t / 16) * int8_group_bytes(head_dim);
            memcpy(kg + (t % 16) * 4, &ks, 4);
            for (int c = 0; c < head_dim; c++) kg[64 + c / 4 * 64 + (t % 16) * 4 + c % 4] = (uint8_t)(row[c] + 128);
            /* value t: its scale at t, then [key pair][dim][2 keys]: dim c at c * 2 + t % 2 */
            const float vs = quantize_row_int8((const uint16_t *)value + r * value_stride + h * head_dim, head_dim,
                                               vb + scales + (int64_t)(t / 2) * head_dim * 2 + t % 2, 2);
            memcpy(vb + (int64_t)t * 4, &vs, 4);
        }
    }
    return 0;
}

/* Key groups past a sequence's last block: zero scales, so whatever their values, their scores are 0. */
static const uint8_t ZERO_KEYS[GROUP_KEYS * (MAX_HEAD_DIM + INT8_SCALE_BYTES)];

/* One kv head's int8 rows, in place: key group g (16 scales, then [dim quad][16 keys][4 dims] as u8) at
 * kg[g]; value pairs in segments of seg_pairs pairs (a block each: [key pair][dim][2 keys] as s8 at
 * vs[i], the block's block_size value scales just before). */
typedef struct {
    const uint8_t **kg;
    const int8_t **vs;
    int seg_pairs;
} int8_view_t;

/* Words of scratch int8_view takes for a sequence of n tokens. */
static inline size_t int8_view_words(int n, int block_size) {
    const size_t padded = (size_t)(n + PANEL - 1) / PANEL * PANEL, blocks = (size_t)(n + block_size - 1) / block_size;
    return (padded / GROUP_KEYS + 4 + blocks + 1) * sizeof(void *) / sizeof(uint32_t);
}

/* Lays out the view of kv head h of an int8 cache in `space` (int8_view_words words), and asks for each
 * block's value scales, which the softmax reads before P V streams the values. */
static void int8_view(const job_t *j, int h, uint32_t *space, int8_view_t *view) {
    const int d = j->head_dim, bs = j->block_size, n = j->seq_len, groups_per_block = bs / GROUP_KEYS;
    const int64_t head_bytes = int8_head_bytes(bs, d);
    const int blocks = (n + bs - 1) / bs;
    const int64_t groups = j->keys_padded / GROUP_KEYS;
    const int8_t *k = (const int8_t *)j->k, *v = (const int8_t *)j->v;
    view->kg = (const uint8_t **)space;
    view->vs = (const int8_t **)(view->kg + groups + 4);
    view->seg_pairs = bs / 2;
    for (int b = 0; b < blocks; b++) {
        const int64_t at = ((int64_t)j->table[b] * j->kv_heads + h) * head_bytes;
        for (int g = 0; g < groups_per_block && (int64_t)b * groups_per_block + g < groups; g++)
            view->kg[b * groups_per_block + g] = (const uint8_t *)(k + at) + g * int8_group_bytes(d);
        view->vs[b] = v + at + (int64_t)bs * INT8_SCALE_BYTES;
        for (int off = 0; off < bs * INT8_SCALE_BYTES; off += 64) __builtin_prefetch(v + at + off, 0, 3);
    }
    view->vs[blocks] = view->vs[blocks - 1]; /* what the last segment prefetches */
    for (int64_t g = (int64_t)blocks * groups_per_block; g < groups + 4; g++) view->kg[g] = ZERO_KEYS;
}

/* Scores of MR quantized query rows (q: d int8 each; f: their scale times the softmax scale; corr:
 * 128 times their sum) against one key panel, the four 16-key groups g[0..3] (scales, then values):
 * s[m][key] = (q[m] . (k + 128) - corr[m]) * f[m] * scale[key], the dot product exact in int32. */
static inline void qk_int8(const int8_t *q, const float *f, const int32_t *corr, int d, const uint8_t *const *g,
                           float *s, int64_t lds) {
    __m512i acc[MR][4];
    for (int m = 0; m < MR; m++)
        for (int x = 0; x < 4; x++) acc[m][x] = _mm512_setzero_si512();
    for (int x = 0; x < 4; x++) _mm_prefetch((const char *)(g[4 + x] + d * 16), _MM_HINT_T0); /* its last line */
    for (int c = 0; c < d / 4; c++) {
        for (int x = 0; x < 4; x++) _mm_prefetch((const char *)(g[4 + x] + c * 64), _MM_HINT_T0);
        const __m512i b0 = _mm512_loadu_si512(g[0] + 64 + c * 64), b1 = _mm512_loadu_si512(g[1] + 64 + c * 64);
        const __m512i b2 = _mm512_loadu_si512(g[2] + 64 + c * 64), b3 = _mm512_loadu_si512(g[3] + 64 + c * 64);
        for (int m = 0; m < MR; m++) {
            const __m512i a = _mm512_set1_epi32(*(const quad_t *)(q + m * d + c * 4));
            acc[m][0] = dpbusd(acc[m][0], b0, a);
            acc[m][1] = dpbusd(acc[m][1], b1, a);
            acc[m][2] = dpbusd(acc[m][2], b2, a);
            acc[m][3] = dpbusd(acc[m][3], b3, a);
        }
    }
    for (int m = 0; m < MR; m++) {
        const __m512i c = _mm512_set1_epi32(corr[m]);
        const __m512 fm = _mm512_set1_ps(f[m]);
        for (int x = 0; x < 4; x++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][x], c));
            const __m512 ks = _mm512_loadu_ps((const float *)g[x]);
            _mm512_storeu_ps(s + m * lds + 16 * x, _mm512_mul_ps(_mm512_mul_ps(dot, fm), ks));
        }
    }
}

/* attend_tile over an int8 cache: each query row is quantized as a cached row is (its own scale), so
 * Q K^T runs on VPDPBUSD; the softmax folds each value's scale into its probability, and P V runs on
 * VDPBF16PS over the values widened exactly to bfloat16. qbuf: MR-padded rows of d bytes plus two
 * words a row. A row's result depends only on its query and the rows it sees. */
static void attend_tile_int8(const job_t *j, int h, int t0, const int8_view_t *view, float *scores, uint16_t *probs,
                             void *qbuf, float *o, float *inv, uint32_t *widened) {
    const int d = j->head_dim, group = j->q_heads / j->kv_heads;
    const int tokens = j->q_len - t0 < TILE_TOKENS ? j->q_len - t0 : TILE_TOKENS;
    const int rows = tokens * group, rows_padded = (rows + MR - 1) / MR * MR;
    const int past = j->seq_len - j->q_len;
    const int keys = past + t0 + tokens;
    const int panels = (keys + PANEL - 1) / PANEL;
    const int64_t lds = (int64_t)panels * PANEL;
    int8_t *q8 = (int8_t *)qbuf;
    float *f = (float *)(q8 + (int64_t)rows_padded * d);
    int32_t *corr = (int32_t *)(f + rows_padded);
    memset(q8, 0, (size_t)rows_padded * d);
    for (int r = 0; r < rows_padded; r++) {
        f[r] = 0.0f, corr[r] = 0;
        if (r >= rows) continue;
        const uint16_t *src = j->q + (int64_t)(t0 + r / group) * j->q_stride + (int64_t)(h * group + r % group) * d;
        f[r] = quantize_row_int8(src, d, q8 + (int64_t)r * d, 1) * j->scale;
        int32_t sum = 0;
        for (int c = 0; c < d; c++) sum += q8[(int64_t)r * d + c];
        corr[r] = 128 * sum;
    }
    for (int m = 0; m < rows_padded; m += MR)
        for (int b = 0; b < panels; b++) {
            if (m == 0)
                prefetch_panel_values((const void *const *)view->vs, view->seg_pairs, 2 * (int64_t)d, b, keys);
            qk_int8(q8 + (int64_t)m * d, f + m, corr + m, d, view->kg + 4 * b, scores + m * lds + (int64_t)b * PANEL,
                    lds);
        }
    for (int r = 0; r < rows_padded; r++) {
        if (r < rows)
            inv[r] = softmax_row(scores + r * lds, 1.0f, probs + r * lds, past + t0 + r / group + 1, (int)lds, view->vs,
                                 j->block_size);
        else
            memset(probs + r * lds, 0, (size_t)lds * sizeof *probs);
    }
    const int key_pairs = (keys + 1) / 2;
    if (rows_padded > MR && widened != NULL) {
        /* several row blocks read every value: widen them once, then the bfloat16 P V (the same sums) */
        const int seg = view->seg_pairs;
        for (int i = 0; i < key_pairs; i++) {
            const char *pair = (const char *)view->vs[i / seg] + (int64_t)(i % seg) * 2 * d;
            for (int c = 0; c < 2 * d; c += 32)
                _mm512_storeu_si512(widened + (int64_t)i * d + c / 2, (__m512i)value_pairs(pair + c, 1));
        }
        const void *one[2] = {widened, widened};
        for (int m = 0; m < rows_padded; m += MR)
            for (int c0 = 0; c0 < d; c0 += DIM_STEP)
                pv_block((const uint32_t *)(probs + m * lds), lds / 2, key_pairs, one, key_pairs, d, c0,
                         o + (int64_t)m * d, d, 0, MR);
    } else {
        for (int m = 0; m < rows_padded; m += MR)
            for (int c0 = 0; c0 < d; c0 += DIM_STEP)
                pv_block((const uint32_t *)(probs + m * lds), lds / 2, key_pairs, (const void *const *)view->vs,
                         view->seg_pairs, d, c0, o + (int64_t)m * d, d, 1, MR);
    }
    write_rows(j, h, t0, rows, group, o, inv);
}

#endif /* HAVE_AVX512_BF16 && __AVX512VNNI__ */

#endif /* PDFABRIC_KV_INT8_H */

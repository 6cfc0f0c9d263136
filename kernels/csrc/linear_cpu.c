/* Linear layers on the CPU whose every output has one fixed order of summation, whatever the batch.
 *
 *   pd_linear:  y[m, n] = round(sum_k x[m, k] * w[n, k] + bias[n])
 *
 * GEMM libraries pick their blocking per shape: oneDNN sums a row of a K = 1536 projection in one
 * order when the row is alone and in another when it shares the call with other rows, so a greedy
 * sequence's tokens changed with the batch it was decoded in. Here each output is one float32 lane
 * that runs over k from the first pair of inputs to the last, never split and never re-associated:
 * rows are blocked and columns are split between threads, K never is. A row's result is the same to
 * the bit alone, in any batch, on any number of threads and in a prefill chunk or a decode step.
 *
 * The weight is packed once (pd_linear_pack) into panels of 64 output columns:
 *   bfloat16: panel[k / 2][64][2], the two inputs of a pair side by side (what VDPBF16PS multiplies)
 *   float32:  panel[k][64]
 * with columns past n and the odd k of an odd K zero. A step streams each panel once and applies it
 * to up to ROWS rows held in registers; with few rows it is a read of the weights at memory speed.
 *
 * Weights quantized to int8 (weight-only, symmetric, one float32 scale per output column; packed by
 * pd_linear_pack_int8) halve the bytes a decode step reads:
 *   dtype 2: bfloat16 x and out, panel[k / 2][64][2] int8, widened to bfloat16 in registers (an int8 is
 *            a bfloat16 exactly) and multiplied as dtype 1 multiplies;
 *   dtype 3: float32 x and out, panel[k][64] int8, widened to float32.
 *   y[m, n] = round(scale[n] * sum_k x[m, k] * q[n, k] + bias[n])
 * The packed buffer starts with the scales of every panel's 64 columns (float32), then the panels. The
 * sums keep the order of the other dtypes, so a row's result does not depend on the batch either.
 *
 * Weights quantized in groups of 32 inputs (packed by pd_linear_pack_grouped; K a multiple of 32): each
 * output column has a float32 scale d and, for 4 bits, a float32 offset m per group, the weight being
 * d * q + m. This holds GGUF's Q4_0 (m = -8 d), Q4_1, Q4_K (d and m per 32-input sub-block, products
 * that float32 holds exactly) and Q8_0 (8 bits, m = 0) as they are, and pdfabric's own int4:
 *   dtype 4: bfloat16 x, 4-bit q in 0..15;  dtype 5: float32 x, the same packing;
 *   dtype 6: bfloat16 x, 8-bit q (int8);    dtype 7: float32 x, the same packing;
 *   dtype 10 and 11: as 6 and 7 with groups of 16 inputs: GGUF's Q6_K (d times each 16 inputs' 8-bit
 *   scale, q - 32 in -32..31) as it is;
 *   dtype 12 and 13: as 6 and 7 with an offset m per group: GGUF's Q5_1 and Q5_K (q in 0..31).
 *   y[m, n] = round(sum_g (d[n, g] * sum_{k in g} x[m, k] q[n, k] + m[n, g] * sum_{k in g} x[m, k]) + bias[n])
 * Each group's sums run over its pairs of inputs from the first to the last (q widened to bfloat16,
 * exactly, for bfloat16 x) and are added to the output's running sum group by group, in order. Layout:
 * scales[panel][group][64], then (4 bits, 12, 13) offsets[panel][group][64], then the quantized panels, pairs
 * of inputs as for bfloat16: 4 bits: panel[k / 2][64] bytes, the pair's first input in the low
 * nibble; 8 bits: panel[k / 2][64][2].
 *
 * A weight of several parts (dtype 16, packed by pd_linear_pack_parts): a stacked projection whose parts
 * come in different formats (a GGUF file's q and k in Q4_K beside v in Q6_K). Each part's outputs are
 * its own call of pd_linear on the same x, written to their columns of out (and taking their slice of
 * the bias): every part keeps its own fixed order, so the whole keeps the batch invariance. Layout: an
 * int64 count, then per part (outputs, dtype, byte offset of its packed weight from the start), then
 * the parts' packed weights.
 *
 * Layouts (element strides): x row m starts at m * x_stride, out row m at m * out_stride, elements
 * contiguous. dtype: 0 float32, 1 bfloat16 (x, weight, bias and out alike). Rounding to bfloat16 is
 * to nearest even on the bits, as torch rounds.
 * With the flag OUT_F32 on the dtype, out is float32 for every dtype: each output's float32 sum plus its
 * bias, not rounded (a model's logits: rounded to bfloat16, two logits near 25 that float32 tells apart
 * by 0.04 are a tie, which greedy sampling breaks by token id).
 *
 * On CPUs with AMX, bfloat16 (dtype 1) runs on its tiles instead (linear_amx.h): every row of every call,
 * each output one fixed chain of 32-input tile steps, so the batch invariance holds there too.
 *
 * Built by kernels/cpu_build.py with -O3 -march=native -fopenmp; bfloat16 needs AVX512-BF16, float32
 * takes AVX-512 where the CPU has it and plain C that the compiler vectorises elsewhere.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h> /* AVX2 alone: the integer tiles (linear_w8a8.h, linear_w4a8.h) */
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif
#endif

#include "cpu_avx512.h" /* widen_bf16x16; dpbusd for linear_w8a8.h */
#include "cpu_scalar.h"   /* quad_t */

#define COLS 64          /* output columns per panel: four 16-lane vectors */
#define ROWS 6           /* rows per register tile: 6 x 4 accumulators */
#define ROW_BLOCK 96     /* rows per work item: a panel is read from cache this many rows at a time */
#define K_CHUNK 64       /* input pairs per pass over a block's rows: 16 KiB of a bfloat16 panel */
#ifndef PREFETCH_STEPS
#define PREFETCH_STEPS 64 /* how far ahead (in steps: input pairs in bf16) weights are asked for: 16 KiB in bf16 */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 1 /* into the outer caches (prefetcht2): the stream outruns a first-level cache */
#endif

/* Asks for every 64-byte line of the `bytes` (a constant after inlining) weights one step reads,
 * PREFETCH_STEPS steps ahead. A line not asked for waits for memory when its step comes: asking for
 * every other line of a bfloat16 step (256 bytes) left decode steps 25% slower at 8 to 32 rows. */
static inline __attribute__((always_inline)) void prefetch_step(const void *w, const int bytes) {
    const char *ahead = (const char *)w + (int64_t)PREFETCH_STEPS * bytes;
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(ahead + off, 0, PREFETCH_HINT);
}
#define WIDEN_ROWS 64 /* rows of a block from which grouped weights are widened once a chunk */
#define SERIAL_MACS 32768 /* multiply-adds below which a call stays on one thread */

static inline int64_t pairs_of(int64_t k) { return (k + 1) / 2; }

static inline int quantized(int dtype) { return dtype == 2 || dtype == 3; } /* int8, a scale per output */
/* a scale per 32 inputs (per 16: dtypes 10 and 11), and an offset too (4 bits, dtypes 12 and 13) */
static inline int grouped(int dtype) { return (dtype >= 4 && dtype <= 7) || (dtype >= 10 && dtype <= 13); }
static inline int group_bits(int dtype) { return dtype <= 5 ? 4 : 8; }
static inline int group_inputs(int dtype) { return dtype == 10 || dtype == 11 ? 16 : 32; }
static inline int group_offsets_held(int dtype) { return dtype == 4 || dtype == 5 || dtype == 12 || dtype == 13; }
static inline int grouped_bf16(int dtype) { return dtype == 4 || dtype == 6 || dtype == 10 || dtype == 12; }
static inline int x_is_bf16(int dtype) { return dtype == 1 || dtype == 2 || grouped_bf16(dtype); }
static inline int w8a8(int dtype) { return dtype == 8 || dtype == 9; } /* linear_w8a8.h */
static inline int w4a8(int dtype) { return dtype == 14 || dtype == 15; } /* linear_w4a8.h */
#define PARTS 16 /* the dtype of a weight of several parts (pd_linear_pack_parts) */
#define OUT_F32 64 /* a flag on pd_linear's dtype: float32 out whatever x is */

/* Bytes of a W8A8 [n, k] weight: a scale per output, then a byte per weight. */
static inline int64_t w8a8_packed_bytes(int64_t n, int64_t k) {
    const int64_t panels = (n + COLS - 1) / COLS;
    return panels * COLS * (int64_t)sizeof(float) + panels * COLS * k;
}

/* Bytes of a W4A8 [n, k] weight: a scale and an offset per output and group of 32, half a byte a weight. */
static inline int64_t w4a8_packed_bytes(int64_t n, int64_t k) {
    const int64_t panels = (n + COLS - 1) / COLS;
    return 2 * panels * (k / 32) * COLS * (int64_t)sizeof(float) + panels * COLS * k / 2;
}

#define GROUP 32 /* inputs per quantization group: 16 pairs (16 inputs for dtypes 10 and 11) */

/* Bytes of a grouped weight's quantized panels for one pair of inputs of 64 columns. */
static inline int64_t grouped_row_bytes(int bits) { return bits == 4 ? COLS : 2 * COLS; }

/* Bytes of the scales (and offsets, where `offsets`) of a grouped [n, k] weight in groups of `group`
 * inputs, before its panels. */
static inline int64_t grouped_header_bytes(int64_t n, int64_t k, int offsets, int group) {
    const int64_t panels = (n + COLS - 1) / COLS;
    return panels * (k / group) * COLS * (int64_t)sizeof(float) * (offsets ? 2 : 1);
}

/* Elements of the packed weight of an [n, k] linear in `dtype` (bytes for the int8 dtypes: the scales'
 * too). */
int64_t pd_linear_packed_elems(int64_t n, int64_t k, int dtype) {
    const int64_t panels = (n + COLS - 1) / COLS;
    if (w8a8(dtype)) return w8a8_packed_bytes(n, k);
    if (w4a8(dtype)) return w4a8_packed_bytes(n, k);
    if (grouped(dtype))
        return grouped_header_bytes(n, k, group_offsets_held(dtype), group_inputs(dtype)) +
               panels * pairs_of(k) * grouped_row_bytes(group_bits(dtype));
    if (quantized(dtype))
        return panels * COLS * (int64_t)sizeof(float) + (dtype == 2 ? panels * pairs_of(k) * COLS * 2 : panels * k * COLS);
    return dtype == 1 ? panels * pairs_of(k) * COLS * 2 : panels * k * COLS;
}

/* Packs int8 weights q [n, k] (row stride w_stride) and their per-row scales [n] for dtype 2 (pairs of
 * inputs, for bfloat16 x) or 3 (one input at a time, for float32 x). Returns 0, or 1 on bad arguments. */
int pd_linear_pack_int8(const int8_t *q, int64_t w_stride, const float *scales, int64_t n, int64_t k, int dtype,
                        void *packed) {
    if (n <= 0 || k <= 0 || w_stride < k || !quantized(dtype)) return 1;
    const int64_t panels = (n + COLS - 1) / COLS, per = dtype == 2 ? 2 : 1, steps = dtype == 2 ? pairs_of(k) : k;
    float *scale = (float *)packed;
    int8_t *dst = (int8_t *)packed + panels * COLS * (int64_t)sizeof(float);
    for (int64_t c = 0; c < panels * COLS; c++) scale[c] = c < n ? scales[c] : 0.0f;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < steps; i++)
            for (int c = 0; c < COLS; c++)
                for (int e = 0; e < per; e++) {
                    const int64_t row = p * COLS + c, col = per * i + e;
                    dst[((p * steps + i) * COLS + c) * per + e] = row < n && col < k ? q[row * w_stride + col] : 0;
                }
    return 0;
}

/* Packs a weight quantized in groups of `group` inputs (32; 16 for 8 bits): q [n, k] one byte a weight
 * (row stride q_stride; 4 bits: values 0..15; 8 bits: int8), scales [n, k / group] and offsets
 * [n, k / group] (4 bits always; 8 bits in groups of 32 may have them, else NULL), both float32 and
 * contiguous. Returns 0, or 1 on bad arguments (K not a multiple of the group among them). */
int pd_linear_pack_grouped(const uint8_t *q, int64_t q_stride, const float *scales, const float *offsets, int64_t n,
                           int64_t k, int bits, int group, void *packed) {
    if (n <= 0 || k <= 0 || q_stride < k || (bits != 4 && bits != 8) || (bits == 4 && !offsets)) return 1;
    if (!(group == GROUP || (group == 16 && bits == 8 && !offsets)) || k % group) return 1;
    const int64_t panels = (n + COLS - 1) / COLS, groups = k / group, kp = k / 2;
    float *scale = (float *)packed, *offset = scale + panels * groups * COLS;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < groups; g++)
            for (int c = 0; c < COLS; c++) {
                const int64_t row = p * COLS + c, at = (p * groups + g) * COLS + c;
                scale[at] = row < n ? scales[row * groups + g] : 0.0f;
                if (offsets) offset[at] = row < n ? offsets[row * groups + g] : 0.0f;
            }
    uint8_t *dst = (uint8_t *)packed + grouped_header_bytes(n, k, offsets != NULL, group);
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kp; i++)
            for (int c = 0; c < COLS; c++) {
                const int64_t row = p * COLS + c;
                const uint8_t *src = q + row * q_stride + 2 * i;
                if (bits == 4)
                    dst[(p * kp + i) * COLS + c] = row < n ? (uint8_t)((src[0] & 15) | (src[1] & 15) << 4) : 0;
                else
                    for (int e = 0; e < 2; e++) dst[((p * kp + i) * COLS + c) * 2 + e] = row < n ? src[e] : 0;
            }
    return 0;
}

/* Packs w [n, k] (rows contiguous, row stride w_stride) into `packed`. Returns 0, or 1 on bad arguments. */
int pd_linear_pack(const void *w, int64_t w_stride, int64_t n, int64_t k, int dtype, void *packed) {
    if (n <= 0 || k <= 0 || w_stride < k || (dtype != 0 && dtype != 1)) return 1;
    const int64_t panels = (n + COLS - 1) / COLS;
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)w;
        uint16_t *dst = (uint16_t *)packed;
        const int64_t kp = pairs_of(k);
        for (int64_t p = 0; p < panels; p++)
            for (int64_t i = 0; i < kp; i++)
                for (int c = 0; c < COLS; c++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t row = p * COLS + c, col = 2 * i + e;
                        dst[((p * kp + i) * COLS + c) * 2 + e] = row < n && col < k ? src[row * w_stride + col] : 0;
                    }
    } else {
        const float *src = (const float *)w;
        float *dst = (float *)packed;
        for (int64_t p = 0; p < panels; p++)
            for (int64_t i = 0; i < k; i++)
                for (int c = 0; c < COLS; c++) {
                    const int64_t row = p * COLS + c;
                    dst[(p * k + i) * COLS + c] = row < n ? src[row * w_stride + i] : 0.0f;
                }
    }
    return 0;
}

typedef struct {
    const void *x, *packed, *bias;
    void *out;
    int64_t x_stride, out_stride, m, n, k;
    int dtype;
    int out_f32;        /* out is float32 whatever x is (pd_linear's OUT_F32) */
    const float *xsums; /* groups with offsets, bfloat16 x: each row's sum of each group's inputs, [m][k / 32] */
} job_t;

#ifdef HAVE_AVX512
/* 16 float32 lanes to bfloat16, to nearest even on the bits (as f32_to_bf16; NaN stays NaN). */
static inline __m256i round_bf16x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* store_tile's bfloat16 rows, 16 columns at a time: the same roundings as the scalar loop. */
static void store_tile_bf16(const job_t *j, int64_t m0, int rows, int64_t c0, int cols, const float *acc) {
    const uint16_t *bias = (const uint16_t *)j->bias;
    const float *scale = quantized(j->dtype) ? (const float *)j->packed + c0 : NULL;
    for (int r = 0; r < rows; r++) {
        uint16_t *o = (uint16_t *)j->out + (m0 + r) * j->out_stride + c0;
        for (int c = 0; c < cols; c += 16) {
            const __mmask16 live = cols - c >= 16 ? 0xffff : (__mmask16)((1u << (cols - c)) - 1);
            __m512 y = _mm512_loadu_ps(acc + r * COLS + c);
            if (scale) y = _mm512_mul_ps(y, _mm512_loadu_ps(scale + c));
            if (bias) y = _mm512_add_ps(y, widen_bf16x16(bias + c0 + c, live));
            _mm256_mask_storeu_epi16(o + c, live, round_bf16x16(y));
        }
    }
}
#endif

/* A call's work items: row block i / panels against panel i % panels, for i < blocks * panels. With one
 * row block, each thread streams its own contiguous run of panels; with several, items are handed out
 * as threads come free, since the last row block is usually short (512 rows are five blocks of 96 and
 * one of 32: split by count, one thread would get 22% fewer rows). Neither changes a sum's order. */
static void run_items(void (*item)(const void *job, int64_t block, int64_t panel), const void *job, int64_t blocks,
                      int64_t panels, int threads) {
    const int64_t items = blocks * panels;
    if (blocks == 1) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
        for (int64_t i = 0; i < items; i++) item(job, 0, i);
    } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < items; i++) item(job, i / panels, i % panels);
    }
}

#include "linear_w8a8.h" /* dtypes 8 and 9: int8 weights times int8 activations */
#include "linear_w4a8.h" /* dtypes 14 and 15: 4-bit weights times int8 activations */
#include "linear_amx.h"  /* dtype 1 on AMX tiles where the CPU has them */

/* Writes the `rows` x 64 float32 sums `acc` (row stride COLS) of panel p to the output rows from m0. */
static void store_tile(const job_t *j, int64_t m0, int rows, int64_t p, const float *acc) {
    const int64_t c0 = p * COLS;
    const int cols = j->n - c0 < COLS ? (int)(j->n - c0) : COLS;
    const int bf16 = x_is_bf16(j->dtype);
    const float *scale = quantized(j->dtype) ? (const float *)j->packed + c0 : NULL;
    if (j->out_f32) {
        for (int r = 0; r < rows; r++)
            store_row_f32((float *)j->out + (m0 + r) * j->out_stride + c0, acc + r * COLS, scale, j->bias, bf16, c0,
                          cols);
        return;
    }
#ifdef HAVE_AVX512
    if (bf16) {
        store_tile_bf16(j, m0, rows, c0, cols, acc);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * COLS;
        if (bf16) {
            const uint16_t *bias = (const uint16_t *)j->bias;
            uint16_t *o = (uint16_t *)j->out + (m0 + r) * j->out_stride + c0;
            for (int c = 0; c < cols; c++) {
                const float y = scale ? a[c] * scale[c] : a[c];
                o[c] = f32_to_bf16(bias ? y + bf16_to_f32(bias[c0 + c]) : y);
            }
        } else {
            const float *bias = (const float *)j->bias;
            float *o = (float *)j->out + (m0 + r) * j->out_stride + c0;
            for (int c = 0; c < cols; c++) {
                const float y = scale ? a[c] * scale[c] : a[c];
                o[c] = bias ? y + bias[c0 + c] : y;
            }
        }
    }
}

/* The int8 panels of a quantized weight start after the scales. */
static inline const int8_t *int8_panels(const job_t *j) {
    return (const int8_t *)j->packed + (j->n + COLS - 1) / COLS * COLS * (int64_t)sizeof(float);
}

/* A grouped weight's scales, offsets (4 bits) and quantized panels, from panel p on. */
static inline const float *group_scales(const job_t *j, int64_t p) {
    return (const float *)j->packed + p * (j->k / group_inputs(j->dtype)) * COLS;
}
static inline const float *group_offsets(const job_t *j, int64_t p) {
    return group_scales(j, (j->n + COLS - 1) / COLS + p);
}
static inline const uint8_t *group_panel(const job_t *j, int64_t p, int bits) {
    const int64_t header = grouped_header_bytes(j->n, j->k, group_offsets_held(j->dtype), group_inputs(j->dtype));
    return (const uint8_t *)j->packed + header + p * pairs_of(j->k) * grouped_row_bytes(bits);
}

/* Grouped weights with float32 x (dtypes 5, 7, 11 and 13), one row at a time in plain C that the compiler
 * vectorises over the columns: pairs [i0, i1) of row m against panel p, continuing acc unless i0 is 0.
 * Not inlined, so every row runs the same code whatever the rows beside it. */
static __attribute__((noinline)) void tile_grouped_f32(const job_t *j, int64_t m, int64_t p, int64_t i0, int64_t i1,
                                                       float *acc, const int bits) {
    const float *x = (const float *)j->x + m * j->x_stride, *scale = group_scales(j, p), *offset = group_offsets(j, p);
    const uint8_t *panel = group_panel(j, p, bits);
    const int64_t row_bytes = grouped_row_bytes(bits), gp = group_inputs(j->dtype) / 2; /* pairs a group */
    const int offsets = group_offsets_held(j->dtype);
    if (!i0) memset(acc, 0, COLS * sizeof(float));
    for (int64_t g = i0 / gp; g < i1 / gp; g++) {
        float part[COLS] = {0}, xs = 0.0f;
        for (int64_t i = g * gp; i < (g + 1) * gp; i++) {
            const float x0 = x[2 * i], x1 = x[2 * i + 1];
            const uint8_t *w = panel + i * row_bytes;
            xs += x0;
            xs += x1;
            for (int c = 0; c < COLS; c++) {
                const float w0 = bits == 4 ? (float)(w[c] & 15) : (float)(int8_t)w[2 * c];
                const float w1 = bits == 4 ? (float)(w[c] >> 4) : (float)(int8_t)w[2 * c + 1];
                part[c] += x0 * w0;
                part[c] += x1 * w1;
            }
        }
        for (int c = 0; c < COLS; c++) {
            acc[c] += part[c] * scale[g * COLS + c];
            if (offsets) acc[c] += offset[g * COLS + c] * xs;
        }
    }
}

#ifdef HAVE_AVX512_BF16
typedef int32_t __attribute__((may_alias, aligned(2))) pair_t; /* two bfloat16 inputs read as one word */

/* 32 int8 weights (16 columns, a pair of inputs each) as 32 bfloat16, which hold them exactly. */
static inline __m512bh widen_int8x32(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* The sums of `rows` (a constant after inlining) rows from m0 against panel p, in bfloat16 pairs. With
 * `q8` (a constant too) the panel holds int8 weights (dtype 2), widened to bfloat16 as they are read:
 * the same products in the same order. */
static inline __attribute__((always_inline)) void tile_bf16(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                            int64_t i1, float *acc, const int rows, const int q8) {
    const int64_t kp = pairs_of(j->k), full = j->k / 2;
    const int64_t row_bytes = COLS * 2 * (q8 ? 1 : 2); /* one pair of inputs' weights for 64 columns */
    const char *panel = (q8 ? (const char *)int8_panels(j) : (const char *)j->packed) + p * kp * row_bytes;
    const pair_t *x[ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const pair_t *)((const uint16_t *)j->x + (m0 + r) * j->x_stride);
    __m512 sum[ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) sum[r][c] = i0 ? _mm512_loadu_ps(acc + r * COLS + 16 * c) : _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; i++) {
        const char *w = panel + i * row_bytes;
        prefetch_step(w, row_bytes);
        __m512bh b[4];
        for (int c = 0; c < 4; c++)
            b[c] = q8 ? widen_int8x32((const int8_t *)w + 32 * c) : (__m512bh)_mm512_loadu_si512(w + 64 * c);
        for (int r = 0; r < rows; r++) {
            /* an odd K's last input is paired with zero, not with what follows the row */
            const int32_t pair = i < full ? x[r][i] : (int32_t)((const uint16_t *)x[r])[2 * i];
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < 4; c++) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], a, b[c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * COLS + 16 * c, sum[r][c]);
}

/* 16 columns' 4-bit weights for a pair of inputs (16 bytes, the first input in the low nibble) as 32
 * bfloat16, which hold 0..15 exactly: each 32-bit lane gets its byte's low nibble in its low half and
 * its high nibble in its high half, and a table lookup turns each nibble into its bfloat16 bits. */
static inline __m512bh widen_q4x32(const uint8_t *p) {
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                           0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                           0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i nibbles = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000f000f));
    return (__m512bh)_mm512_permutexvar_epi16(nibbles, table);
}

/* The sum of one group's 32 bfloat16 inputs (16 pairs from p), in float32 and in one fixed order. */
static inline float group_sum_bf16(const pair_t *p) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    return _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(p), ones));
}

/* Pairs [i0, i1) of panel p's quantized weights widened to bfloat16, as tile_grouped_bf16 reads them,
 * into wide[i - i0][64][2]: a block of many rows widens each chunk once instead of once a tile. */
static void widen_grouped(const job_t *j, int64_t p, int64_t i0, int64_t i1, uint16_t *wide, const int bits) {
    const uint8_t *panel = group_panel(j, p, bits);
    const int64_t row_bytes = grouped_row_bytes(bits);
    for (int64_t i = i0; i < i1; i++)
        for (int c = 0; c < 4; c++) {
            const uint8_t *w = panel + i * row_bytes;
            const __m512bh b = bits == 4 ? widen_q4x32(w + 16 * c) : widen_int8x32((const int8_t *)w + 32 * c);
            _mm512_storeu_si512(wide + ((i - i0) * COLS + 16 * c) * 2, (__m512i)b);
        }
}

/* Grouped weights with bfloat16 x (dtypes 4, 6, 10 and 12): `rows`, `group` and `offsets` (constants after
 * inlining) rows from m0
 * against panel p over the pairs [i0, i1) (whole groups), the weights widened here or, when `wide` is
 * not NULL, read from widen_grouped's copy of the chunk (the same values). A group's products go into
 * registers, in tile_bf16's order; then each output's running sum in acc takes d times the group's
 * sum and, for 4 bits, m times the sum of the group's inputs (j->xsums). The running sums wait in acc
 * (the first-level cache) between groups, so that a tile holds 6 rows and widens the weights once for
 * them (measured faster than 3-row tiles with the running sums in registers). */
static inline __attribute__((always_inline)) void tile_grouped_bf16(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                                    int64_t i1, float *acc, const int rows,
                                                                    const int bits, const int group,
                                                                    const int offsets, const uint16_t *wide) {
    const int64_t groups = j->k / group, row_bytes = grouped_row_bytes(bits), gp = group / 2;
    const float *scale = group_scales(j, p), *offset = group_offsets(j, p);
    const uint8_t *panel = group_panel(j, p, bits);
    const pair_t *x[ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const pair_t *)((const uint16_t *)j->x + (m0 + r) * j->x_stride);
    if (!i0) memset(acc, 0, (size_t)rows * COLS * sizeof(float));
    for (int64_t g = i0 / gp; g < i1 / gp; g++) {
        __m512 part[ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) part[r][c] = _mm512_setzero_ps();
        for (int64_t i = g * gp; i < (g + 1) * gp; i++) {
            const uint8_t *w = panel + i * row_bytes;
            __m512bh b[4];
            if (wide) {
                for (int c = 0; c < 4; c++) b[c] = (__m512bh)_mm512_loadu_si512(wide + ((i - i0) * COLS + 16 * c) * 2);
            } else {
                prefetch_step(w, row_bytes);
                for (int c = 0; c < 4; c++)
                    b[c] = bits == 4 ? widen_q4x32(w + 16 * c) : widen_int8x32((const int8_t *)w + 32 * c);
            }
            for (int r = 0; r < rows; r++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r][i]);
                for (int c = 0; c < 4; c++) part[r][c] = _mm512_dpbf16_ps(part[r][c], a, b[c]);
            }
        }
        for (int c = 0; c < 4; c++) {
            const __m512 d = _mm512_loadu_ps(scale + g * COLS + 16 * c);
            const __m512 m = offsets ? _mm512_loadu_ps(offset + g * COLS + 16 * c) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                float *a = acc + r * COLS + 16 * c;
                __m512 s = _mm512_fmadd_ps(part[r][c], d, _mm512_loadu_ps(a));
                if (offsets) s = _mm512_fmadd_ps(m, _mm512_set1_ps(j->xsums[(m0 + r) * groups + g]), s);
                _mm512_storeu_ps(a, s);
            }
        }
    }
}
#endif

/* tile_f32 over int8 panels (dtype 3): one input at a time, the weights widened to float32. */
static inline __attribute__((always_inline)) void tile_q8_f32(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                              int64_t i1, float *acc, const int rows) {
    const int8_t *panel = int8_panels(j) + p * j->k * COLS;
    const float *x = (const float *)j->x + m0 * j->x_stride;
#ifdef HAVE_AVX512
    __m512 sum[ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) sum[r][c] = i0 ? _mm512_loadu_ps(acc + r * COLS + 16 * c) : _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; i++) {
        const int8_t *w = panel + i * COLS;
        prefetch_step(w, COLS);
        __m512 b[4];
        for (int c = 0; c < 4; c++)
            b[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * c))));
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(x[r * j->x_stride + i]);
            for (int c = 0; c < 4; c++) sum[r][c] = _mm512_fmadd_ps(a, b[c], sum[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * COLS + 16 * c, sum[r][c]);
#else
    for (int r = 0; r < rows; r++) {
        float sum[COLS];
        for (int c = 0; c < COLS; c++) sum[c] = i0 ? acc[r * COLS + c] : 0.0f;
        for (int64_t i = i0; i < i1; i++) {
            const float a = x[r * j->x_stride + i];
            const int8_t *w = panel + i * COLS;
            for (int c = 0; c < COLS; c++) sum[c] += a * (float)w[c];
        }
        memcpy(acc + r * COLS, sum, sizeof sum);
    }
#endif
}

#ifdef HAVE_AVX512
/* The float32 twin of tile_bf16: one input at a time, fused multiply-add, inputs [i0, i1). */
static inline __attribute__((always_inline)) void tile_f32(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                           int64_t i1, float *acc, const int rows) {
    const float *panel = (const float *)j->packed + p * j->k * COLS;
    const float *x = (const float *)j->x + m0 * j->x_stride;
    __m512 sum[ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) sum[r][c] = i0 ? _mm512_loadu_ps(acc + r * COLS + 16 * c) : _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; i++) {
        const float *w = panel + i * COLS;
        prefetch_step(w, COLS * (int)sizeof(float));
        const __m512 b0 = _mm512_loadu_ps(w), b1 = _mm512_loadu_ps(w + 16);
        const __m512 b2 = _mm512_loadu_ps(w + 32), b3 = _mm512_loadu_ps(w + 48);
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(x[r * j->x_stride + i]);
            sum[r][0] = _mm512_fmadd_ps(a, b0, sum[r][0]);
            sum[r][1] = _mm512_fmadd_ps(a, b1, sum[r][1]);
            sum[r][2] = _mm512_fmadd_ps(a, b2, sum[r][2]);
            sum[r][3] = _mm512_fmadd_ps(a, b3, sum[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * COLS + 16 * c, sum[r][c]);
}
#else
/* Float32 without AVX-512: the same single running sum per output, in plain C. */
static inline __attribute__((always_inline)) void tile_f32(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                           int64_t i1, float *acc, const int rows) {
    const float *panel = (const float *)j->packed + p * j->k * COLS;
    const float *x = (const float *)j->x + m0 * j->x_stride;
    for (int r = 0; r < rows; r++) {
        float sum[COLS];
        for (int c = 0; c < COLS; c++) sum[c] = i0 ? acc[r * COLS + c] : 0.0f;
        for (int64_t i = i0; i < i1; i++) {
            const float a = x[r * j->x_stride + i];
            const float *w = panel + i * COLS;
            for (int c = 0; c < COLS; c++) sum[c] += a * w[c];
        }
        memcpy(acc + r * COLS, sum, sizeof sum);
    }
}
#endif

/* The register tile for `rows` (a constant after inlining) rows over the inputs (pairs, in bfloat16)
 * [i0, i1), continuing the sums in `acc` unless i0 is 0. */
static inline __attribute__((always_inline)) void tile_rows(const job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                            int64_t i1, float *acc, const int rows,
                                                            const uint16_t *wide) {
#ifdef HAVE_AVX512_BF16
    if (j->dtype == 1) {
        tile_bf16(j, m0, p, i0, i1, acc, rows, 0);
        return;
    }
    if (j->dtype == 2) { /* the int8 twin, specialised apart */
        tile_bf16(j, m0, p, i0, i1, acc, rows, 1);
        return;
    }
    if (grouped_bf16(j->dtype)) { /* each (bits, group, offsets, widened or not) specialised apart */
        if (j->dtype == 4) {
            if (wide) tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 4, 32, 1, wide);
            else tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 4, 32, 1, NULL);
        } else if (j->dtype == 6) {
            if (wide) tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 32, 0, wide);
            else tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 32, 0, NULL);
        } else if (j->dtype == 10) {
            if (wide) tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 16, 0, wide);
            else tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 16, 0, NULL);
        } else {
            if (wide) tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 32, 1, wide);
            else tile_grouped_bf16(j, m0, p, i0, i1, acc, rows, 8, 32, 1, NULL);
        }
        return;
    }
#else
    (void)wide; /* bfloat16 x is widened only where the CPU multiplies it */
#endif
    if (grouped(j->dtype)) { /* float32 x: 5, 7, 11 and 13 */
        for (int r = 0; r < rows; r++) tile_grouped_f32(j, m0 + r, p, i0, i1, acc + r * COLS, group_bits(j->dtype));
        return;
    }
    if (j->dtype == 3) {
        tile_q8_f32(j, m0, p, i0, i1, acc, rows);
        return;
    }
    tile_f32(j, m0, p, i0, i1, acc, rows);
}

/* tile_rows with the row count made a constant in each branch, so that the sums stay in registers;
 * every branch adds each output's products in the same order. */
static void tile(const job_t *j, int64_t m0, int rows, int64_t p, int64_t i0, int64_t i1, float *acc,
                 const uint16_t *wide) {
    switch (rows) {
    case 1: tile_rows(j, m0, p, i0, i1, acc, 1, wide); break;
    case 2: tile_rows(j, m0, p, i0, i1, acc, 2, wide); break;
    case 3: tile_rows(j, m0, p, i0, i1, acc, 3, wide); break;
    case 4: tile_rows(j, m0, p, i0, i1, acc, 4, wide); break;
    case 5: tile_rows(j, m0, p, i0, i1, acc, 5, wide); break;
    default: tile_rows(j, m0, p, i0, i1, acc, 6, wide); break;
    }
}

/* One work item: rows [block * ROW_BLOCK, +ROW_BLOCK) against panel p. The inputs go in chunks so that
 * a chunk of the panel stays in the core's first-level cache for all the block's rows; the sums wait
 * in `acc` between chunks and go on in the same order, so the chunking changes no result. */
static void run_item(const void *job, int64_t block, int64_t p) {
    const job_t *j = job;
    float acc[ROW_BLOCK * COLS];
    const int64_t start = block * ROW_BLOCK, end = start + ROW_BLOCK < j->m ? start + ROW_BLOCK : j->m;
#ifdef HAVE_AMX
    if (j->dtype == 1 && amx_on()) {
        amx_item_bf16(j, block, p, acc);
        for (int64_t m0 = start; m0 < end; m0 += ROWS)
            store_tile(j, m0, end - m0 < ROWS ? (int)(end - m0) : ROWS, p, acc + (m0 - start) * COLS);
        return;
    }
#endif
    const int pairs = x_is_bf16(j->dtype) || grouped(j->dtype);
    const int64_t steps = pairs ? pairs_of(j->k) : j->k, chunk = pairs ? K_CHUNK : 2 * K_CHUNK;
    /* Grouped bfloat16 weights widened once a chunk for blocks of many rows (a prompt's); below
     * WIDEN_ROWS, widening in each tile measured faster than the copy's stores and loads. */
    uint16_t *wide = NULL;
#ifdef HAVE_AVX512_BF16
    uint16_t widened[K_CHUNK * COLS * 2] __attribute__((aligned(64)));
    if (grouped_bf16(j->dtype) && end - start >= WIDEN_ROWS) wide = widened;
#endif
    for (int64_t i0 = 0; i0 < steps; i0 += chunk) {
        const int64_t i1 = i0 + chunk < steps ? i0 + chunk : steps;
#ifdef HAVE_AVX512_BF16
        if (wide) widen_grouped(j, p, i0, i1, wide, group_bits(j->dtype));
#endif
        for (int64_t m0 = start; m0 < end; m0 += ROWS)
            tile(j, m0, end - m0 < ROWS ? (int)(end - m0) : ROWS, p, i0, i1, acc + (m0 - start) * COLS, wide);
    }
    for (int64_t m0 = start; m0 < end; m0 += ROWS)
        store_tile(j, m0, end - m0 < ROWS ? (int)(end - m0) : ROWS, p, acc + (m0 - start) * COLS);
}

/* Whether this build can run `dtype`: 1 or 0. */
int pd_linear_supported(int dtype) {
    if (dtype == PARTS) return 1; /* as its parts are */
#ifdef HAVE_AVX512_BF16
    return dtype >= 0 && dtype <= 15;
#else
    return dtype == 0 || dtype == 3 || dtype == 5 || dtype == 7 || dtype == 9 || dtype == 11 || dtype == 13 ||
           dtype == 15;
#endif
}

/* Writes the header of a weight of `count` parts (outputs and dtype of each) into `packed` and returns
 * the byte offset of each part's packed weight into `offsets` (64-byte aligned, after the header);
 * the caller packs each part there. Returns the bytes of the whole, or -1 on bad arguments. */
int64_t pd_linear_pack_parts(int64_t count, const int64_t *outputs, const int32_t *dtypes, int64_t k, void *packed,
                             int64_t *offsets) {
    if (count < 1) return -1;
    int64_t at = ((1 + 3 * count) * (int64_t)sizeof(int64_t) + 63) / 64 * 64;
    for (int64_t i = 0; i < count; i++) {
        if (outputs[i] <= 0 || dtypes[i] < 0 || dtypes[i] == PARTS || dtypes[i] > 13) return -1;
        offsets[i] = at;
        at += (pd_linear_packed_elems(outputs[i], k, dtypes[i]) * (dtypes[i] == 0 ? 4 : dtypes[i] == 1 ? 2 : 1) + 63) /
              64 * 64;
    }
    if (packed != NULL) {
        int64_t *h = (int64_t *)packed;
        h[0] = count;
        for (int64_t i = 0; i < count; i++) {
            h[1 + 3 * i] = outputs[i];
            h[2 + 3 * i] = dtypes[i];
            h[3 + 3 * i] = offsets[i];
        }
    }
    return at;
}

int pd_linear(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out, int64_t out_stride,
              int64_t m, int64_t n, int64_t k, int dtype, int threads);

/* pd_linear for a weight of parts: one call a part, each on its columns of out. */
static int linear_parts(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
                        int64_t out_stride, int64_t m, int64_t n, int64_t k, int out_f32, int threads) {
    const int64_t *h = (const int64_t *)packed;
    int64_t row = 0;
    for (int64_t i = 0; i < h[0]; i++) {
        const int64_t outputs = h[1 + 3 * i], dtype = h[2 + 3 * i], offset = h[3 + 3 * i];
        const int64_t esize = x_is_bf16((int)dtype) || dtype == 8 ? 2 : 4; /* x and bias elements */
        const int64_t osize = out_f32 ? 4 : esize;
        if (row + outputs > n) return 1;
        const int status = pd_linear(x, x_stride, (const char *)packed + offset,
                                     bias ? (const char *)bias + row * esize : NULL, (char *)out + row * osize,
                                     out_stride, m, outputs, k, (int)dtype | (out_f32 ? OUT_F32 : 0), threads);
        if (status) return status;
        row += outputs;
    }
    return row == n ? 0 : 1;
}

/* Returns 0 on success, 1 on bad arguments, 2 when out of memory, 3 when this build cannot run the dtype.
 * `dtype | OUT_F32` writes out as float32 sums (bias added, not rounded) whatever x's dtype. */
int pd_linear(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int dtype, int threads) {
    const int out_f32 = (dtype & OUT_F32) != 0;
    dtype &= ~OUT_F32;
    if (dtype == PARTS) {
        if (m < 0 || n <= 0 || k <= 0 || x_stride < k || out_stride < n) return 1;
        return linear_parts(x, x_stride, packed, bias, out, out_stride, m, n, k, out_f32, threads);
    }
    if (m < 0 || n <= 0 || k <= 0 || x_stride < k || out_stride < n || dtype < 0 || dtype > 15) return 1;
    if ((grouped(dtype) && k % group_inputs(dtype)) || ((w8a8(dtype) || w4a8(dtype)) && k % GROUP)) return 1;
    if (!pd_linear_supported(dtype)) return 3;
    if (w8a8(dtype)) return linear_w8a8(x, x_stride, packed, bias, out, out_stride, m, n, k, dtype, out_f32, threads);
    if (w4a8(dtype)) return linear_w4a8(x, x_stride, packed, bias, out, out_stride, m, n, k, dtype, out_f32, threads);
    float *xsums = NULL;
#ifdef HAVE_AVX512_BF16
    if ((dtype == 4 || dtype == 12) && m > 0) { /* once a call, not once a panel: the same sums either way */
        const int64_t groups = k / GROUP;
        if (!(xsums = malloc((size_t)(m * groups) * sizeof(float)))) return 2;
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++)
                xsums[r * groups + g] = group_sum_bf16((const pair_t *)((const uint16_t *)x + r * x_stride) + g * (GROUP / 2));
    }
#endif
    const job_t job = {x, packed, bias, out, x_stride, out_stride, m, n, k, dtype, out_f32, xsums};
    const int64_t panels = (n + COLS - 1) / COLS, blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    if (threads < 1 || m * n * k < SERIAL_MACS) threads = 1;
    run_items(run_item, &job, blocks, panels, threads);
    free(xsums);
    return 0;
}

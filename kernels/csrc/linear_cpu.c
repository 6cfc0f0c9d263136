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
 * Layouts (element strides): x row m starts at m * x_stride, out row m at m * out_stride, elements
 * contiguous. dtype: 0 float32, 1 bfloat16 (x, weight, bias and out alike). Rounding to bfloat16 is
 * to nearest even on the bits, as torch rounds.
 *
 * Built by kernels/cpu_build.py with -O3 -march=native -fopenmp; bfloat16 needs AVX512-BF16, float32
 * takes AVX-512 where the CPU has it and plain C that the compiler vectorises elsewhere.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif
#endif

#include "cpu_scalar.h"

#define COLS 64          /* output columns per panel: four 16-lane vectors */
#define ROWS 6           /* rows per register tile: 6 x 4 accumulators */
#define ROW_BLOCK 96     /* rows per work item: a panel is read from cache this many rows at a time */
#define K_CHUNK 64       /* input pairs per pass over a block's rows: 16 KiB of a bfloat16 panel */
#ifndef PREFETCH_PAIRS
#define PREFETCH_PAIRS 128 /* how far ahead (in pairs of inputs) the weight stream is asked for: 32 KiB */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 1 /* into the outer caches (prefetcht2): the stream outruns a first-level cache */
#endif
#define SERIAL_MACS 32768 /* multiply-adds below which a call stays on one thread */

static inline int64_t pairs_of(int64_t k) { return (k + 1) / 2; }

static inline int quantized(int dtype) { return dtype == 2 || dtype == 3; }

/* Elements of the packed weight of an [n, k] linear in `dtype` (bytes for the int8 dtypes: the scales'
 * too). */
int64_t pd_linear_packed_elems(int64_t n, int64_t k, int dtype) {
    const int64_t panels = (n + COLS - 1) / COLS;
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

static inline __m512 widen_bf16x16(const uint16_t *p, __mmask16 live) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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

/* Writes the `rows` x 64 float32 sums `acc` (row stride COLS) of panel p to the output rows from m0. */
static void store_tile(const job_t *j, int64_t m0, int rows, int64_t p, const float *acc) {
    const int64_t c0 = p * COLS;
    const int cols = j->n - c0 < COLS ? (int)(j->n - c0) : COLS;
    const int bf16 = j->dtype == 1 || j->dtype == 2;
#ifdef HAVE_AVX512
    if (bf16) {
        store_tile_bf16(j, m0, rows, c0, cols, acc);
        return;
    }
#endif
    const float *scale = quantized(j->dtype) ? (const float *)j->packed + c0 : NULL;
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
        __builtin_prefetch(w + PREFETCH_PAIRS * row_bytes, 0, PREFETCH_HINT);
        __builtin_prefetch(w + PREFETCH_PAIRS * row_bytes + row_bytes / 2, 0, PREFETCH_HINT);
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
        __builtin_prefetch(w + PREFETCH_PAIRS * COLS, 0, PREFETCH_HINT);
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
        __builtin_prefetch(w + PREFETCH_PAIRS * COLS, 0, PREFETCH_HINT);
        __builtin_prefetch(w + PREFETCH_PAIRS * COLS + 16, 0, PREFETCH_HINT);
        __builtin_prefetch(w + PREFETCH_PAIRS * COLS + 32, 0, PREFETCH_HINT);
        __builtin_prefetch(w + PREFETCH_PAIRS * COLS + 48, 0, PREFETCH_HINT);
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
                                                            int64_t i1, float *acc, const int rows) {
#ifdef HAVE_AVX512_BF16
    if (j->dtype == 1) {
        tile_bf16(j, m0, p, i0, i1, acc, rows, 0);
        return;
    }
    if (j->dtype == 2) { /* the int8 twin, specialised apart */
        tile_bf16(j, m0, p, i0, i1, acc, rows, 1);
        return;
    }
#endif
    if (j->dtype == 3) {
        tile_q8_f32(j, m0, p, i0, i1, acc, rows);
        return;
    }
    tile_f32(j, m0, p, i0, i1, acc, rows);
}

/* tile_rows with the row count made a constant in each branch, so that the sums stay in registers;
 * every branch adds each output's products in the same order. */
static void tile(const job_t *j, int64_t m0, int rows, int64_t p, int64_t i0, int64_t i1, float *acc) {
    switch (rows) {
    case 1: tile_rows(j, m0, p, i0, i1, acc, 1); break;
    case 2: tile_rows(j, m0, p, i0, i1, acc, 2); break;
    case 3: tile_rows(j, m0, p, i0, i1, acc, 3); break;
    case 4: tile_rows(j, m0, p, i0, i1, acc, 4); break;
    case 5: tile_rows(j, m0, p, i0, i1, acc, 5); break;
    default: tile_rows(j, m0, p, i0, i1, acc, 6); break;
    }
}

/* One work item: rows [block * ROW_BLOCK, +ROW_BLOCK) against panel p. The inputs go in chunks so that
 * a chunk of the panel stays in the core's first-level cache for all the block's rows; the sums wait
 * in `acc` between chunks and go on in the same order, so the chunking changes no result. */
static void run_item(const job_t *j, int64_t block, int64_t p) {
    float acc[ROW_BLOCK * COLS];
    const int64_t start = block * ROW_BLOCK, end = start + ROW_BLOCK < j->m ? start + ROW_BLOCK : j->m;
    const int pairs = j->dtype == 1 || j->dtype == 2;
    const int64_t steps = pairs ? pairs_of(j->k) : j->k, chunk = pairs ? K_CHUNK : 2 * K_CHUNK;
    for (int64_t i0 = 0; i0 < steps; i0 += chunk) {
        const int64_t i1 = i0 + chunk < steps ? i0 + chunk : steps;
        for (int64_t m0 = start; m0 < end; m0 += ROWS)
            tile(j, m0, end - m0 < ROWS ? (int)(end - m0) : ROWS, p, i0, i1, acc + (m0 - start) * COLS);
    }
    for (int64_t m0 = start; m0 < end; m0 += ROWS)
        store_tile(j, m0, end - m0 < ROWS ? (int)(end - m0) : ROWS, p, acc + (m0 - start) * COLS);
}

/* Whether this build can run `dtype`: 1 or 0. */
int pd_linear_supported(int dtype) {
#ifdef HAVE_AVX512_BF16
    return dtype >= 0 && dtype <= 3;
#else
    return dtype == 0 || dtype == 3;
#endif
}

/* Returns 0 on success, 1 on bad arguments, 3 when this build cannot run the dtype. */
int pd_linear(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
              int64_t out_stride, int64_t m, int64_t n, int64_t k, int dtype, int threads) {
    if (m < 0 || n <= 0 || k <= 0 || x_stride < k || out_stride < n || dtype < 0 || dtype > 3) return 1;
    if (!pd_linear_supported(dtype)) return 3;
    const job_t job = {x, packed, bias, out, x_stride, out_stride, m, n, k, dtype};
    const int64_t panels = (n + COLS - 1) / COLS, blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t items = panels * blocks;
    if (threads < 1 || m * n * k < SERIAL_MACS) threads = 1;
    /* Item i is row block i / panels and panel i % panels. With one row block, each thread streams its
     * own contiguous run of panels; with several, items are handed out as threads come free, since the
     * last row block is usually short (512 rows are five blocks of 96 and one of 32: split by count,
     * one thread would get 22% fewer rows). Neither changes a sum's order. */
    if (blocks == 1) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
        for (int64_t i = 0; i < items; i++) run_item(&job, 0, i);
    } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < items; i++) run_item(&job, i / panels, i % panels);
    }
    return 0;
}

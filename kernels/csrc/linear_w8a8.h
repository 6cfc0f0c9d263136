/* pd_linear's dtypes 8 and 9: int8 weights times int8 activations (W8A8).
 *
 *   y[m, n] = round(sw[n] * sum_g (float(sum_{k in g} qx[m, k] qw[n, k]) * sx[m, g]) + bias[n])
 *
 * Weights: symmetric int8 with one float32 scale sw per output (linear_cpu.py's quantize_int8), packed
 * once by pd_linear_pack_w8a8. Activations: quantized as the call starts, each row in groups g of 32
 * inputs (as llama.cpp's Q8_0 activations), symmetric int8 with one float32 scale per group:
 * sx = max |x| / 127 over the group, qx = round(x / sx), half to even (a group of zeros: scale 0, every
 * q 0). One scale per row instead cost SmolLM2-135M 4.7% in perplexity, groups of 32 0.2%.
 *
 * A group's products are summed in int32, which is exact; the groups' sums are scaled and added in
 * float32 one group after the other (a multiply, then an add: two roundings, as the torch reference
 * does them), so a row's result depends on nothing but the row: not the batch, the chunking, the
 * thread count or the instruction set (plain C gives the bits that AVX512-VNNI gives). dtype 8:
 * bfloat16 x, bias and out; dtype 9: float32. K must be a multiple of 32.
 *
 * VPDPBUSD multiplies unsigned bytes by signed ones, four pairs a lane: the weights are packed as
 * qw + 128 (1..255), and each group's sum starts from -128 times the group's sum of qx, which the
 * quantization counts. One instruction does 64 multiply-adds where VDPBF16PS does 32, at the same
 * rate on the 2-core Zen 5 this was measured on, so steps bound by arithmetic (prompts, large batches)
 * run faster than in bfloat16.
 *
 * With AVX2 alone (no VNNI), VPMADDUBSW multiplies the same bytes in pairs summed in 16 bits, which
 * qw + 128 would overflow (2 * 255 * 127): the tile takes qw back (the top bit flipped) and multiplies
 * |qx| by qw with qx's sign (VPSIGNB), each pair at most 2 * 127 * 127 = 32258, then widens the pairs to
 * int32 (VPMADDWD with ones). The group's sum is the same integer, without the starting -128 sum qx,
 * hence the same bits.
 *
 * Packed layout (bytes): scales [panels][64] float32, then each panel's quads of inputs,
 * panel[k / 4][64][4] uint8 (qw + 128; columns past n hold 128, a zero weight).
 * Included by linear_cpu.c (COLS, ROW_BLOCK, the prefetch distance, the rounding helpers, w8a8(), the
 * packed size and run_items).
 */
#ifndef PDFABRIC_LINEAR_W8A8_H
#define PDFABRIC_LINEAR_W8A8_H

#include <math.h>

#define W8_ROWS 4        /* rows per register tile: 4 x 4 integer sums (6 rows spilled, no faster) */
#define QUAD_CHUNK 64    /* quads of inputs per pass over a block's rows: 16 KiB of a panel, 8 groups */
#define W8_GROUP 32      /* inputs per activation scale */
#define W8_QUADS (W8_GROUP / 4)

/* The running float32 sums wait in acc (the first-level cache) between groups, not in registers: the
 * compiler otherwise keeps all 16 of them there beside the 16 integer sums and, out of registers,
 * reloads each weight vector once a row (20 loads per 16 VPDPBUSD, which bound the tile). Held in
 * memory, the tile loads each weight once for its rows: SmolLM2's layers 13-18% faster in W8A8 at 8 to
 * 512 rows on the 2-core Zen 5, the same bits. */
#define SUMS_IN_MEMORY() __asm__ volatile("" ::: "memory")

/* Packs int8 weights q [n, k] (row stride q_stride; symmetric, -127..127) and their per-output scales [n]
 * for dtypes 8 and 9. Returns 0, or 1 on bad arguments (K not a multiple of 32, a weight of -128). */
int pd_linear_pack_w8a8(const int8_t *q, int64_t q_stride, const float *scales, int64_t n, int64_t k, void *packed) {
    if (n <= 0 || k <= 0 || k % W8_GROUP || q_stride < k) return 1;
    for (int64_t row = 0; row < n; row++)
        for (int64_t i = 0; i < k; i++)
            if (q[row * q_stride + i] == -128) return 1; /* beyond the AVX2 tile's 16-bit pairs */
    const int64_t panels = (n + COLS - 1) / COLS, k4 = k / 4;
    float *scale = (float *)packed;
    uint8_t *dst = (uint8_t *)(scale + panels * COLS);
    for (int64_t c = 0; c < panels * COLS; c++) scale[c] = c < n ? scales[c] : 0.0f;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k4; i++)
            for (int c = 0; c < COLS; c++)
                for (int e = 0; e < 4; e++) {
                    const int64_t row = p * COLS + c;
                    dst[((p * k4 + i) * COLS + c) * 4 + e] = (uint8_t)((row < n ? q[row * q_stride + 4 * i + e] : 0) + 128);
                }
    return 0;
}

typedef struct {
    const int8_t *xq;     /* [m][k]: the rows quantized */
    const float *xs;      /* [m][k / 32]: each group's scale */
    const int32_t *start; /* [m][k / 32]: -128 times each group's sum of qx */
    const float *scale;
    const uint8_t *panels;
    const void *bias;
    void *out;
    int64_t out_stride, m, n, k;
    int dtype;
    int out_f32; /* float32 out whatever x is */
} w8_job_t;

/* Row x (k inputs of `dtype`) quantized into q, each group's scale into xs and starting sum into start. */
static void quantize_row(const void *x, int dtype, int64_t k, int8_t *q, float *xs, int32_t *start) {
    const uint16_t *xb = (const uint16_t *)x;
    const float *xf = (const float *)x;
    for (int64_t g = 0; g < k / W8_GROUP; g++) {
        const int64_t g0 = g * W8_GROUP;
        float amax = 0.0f;
        int32_t sum = 0;
#ifdef HAVE_AVX512
        __m512 v[2];
        for (int h = 0; h < 2; h++)
            v[h] = dtype == 8 ? widen_bf16x16(xb + g0 + 16 * h, 0xffff) : _mm512_loadu_ps(xf + g0 + 16 * h);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))); /* any order */
        const float s = amax / 127.0f;
        /* the scalar loop's division, rounding (the default mode: to nearest even) and clamp */
        for (int h = 0; h < 2; h++) {
            __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(v[h], _mm512_set1_ps(s > 0.0f ? s : 1.0f)));
            r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            if (!(s > 0.0f)) r = _mm512_setzero_si512();
            sum += _mm512_reduce_add_epi32(r);
            _mm_storeu_si128((__m128i *)(q + g0 + 16 * h), _mm512_cvtepi32_epi8(r));
        }
#else
        for (int64_t i = g0; i < g0 + W8_GROUP; i++) {
            const float v = fabsf(dtype == 8 ? bf16_to_f32(xb[i]) : xf[i]);
            amax = v > amax ? v : amax;
        }
        const float s = amax / 127.0f;
        for (int64_t i = g0; i < g0 + W8_GROUP; i++) {
            float v = s > 0.0f ? nearbyintf((dtype == 8 ? bf16_to_f32(xb[i]) : xf[i]) / s) : 0.0f;
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[i] = (int8_t)v;
            sum += (int32_t)v;
        }
#endif
        xs[g] = s;
        start[g] = -128 * sum;
    }
}

/* A call's input rows quantized (quantize_row each): q [m][k], scales xs and starting sums start
 * [m][k / 32]; free them with free_quantized. */
typedef struct {
    int8_t *q;
    float *xs;
    int32_t *start;
} quantized_rows_t;

static void free_quantized(quantized_rows_t *rows) {
    free(rows->q);
    free(rows->xs);
    free(rows->start);
}

/* Quantizes the m rows of x (row stride x_stride elements of dtype 8, bfloat16, or 9, float32) into
 * rows; 0, or 2 when out of memory (nothing to free then). */
static int quantize_rows(const void *x, int64_t x_stride, int dtype, int64_t m, int64_t k, int threads,
                         quantized_rows_t *rows) {
    const int64_t groups = k / W8_GROUP, esize = dtype == 8 ? 2 : 4;
    rows->q = malloc((size_t)(m * k) + 1);
    rows->xs = malloc((size_t)(m * groups) * sizeof(float) + 1);
    rows->start = malloc((size_t)(m * groups) * sizeof(int32_t) + 1);
    if (!rows->q || !rows->xs || !rows->start) {
        free_quantized(rows);
        return 2;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(m >= 16 ? threads : 1) schedule(static)
#endif
    for (int64_t r = 0; r < m; r++)
        quantize_row((const char *)x + r * x_stride * esize, dtype, k, rows->q + r * k, rows->xs + r * groups,
                     rows->start + r * groups);
    return 0;
}

/* The float32 sums of `rows` (a constant after inlining) rows from m0 against panel p over the quads
 * [i0, i1) (whole groups), continuing acc unless i0 is 0. */
static inline __attribute__((always_inline)) void w8_tile_rows(const w8_job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                               int64_t i1, float *acc, const int rows) {
    const int64_t k4 = j->k / 4, groups = j->k / W8_GROUP;
    const uint8_t *panel = j->panels + p * k4 * COLS * 4;
#if defined(__AVX512VNNI__)
    const quad_t *x[W8_ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const quad_t *)(j->xq + (m0 + r) * j->k);
    if (!i0) memset(acc, 0, (size_t)rows * COLS * sizeof(float));
    for (int64_t g = i0 / W8_QUADS; g < i1 / W8_QUADS; g++) {
        __m512i part[W8_ROWS][4];
        for (int r = 0; r < rows; r++) {
            const __m512i begin = _mm512_set1_epi32(j->start[(m0 + r) * groups + g]);
            for (int c = 0; c < 4; c++) part[r][c] = begin;
        }
        for (int64_t i = g * W8_QUADS; i < (g + 1) * W8_QUADS; i++) {
            const uint8_t *w = panel + i * COLS * 4;
            prefetch_step(w, COLS * 4);
            __m512i b[4];
            for (int c = 0; c < 4; c++) b[c] = _mm512_loadu_si512(w + 64 * c);
            for (int r = 0; r < rows; r++) {
                const __m512i a = _mm512_set1_epi32(x[r][i]);
                for (int c = 0; c < 4; c++) part[r][c] = dpbusd(part[r][c], b[c], a);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_set1_ps(j->xs[(m0 + r) * groups + g]);
            for (int c = 0; c < 4; c++) {
                float *a = acc + r * COLS + 16 * c;
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_mul_ps(_mm512_cvtepi32_ps(part[r][c]), s)));
            }
        }
        SUMS_IN_MEMORY();
    }
#elif defined(__AVX2__)
    const quad_t *x[W8_ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const quad_t *)(j->xq + (m0 + r) * j->k);
    if (!i0) memset(acc, 0, (size_t)rows * COLS * sizeof(float));
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t g = i0 / W8_QUADS; g < i1 / W8_QUADS; g++) {
        const int64_t first = g * W8_QUADS;
        for (int64_t i = first; i < first + W8_QUADS; i++) prefetch_step(panel + i * COLS * 4, COLS * 4);
        for (int c = 0; c < COLS / 8; c++) { /* eight columns a vector */
            __m256i part[W8_ROWS];
            for (int r = 0; r < rows; r++) part[r] = _mm256_setzero_si256();
            for (int64_t i = first; i < first + W8_QUADS; i++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(panel + i * COLS * 4 + 32 * c));
                const __m256i w = _mm256_xor_si256(raw, flip); /* qw + 128 back to qw */
                for (int r = 0; r < rows; r++) {
                    const __m256i a = _mm256_set1_epi32(x[r][i]);
                    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a));
                    part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            for (int r = 0; r < rows; r++) {
                float *a = acc + r * COLS + 8 * c;
                const __m256 s = _mm256_set1_ps(j->xs[(m0 + r) * groups + g]);
                _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_cvtepi32_ps(part[r]), s)));
            }
        }
    }
#else
    for (int r = 0; r < rows; r++) {
        const int8_t *x = j->xq + (m0 + r) * j->k;
        float *f = acc + r * COLS;
        if (!i0) memset(f, 0, COLS * sizeof(float));
        for (int64_t g = i0 / W8_QUADS; g < i1 / W8_QUADS; g++) {
            int32_t part[COLS];
            for (int c = 0; c < COLS; c++) part[c] = j->start[(m0 + r) * groups + g];
            for (int64_t i = g * W8_QUADS; i < (g + 1) * W8_QUADS; i++)
                for (int e = 0; e < 4; e++) {
                    const int32_t a = x[4 * i + e];
                    const uint8_t *w = panel + i * COLS * 4 + e;
                    for (int c = 0; c < COLS; c++) part[c] += a * w[4 * c];
                }
            const float s = j->xs[(m0 + r) * groups + g];
            for (int c = 0; c < COLS; c++) f[c] = f[c] + (float)part[c] * s;
        }
    }
#endif
}

static void w8_tile(const w8_job_t *j, int64_t m0, int rows, int64_t p, int64_t i0, int64_t i1, float *acc) {
    switch (rows) {
    case 1: w8_tile_rows(j, m0, p, i0, i1, acc, 1); break;
    case 2: w8_tile_rows(j, m0, p, i0, i1, acc, 2); break;
    case 3: w8_tile_rows(j, m0, p, i0, i1, acc, 3); break;
    default: w8_tile_rows(j, m0, p, i0, i1, acc, 4); break;
    }
}

/* Rows [m0, m0 + rows) of panel p's outputs from their float32 sums: scaled, biased, rounded. */
static void w8_store(const w8_job_t *j, int64_t m0, int rows, int64_t p, const float *acc) {
    const int64_t c0 = p * COLS;
    const int cols = j->n - c0 < COLS ? (int)(j->n - c0) : COLS;
    const float *scale = j->scale + c0;
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * COLS;
        if (j->out_f32) {
            store_row_f32((float *)j->out + (m0 + r) * j->out_stride + c0, a, scale, j->bias, j->dtype == 8, c0, cols);
        } else if (j->dtype == 8) {
            const uint16_t *bias = (const uint16_t *)j->bias;
            uint16_t *o = (uint16_t *)j->out + (m0 + r) * j->out_stride + c0;
#ifdef HAVE_AVX512
            for (int c = 0; c < cols; c += 16) {
                const __mmask16 live = cols - c >= 16 ? 0xffff : (__mmask16)((1u << (cols - c)) - 1);
                __m512 y = _mm512_mul_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(scale + c));
                if (bias) y = _mm512_add_ps(y, widen_bf16x16(bias + c0 + c, live));
                _mm256_mask_storeu_epi16(o + c, live, round_bf16x16(y));
            }
#else
            for (int c = 0; c < cols; c++) {
                const float y = a[c] * scale[c];
                o[c] = f32_to_bf16(bias ? y + bf16_to_f32(bias[c0 + c]) : y);
            }
#endif
        } else {
            const float *bias = (const float *)j->bias;
            float *o = (float *)j->out + (m0 + r) * j->out_stride + c0;
            for (int c = 0; c < cols; c++) {
                const float y = a[c] * scale[c];
                o[c] = bias ? y + bias[c0 + c] : y;
            }
        }
    }
}

/* Rows [block * ROW_BLOCK, +ROW_BLOCK) against panel p, the inputs in chunks that stay in the first-
 * level cache for all the block's rows; the sums wait in acc between chunks and go on in order. */
static void w8_item(const void *job, int64_t block, int64_t p) {
    const w8_job_t *j = job;
    float acc[ROW_BLOCK * COLS];
    const int64_t start = block * ROW_BLOCK, end = start + ROW_BLOCK < j->m ? start + ROW_BLOCK : j->m;
    const int64_t k4 = j->k / 4;
    for (int64_t i0 = 0; i0 < k4; i0 += QUAD_CHUNK) {
        const int64_t i1 = i0 + QUAD_CHUNK < k4 ? i0 + QUAD_CHUNK : k4;
        for (int64_t m0 = start; m0 < end; m0 += W8_ROWS)
            w8_tile(j, m0, end - m0 < W8_ROWS ? (int)(end - m0) : W8_ROWS, p, i0, i1, acc + (m0 - start) * COLS);
    }
    for (int64_t m0 = start; m0 < end; m0 += W8_ROWS)
        w8_store(j, m0, end - m0 < W8_ROWS ? (int)(end - m0) : W8_ROWS, p, acc + (m0 - start) * COLS);
}

/* pd_linear for dtypes 8 and 9 (its arguments checked): 0, 1 on bad arguments, 2 when out of memory. */
static int linear_w8a8(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
                       int64_t out_stride, int64_t m, int64_t n, int64_t k, int dtype, int out_f32, int threads) {
    if (k % W8_GROUP) return 1;
    const int64_t panels = (n + COLS - 1) / COLS;
    if (threads < 1) threads = 1;
    quantized_rows_t rows;
    if (quantize_rows(x, x_stride, dtype, m, k, threads, &rows)) return 2;
    const w8_job_t job = {rows.q, rows.xs, rows.start, (const float *)packed,
                          (const uint8_t *)packed + panels * COLS * sizeof(float), bias, out, out_stride, m, n, k, dtype,
                          out_f32};
    if (m * n * k < SERIAL_MACS) threads = 1;
    run_items(w8_item, &job, (m + ROW_BLOCK - 1) / ROW_BLOCK, panels, threads);
    free_quantized(&rows);
    return 0;
}

#endif

/* pd_linear's dtypes 14 and 15: 4-bit weights times int8 activations (W4A8).
 *
 *   y[m, n] = round(sum_g (d[n, g] * (P[m, n, g] * sx[m, g]) + o[n, g] * (S[m, g] * sx[m, g])) + bias[n])
 *
 * with P the integer sum of a group's products qx[m, k] q[n, k] and S that of its quantized inputs.
 *
 * Weights: pdfabric's int4 (quantized.quantize_int4): q in 0..15 with a float32 scale d and offset o per
 * output and group g of 32 inputs, the weight being d * q + o; packed once by pd_linear_pack_w4a8.
 * Activations: quantized as the call starts exactly as W8A8's (linear_w8a8.h's quantize_row: groups of 32,
 * a float32 scale sx each). A group's two integer sums are exact in int32; then, in float32 and in this
 * order: P times sx (rounded), and d times that added to the output's running sum in one fused
 * multiply-add, then o times S sx (rounded once a row and group) in another; group after group (four
 * operations a sum where separate multiplies and adds took six: SmolLM2's layers 6-10% faster). The
 * torch reference (w8a8_ref.w4a8_reference, its fma32 exact) and plain C's fmaf round them the same, so
 * a row's result depends on nothing but the row.
 *
 * VPDPBUSD multiplies unsigned bytes by signed ones: the 4-bit levels are the unsigned side as they are,
 * the quantized inputs the signed one. A step reads eight inputs of 64 columns (256 bytes: byte e of a
 * column's word holds input e in its low nibble and input 4 + e in its high one), splits the nibbles and
 * runs two VPDPBUSD per column vector: 64 multiply-adds an instruction where int4's bfloat16 path does
 * 32, from the same 4 bits a weight.
 *
 * With AVX2 alone (no VNNI), VPMADDUBSW does the same products in pairs, summed in 16 bits: a group's
 * 32 products of a column fall in 16-bit lanes two by two, each lane at most 16 * 15 * 127 = 30480 in
 * magnitude (the inputs are clamped to -127..127), so the sums are exact without saturating, and
 * VPMADDWD with ones widens each column's two lanes to its group's int32 sum once a group: the same
 * integers, hence the same bits, as VPDPBUSD's path and plain C. A tile takes eight columns a vector,
 * all four octets of a group, then the next eight columns.
 *
 * Packed layout (bytes): d [panels][groups][64] float32, o the same, then each panel's octets of inputs,
 * panel[k / 8][64][4] uint8 (columns past n hold zero weights and zero d and o).
 * Included by linear_cpu.c after linear_w8a8.h (its quantize_rows, W8_GROUP, W8_ROWS, QUAD_CHUNK and
 * SUMS_IN_MEMORY; w4a8() and the packed size are linear_cpu.c's).
 */
#ifndef PDFABRIC_LINEAR_W4A8_H
#define PDFABRIC_LINEAR_W4A8_H

#define W4_OCTETS (W8_GROUP / 8) /* steps of eight inputs a group */

/* Packs 4-bit weights q [n, k] (one byte a weight, 0..15, row stride q_stride) with their scales and
 * offsets [n, k / 32] (float32, contiguous) for dtypes 14 and 15. Returns 0, or 1 on bad arguments. */
int pd_linear_pack_w4a8(const uint8_t *q, int64_t q_stride, const float *scales, const float *offsets, int64_t n,
                        int64_t k, void *packed) {
    if (n <= 0 || k <= 0 || k % W8_GROUP || q_stride < k) return 1;
    const int64_t panels = (n + COLS - 1) / COLS, groups = k / W8_GROUP, k8 = k / 8;
    float *d = (float *)packed, *o = d + panels * groups * COLS;
    uint8_t *dst = (uint8_t *)(o + panels * groups * COLS);
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < groups; g++)
            for (int c = 0; c < COLS; c++) {
                const int64_t row = p * COLS + c, at = (p * groups + g) * COLS + c;
                d[at] = row < n ? scales[row * groups + g] : 0.0f;
                o[at] = row < n ? offsets[row * groups + g] : 0.0f;
            }
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k8; i++)
            for (int c = 0; c < COLS; c++)
                for (int e = 0; e < 4; e++) {
                    const int64_t row = p * COLS + c;
                    const uint8_t *src = q + row * q_stride + 8 * i + e;
                    dst[((p * k8 + i) * COLS + c) * 4 + e] = row < n ? (uint8_t)((src[0] & 15) | (src[4] & 15) << 4) : 0;
                }
    return 0;
}

typedef struct {
    const int8_t *xq;     /* [m][k]: the rows quantized */
    const float *xs;      /* [m][k / 32]: each group's scale */
    const int32_t *start; /* [m][k / 32]: -128 times each group's sum of qx (quantize_row's) */
    const float *d, *o;   /* [panels][groups][64] */
    const uint8_t *panels;
    const void *bias;
    void *out;
    int64_t out_stride, m, n, k;
    int dtype;
    int out_f32; /* float32 out whatever x is */
} w4_job_t;

/* Row m's group g of inputs summed as float32: its quantized inputs' sum times its scale sx. */
static inline float group_sum(const w4_job_t *j, int64_t m, int64_t g, float sx) {
    return (float)(j->start[m * (j->k / W8_GROUP) + g] / -128) * sx;
}

/* The float32 sums of `rows` (a constant after inlining) rows from m0 against panel p over the octets
 * [i0, i1) (whole groups), continuing acc unless i0 is 0. */
static inline __attribute__((always_inline)) void w4_tile_rows(const w4_job_t *j, int64_t m0, int64_t p, int64_t i0,
                                                               int64_t i1, float *acc, const int rows) {
    const int64_t k8 = j->k / 8, groups = j->k / W8_GROUP;
    const uint8_t *panel = j->panels + p * k8 * COLS * 4;
    const float *d = j->d + p * groups * COLS, *o = j->o + p * groups * COLS;
    if (!i0) memset(acc, 0, (size_t)rows * COLS * sizeof(float));
#if defined(__AVX512VNNI__)
    const quad_t *x[W8_ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const quad_t *)(j->xq + (m0 + r) * j->k);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = i0 / W4_OCTETS; g < i1 / W4_OCTETS; g++) {
        __m512i part[W8_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) part[r][c] = _mm512_setzero_si512();
        for (int64_t i = g * W4_OCTETS; i < (g + 1) * W4_OCTETS; i++) {
            const uint8_t *w = panel + i * COLS * 4;
            prefetch_step(w, COLS * 4);
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512(w + 64 * c);
                lo[c] = _mm512_and_si512(raw, nibble);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
            for (int r = 0; r < rows; r++) {
                const __m512i a = _mm512_set1_epi32(x[r][2 * i]), b = _mm512_set1_epi32(x[r][2 * i + 1]);
                for (int c = 0; c < 4; c++) part[r][c] = dpbusd(dpbusd(part[r][c], lo[c], a), hi[c], b);
            }
        }
        for (int r = 0; r < rows; r++) {
            const float sx = j->xs[(m0 + r) * groups + g];
            const __m512 s = _mm512_set1_ps(sx), sum = _mm512_set1_ps(group_sum(j, m0 + r, g, sx));
            for (int c = 0; c < 4; c++) {
                float *a = acc + r * COLS + 16 * c;
                const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(part[r][c]), s);
                const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(d + g * COLS + 16 * c), u, _mm512_loadu_ps(a));
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(o + g * COLS + 16 * c), sum, t));
            }
        }
        SUMS_IN_MEMORY(); /* as W8A8's tile */
    }
#elif defined(__AVX2__)
    const quad_t *x[W8_ROWS];
    for (int r = 0; r < rows; r++) x[r] = (const quad_t *)(j->xq + (m0 + r) * j->k);
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t g = i0 / W4_OCTETS; g < i1 / W4_OCTETS; g++) {
        const int64_t first = g * W4_OCTETS;
        for (int64_t i = first; i < first + W4_OCTETS; i++) prefetch_step(panel + i * COLS * 4, COLS * 4);
        for (int c = 0; c < COLS / 8; c++) { /* eight columns a vector */
            __m256i part[W8_ROWS];
            for (int r = 0; r < rows; r++) part[r] = _mm256_setzero_si256();
            for (int64_t i = first; i < first + W4_OCTETS; i++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(panel + i * COLS * 4 + 32 * c));
                const __m256i lo = _mm256_and_si256(raw, nibble);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                for (int r = 0; r < rows; r++) {
                    const __m256i a = _mm256_set1_epi32(x[r][2 * i]), b = _mm256_set1_epi32(x[r][2 * i + 1]);
                    part[r] = _mm256_add_epi16(part[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, a),
                                                                         _mm256_maddubs_epi16(hi, b)));
                }
            }
            for (int r = 0; r < rows; r++) {
                const float sx = j->xs[(m0 + r) * groups + g];
                float *a = acc + r * COLS + 8 * c;
                const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(part[r], ones)), _mm256_set1_ps(sx));
                const __m256 t = _mm256_fmadd_ps(_mm256_loadu_ps(d + g * COLS + 8 * c), u, _mm256_loadu_ps(a));
                _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(o + g * COLS + 8 * c),
                                                    _mm256_set1_ps(group_sum(j, m0 + r, g, sx)), t));
            }
        }
    }
#else
    for (int r = 0; r < rows; r++) {
        const int8_t *x = j->xq + (m0 + r) * j->k;
        float *f = acc + r * COLS;
        for (int64_t g = i0 / W4_OCTETS; g < i1 / W4_OCTETS; g++) {
            int32_t part[COLS] = {0};
            for (int64_t i = g * W4_OCTETS; i < (g + 1) * W4_OCTETS; i++)
                for (int e = 0; e < 4; e++) {
                    const int32_t a = x[8 * i + e], b = x[8 * i + 4 + e];
                    const uint8_t *w = panel + i * COLS * 4 + e;
                    for (int c = 0; c < COLS; c++) part[c] += a * (w[4 * c] & 15) + b * (w[4 * c] >> 4);
                }
            const float s = j->xs[(m0 + r) * groups + g], sum = group_sum(j, m0 + r, g, s);
            for (int c = 0; c < COLS; c++) f[c] = fmaf(o[g * COLS + c], sum, fmaf(d[g * COLS + c], (float)part[c] * s, f[c]));
        }
    }
#endif
}

static void w4_tile(const w4_job_t *j, int64_t m0, int rows, int64_t p, int64_t i0, int64_t i1, float *acc) {
    switch (rows) {
    case 1: w4_tile_rows(j, m0, p, i0, i1, acc, 1); break;
    case 2: w4_tile_rows(j, m0, p, i0, i1, acc, 2); break;
    case 3: w4_tile_rows(j, m0, p, i0, i1, acc, 3); break;
    default: w4_tile_rows(j, m0, p, i0, i1, acc, 4); break;
    }
}

/* Rows [m0, m0 + rows) of panel p's outputs from their float32 sums: biased and rounded. */
static void w4_store(const w4_job_t *j, int64_t m0, int rows, int64_t p, const float *acc) {
    const int64_t c0 = p * COLS;
    const int cols = j->n - c0 < COLS ? (int)(j->n - c0) : COLS;
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * COLS;
        if (j->out_f32) {
            store_row_f32((float *)j->out + (m0 + r) * j->out_stride + c0, a, NULL, j->bias, j->dtype == 14, c0, cols);
        } else if (j->dtype == 14) {
            const uint16_t *bias = (const uint16_t *)j->bias;
            uint16_t *out = (uint16_t *)j->out + (m0 + r) * j->out_stride + c0;
            for (int c = 0; c < cols; c++) out[c] = f32_to_bf16(bias ? a[c] + bf16_to_f32(bias[c0 + c]) : a[c]);
        } else {
            const float *bias = (const float *)j->bias;
            float *out = (float *)j->out + (m0 + r) * j->out_stride + c0;
            for (int c = 0; c < cols; c++) out[c] = bias ? a[c] + bias[c0 + c] : a[c];
        }
    }
}

/* Rows [block * ROW_BLOCK, +ROW_BLOCK) against panel p, the inputs in chunks that stay in the first-level
 * cache for all the block's rows; the sums wait in acc between chunks and go on in order. */
static void w4_item(const void *job, int64_t block, int64_t p) {
    const w4_job_t *j = job;
    float acc[ROW_BLOCK * COLS];
    const int64_t start = block * ROW_BLOCK, end = start + ROW_BLOCK < j->m ? start + ROW_BLOCK : j->m;
    const int64_t k8 = j->k / 8, chunk = QUAD_CHUNK; /* octets: 16 KiB of a panel per pass, 16 groups */
    for (int64_t i0 = 0; i0 < k8; i0 += chunk) {
        const int64_t i1 = i0 + chunk < k8 ? i0 + chunk : k8;
        for (int64_t m0 = start; m0 < end; m0 += W8_ROWS)
            w4_tile(j, m0, end - m0 < W8_ROWS ? (int)(end - m0) : W8_ROWS, p, i0, i1, acc + (m0 - start) * COLS);
    }
    for (int64_t m0 = start; m0 < end; m0 += W8_ROWS)
        w4_store(j, m0, end - m0 < W8_ROWS ? (int)(end - m0) : W8_ROWS, p, acc + (m0 - start) * COLS);
}

/* pd_linear for dtypes 14 and 15 (its arguments checked): 0, 1 on bad arguments, 2 when out of memory. */
static int linear_w4a8(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
                       int64_t out_stride, int64_t m, int64_t n, int64_t k, int dtype, int out_f32, int threads) {
    if (k % W8_GROUP) return 1;
    const int64_t panels = (n + COLS - 1) / COLS, groups = k / W8_GROUP;
    if (threads < 1) threads = 1;
    quantized_rows_t rows; /* as W8A8's dtypes 8 (bfloat16 x) and 9 (float32) quantize them */
    if (quantize_rows(x, x_stride, dtype == 14 ? 8 : 9, m, k, threads, &rows)) return 2;
    const float *d = (const float *)packed, *o = d + panels * groups * COLS;
    const w4_job_t job = {rows.q, rows.xs, rows.start, d, o, (const uint8_t *)(o + panels * groups * COLS), bias,
                          out, out_stride, m, n, k, dtype, out_f32};
    if (m * n * k < SERIAL_MACS) threads = 1;
    run_items(w4_item, &job, (m + ROW_BLOCK - 1) / ROW_BLOCK, panels, threads);
    free_quantized(&rows);
    return 0;
}

#endif

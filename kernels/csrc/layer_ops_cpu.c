/* The element-wise parts of a decoder layer on the CPU, each one pass over its rows:
 *   pd_rms_norm:  out = weight * round(x * rsqrt(mean(x^2) + eps))         (RMSNorm)
 *   pd_rope:      out = round(x * cos + rotate_half(x) * sin)              (rotary embedding)
 *   pd_silu_mul:  out = round(round(silu(gate)) * up)                      (the MLP's activation)
 *   pd_store_kv:  cache[slot[r]] = key[r], value[r]                        (the paged KV write)
 *   pd_mask_logits: logits[r][t] = -inf where bit t of row r's bitmask is clear (structured output)
 * In PyTorch each is three to six passes, each through a fresh tensor, and together they were a
 * quarter or more of a long prefill step. The arithmetic is float32 and every rounding to the
 * model dtype happens where the reference (kernels/layer_ops_ref.py) rounds, so the two agree to
 * an ulp of the model dtype. Rows are independent and sums have a fixed order: a row's result does
 * not depend on the batch.
 *
 * Layouts (element strides): row r of an input starts at r * stride, its elements contiguous;
 * outputs are contiguous. dtype: 0 float32, 1 bfloat16 (inputs, weight and output alike; cos and sin
 * are float32 [rows, head_dim], sin's first half negated).
 *
 * Plain C that the compiler vectorises; built by kernels/cpu_build.py (-O3 -march=native -fopenmp).
 */
/* The clamp in exp_approx vectorises only when the compiler may ignore infinities, NaN and the sign of
 * zero in float comparisons (GCC; other compilers leave the loop scalar). Nothing here relies on them:
 * the bfloat16 rounding works on the bits. */
#pragma GCC optimize("finite-math-only", "no-signed-zeros")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_scalar.h"

#define LANES 16           /* partial sums of a row's squares */
#define PARALLEL_MIN 65536 /* elements below which a call stays on one thread */

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 1)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to the model dtype, kept in float32 */
static inline float round_to(float v, int dtype) { return dtype == 1 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* Each function's body is written once for a dtype that the call sites fix (0 or 1), so after
 * inlining the branches on it vanish and the loops vectorise. */

static inline __attribute__((always_inline)) void norm_row(const void *x, const void *w, void *out, int n, float eps, int dtype) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = load(x, i + j, dtype);
            acc[j] += v * v;
        }
    for (; i < n; i++) {
        const float v = load(x, i, dtype);
        acc[0] += v * v;
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    const float inv = 1.0f / sqrtf(acc[0] / (float)n + eps);
    for (i = 0; i < n; i++) store(out, i, load(w, i, dtype) * round_to(load(x, i, dtype) * inv, dtype), dtype);
}

int pd_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int rows, int hidden,
                float eps, int dtype, int threads) {
    if (rows < 0 || hidden <= 0 || x_stride < hidden || (dtype != 0 && dtype != 1)) return 1;
    const int esize = dtype == 1 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * hidden >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++) {
        const char *src = (const char *)x + (int64_t)r * x_stride * esize;
        char *dst = (char *)out + (int64_t)r * hidden * esize;
        if (dtype == 1)
            norm_row(src, weight, dst, hidden, eps, 1);
        else
            norm_row(src, weight, dst, hidden, eps, 0);
    }
    return 0;
}

static inline __attribute__((always_inline)) void rope_row(const void *x, const float *cos, const float *sin, void *out, int heads, int d,
                            int dtype) {
    const int half = d / 2;
    for (int h = 0; h < heads; h++) {
        const int64_t o = (int64_t)h * d;
        for (int i = 0; i < half; i++)
            store(out, o + i, load(x, o + i, dtype) * cos[i] + load(x, o + i + half, dtype) * sin[i], dtype);
        for (int i = half; i < d; i++)
            store(out, o + i, load(x, o + i, dtype) * cos[i] + load(x, o + i - half, dtype) * sin[i], dtype);
    }
}

int pd_rope(const void *x, int64_t x_stride, const float *cos, const float *sin, void *out, int rows, int heads,
            int head_dim, int dtype, int threads) {
    if (rows < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 || x_stride < (int64_t)heads * head_dim ||
        (dtype != 0 && dtype != 1))
        return 1;
    const int esize = dtype == 1 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * heads * head_dim >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++) {
        const char *src = (const char *)x + (int64_t)r * x_stride * esize;
        char *dst = (char *)out + (int64_t)r * heads * head_dim * esize;
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        if (dtype == 1)
            rope_row(src, c, s, dst, heads, head_dim, 1);
        else
            rope_row(src, c, s, dst, heads, head_dim, 0);
    }
    return 0;
}

static inline float silu(float g) { return g / (1.0f + exp_approx(-g)); }

static void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int n) {
    for (int i = 0; i < n; i++) {
        const float s = bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(gate[i]))));
        out[i] = f32_to_bf16(s * bf16_to_f32(up[i]));
    }
}

static void silu_mul_row_f32(const float *gate, const float *up, float *out, int n) {
    for (int i = 0; i < n; i++) out[i] = silu(gate[i]) * up[i];
}

/* gate_up row r holds gate at [0, inter) and up at [inter, 2 * inter). */
int pd_silu_mul(const void *gate_up, int64_t stride, void *out, int rows, int inter, int dtype, int threads) {
    if (rows < 0 || inter <= 0 || stride < 2 * (int64_t)inter || (dtype != 0 && dtype != 1)) return 1;
    const int esize = dtype == 1 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * inter >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + (int64_t)r * stride * esize;
        const char *up = gate + (int64_t)inter * esize;
        char *dst = (char *)out + (int64_t)r * inter * esize;
        if (dtype == 1)
            silu_mul_row_bf16((const uint16_t *)gate, (const uint16_t *)up, (uint16_t *)dst, inter);
        else
            silu_mul_row_f32((const float *)gate, (const float *)up, (float *)dst, inter);
    }
    return 0;
}

/* Copies row r of key and value ([rows, width] with token strides key_stride, value_stride, the row
 * contiguous) to row slots[r] of k_cache and v_cache ([slots, width] contiguous); esize bytes an element. */
int pd_store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                void *v_cache, const int64_t *slots, int64_t num_slots, int rows, int width, int esize,
                int threads) {
    if (rows < 0 || width <= 0 || key_stride < width || value_stride < width || (esize != 2 && esize != 4))
        return 1;
    for (int r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    const size_t bytes = (size_t)width * esize;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * width >= PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++) {
        memcpy((char *)k_cache + slots[r] * bytes, (const char *)key + r * key_stride * esize, bytes);
        memcpy((char *)v_cache + slots[r] * bytes, (const char *)value + r * value_stride * esize, bytes);
    }
    return 0;
}

/* Row r of logits (float32 [rows, vocab], row stride `stride`) keeps token t where bit t % 32 of word
 * t / 32 of words[r] ([rows, (vocab + 31) / 32] int32, contiguous) is set; the others become -inf, in
 * place. A word with every bit set (a token range the grammar allows) is skipped and one with none set
 * is 32 stores, so a mask costs about one pass over the tokens it removes. */
int pd_mask_logits(float *logits, int64_t stride, const int32_t *words, int rows, int vocab, int threads) {
    if (rows < 0 || vocab <= 0 || stride < vocab) return 1;
    const int nwords = (vocab + 31) / 32;
#pragma omp parallel for num_threads(threads) if ((int64_t)rows * vocab >= 4 * PARALLEL_MIN) schedule(static)
    for (int r = 0; r < rows; r++) {
        float *row = logits + (int64_t)r * stride;
        const uint32_t *bits = (const uint32_t *)words + (int64_t)r * nwords;
        for (int w = 0; w < nwords; w++) {
            const uint32_t word = bits[w];
            if (word == 0xFFFFFFFFu) continue;
            const int base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (word == 0) {
                for (int b = 0; b < n; b++) row[base + b] = -INFINITY;
            } else {
                for (int b = 0; b < n; b++)
                    if (!((word >> b) & 1u)) row[base + b] = -INFINITY;
            }
        }
    }
    return 0;
}

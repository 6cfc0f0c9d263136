/* Scalar helpers the CPU kernels share: bfloat16 <-> float32 and a vectorisable exp.
 *
 * Written so that a loop of calls vectorises under -O3 (no libm call, no branch the compiler cannot
 * turn into a select). The exp's clamp needs the compiler to ignore infinities and signed zeros in
 * comparisons; the files that rely on it say so with `#pragma GCC optimize` before including this.
 * cpu_build.py hashes this header with each kernel's source, so a change here rebuilds them all.
 */
#ifndef PDFABRIC_CPU_SCALAR_H
#define PDFABRIC_CPU_SCALAR_H

#include <stdint.h>
#include <string.h>

typedef int32_t __attribute__((may_alias)) quad_t; /* four int8 values read as one word */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One row of `cols` float32 outputs from column c0 on: the sums a (times scale[c] where scale is not
 * NULL) plus the bias (bias[c0 + c], bfloat16 where bias_bf16, else float32; NULL: none), unrounded. For
 * outputs kept in float32 whatever the input's dtype (a model's logits). */
static inline void store_row_f32(float *o, const float *a, const float *scale, const void *bias, int bias_bf16,
                                 int64_t c0, int cols) {
    /* one plain loop per case, so that each vectorises */
    if (scale) for (int c = 0; c < cols; c++) o[c] = a[c] * scale[c];
    else memcpy(o, a, (size_t)cols * sizeof(float));
    if (bias && bias_bf16) {
        const uint16_t *b = (const uint16_t *)bias + c0;
        for (int c = 0; c < cols; c++) o[c] += bf16_to_f32(b[c]);
    } else if (bias) {
        const float *b = (const float *)bias + c0;
        for (int c = 0; c < cols; c++) o[c] += b[c];
    }
}

/* exp(x) within 2 ulp of expf where it is finite and normal (x clamped to [-87, 88]: exp(-87) is below
 * every weight that can change a float32 sum). The shift by 128 makes the truncation a floor without
 * floorf; x - n ln2 is taken in two parts. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (float)(int32_t)(x * 1.44269504088896341f + 128.5f) - 128.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif

/* AVX-512 helpers the CPU kernels share. Empty without AVX-512F (cpu_build.py hashes this header with
 * each kernel's source, so a change here rebuilds them all). */
#ifndef PDFABRIC_CPU_AVX512_H
#define PDFABRIC_CPU_AVX512_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

/* 16 bfloat16 values at p as float32 (lanes outside live read as 0). */
static inline __m512 widen_bf16x16(const uint16_t *p, __mmask16 live) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The 16 x 16 transpose of 32-bit words: r[i] holds row i on entry and column i on return. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c]'s 128-bit lane L: column 4L + c of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

#if defined(__AVX512VNNI__)
/* acc + the products of a's unsigned and b's signed bytes, four a lane (VPDPBUSD). In assembly: GCC 12
 * wraps the intrinsic in register copies that doubled the loops' instructions. */
static inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#endif /* __AVX512VNNI__ */

#endif /* __AVX512F__ */
#endif /* PDFABRIC_CPU_AVX512_H */

/* 16 lanes of fp32 from 16 stored values, for the kernels beside this file (`#include`d, not built).
 *
 * `v16` is a GCC vector of 16 floats that may sit at any 4-byte address. Widening int8 or e4m3fn
 * bytes uses AVX-512 instructions where the compiler targets them: GCC 12 widens a generic
 * `__builtin_convertvector` from 8-bit lanes one lane at a time (measured: slower than reading fp32),
 * so elsewhere a plain loop does it and the auto-vectorizer does what the target allows.
 */
#ifndef SPLITSERVE_WIDEN_H
#define SPLITSERVE_WIDEN_H
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* e4m3fn → fp32 without a table: the 7 magnitude bits, placed at fp32's exponent/mantissa boundary,
 * read as an fp32 2^120 times too small (subnormals included); the sign moves to bit 31. The engine
 * clamps to ±448 before storing, so the NaN code never occurs. */
static inline float f8_to_f32(uint8_t b) {
    const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * 0x1p120f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 widen_i8(const int8_t *p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline v16 widen_f8(const uint8_t *p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20));
    return (v16)_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}
#else
static inline v16 widen_i8(const int8_t *p) {
    float f[16];
    for (int l = 0; l < 16; l++) f[l] = (float)p[l];
    v16 r;
    memcpy(&r, f, 64);
    return r;
}
static inline v16 widen_f8(const uint8_t *p) {
    float f[16];
    for (int l = 0; l < 16; l++) f[l] = f8_to_f32(p[l]);
    v16 r;
    memcpy(&r, f, 64);
    return r;
}
#endif
#endif

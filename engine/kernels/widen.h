/* Vectors of fp32 for the kernels beside this file, and widening stored values into them
 * (`#include`d, not built alone).
 *
 * `v16` is a GCC vector of 16 floats that may sit at any 4-byte address (the attention kernel's unit).
 * `vf` is the widest vector the target has registers for: VF_LANES = 16 with AVX-512, 8 with AVX, 4
 * otherwise. The skinny linear kernels tile by it: a v16 on an AVX2 CPU is two registers, and their
 * 16 v16 accumulators there were 32 of its 16 registers (measured on an AVX2-only EPYC: 5-14x slower
 * than BLAS for 1-16 rows, from spilling; benchmarks/bench_int8_matmul.py).
 * Widening int8 or e4m3fn bytes uses AVX-512 or AVX2 instructions where the compiler targets them: GCC
 * 12 widens a generic `__builtin_convertvector` from 8-bit lanes one lane at a time (measured: slower
 * than reading fp32), so elsewhere a plain loop does it and the auto-vectorizer does what it can.
 */
#ifndef SPLITSERVE_WIDEN_H
#define SPLITSERVE_WIDEN_H
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#if defined(__AVX512F__)
#define VF_LANES 16
#elif defined(__AVX__)
#define VF_LANES 8
#else
#define VF_LANES 4
#endif
typedef float vf __attribute__((vector_size(VF_LANES * 4), aligned(4)));

/* e4m3fn → fp32 without a table: the 7 magnitude bits, placed at fp32's exponent/mantissa boundary,
 * read as an fp32 2^120 times too small (subnormals included); the sign moves to bit 31. The engine
 * clamps to ±448 before storing, so the NaN code never occurs. */
static inline float f8_to_f32(uint8_t b) {
    const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * 0x1p120f;
}

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static inline v16 widen_i8(const int8_t *p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline v16 widen_f8(const uint8_t *p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20));
    return (v16)_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}
#define widen_i8_vf widen_i8
#define widen_f8_vf widen_f8
#elif defined(__AVX2__)
static inline __m256 widen8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 widen8_f8(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
static inline vf widen_i8_vf(const int8_t *p) { return (vf)widen8_i8(p); }
static inline vf widen_f8_vf(const uint8_t *p) { return (vf)widen8_f8(p); }
static inline v16 widen_i8(const int8_t *p) {
    v16 r;
    __m256 halves[2] = {widen8_i8(p), widen8_i8(p + 8)};
    memcpy(&r, halves, 64);
    return r;
}
static inline v16 widen_f8(const uint8_t *p) {
    v16 r;
    __m256 halves[2] = {widen8_f8(p), widen8_f8(p + 8)};
    memcpy(&r, halves, 64);
    return r;
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
static inline vf widen_i8_vf(const int8_t *p) {
    float f[VF_LANES];
    for (int l = 0; l < VF_LANES; l++) f[l] = (float)p[l];
    vf r;
    memcpy(&r, f, sizeof r);
    return r;
}
static inline vf widen_f8_vf(const uint8_t *p) {
    float f[VF_LANES];
    for (int l = 0; l < VF_LANES; l++) f[l] = f8_to_f32(p[l]);
    vf r;
    memcpy(&r, f, sizeof r);
    return r;
}
#endif
#endif

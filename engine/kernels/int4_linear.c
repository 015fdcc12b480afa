/* Group-wise int4 weight-only linear layer for CPUs, for a few rows of x (decode steps):
 *
 *   y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * q[n, k] - zero[n, g] * sum_{k in g} x[m, k])
 *
 * q holds 4-bit values in [0, 16), two per byte, in blocks of 32 inputs per 16 bytes: byte j of a block
 * holds input j in its low nibble and input j + 16 in its high one, so the low nibbles of VF_LANES
 * consecutive bytes widen into one vector of consecutive inputs (engine/layers/int4_matmul.py writes
 * this layout). Groups are `group` consecutive inputs, a multiple of 32; scale and zero are fp32
 * [n, k / group]. Nibbles are widened to fp32 in registers: a decode step reads an eighth of the fp32
 * weight bytes. The zero point's term uses the per-group sums of x, computed once per call. Output
 * channels are split over POSIX threads as in skinny_linear.h.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "widen.h"

#define BLOCK 32
#define ROWS 4 /* rows of x per pass over a weight row: accumulators stay in registers */
#define MIN_BYTES_PER_THREAD ((int64_t)8 << 20)

typedef struct {
    const float *x;
    const uint8_t *w;
    const float *scale, *zero, *xsum;
    float *y;
    int64_t m, n, k, group, n_start, n_end;
} Job;

/* VF_LANES bytes → their low and high nibbles as two fp32 vectors. */
static inline void widen_nibbles(const uint8_t *p, vf *low, vf *high) {
#if defined(__AVX512F__)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    *high = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif defined(__AVX2__)
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *low = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
    *high = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    float lo[VF_LANES], hi[VF_LANES];
    for (int l = 0; l < VF_LANES; l++) {
        lo[l] = (float)(p[l] & 0xF);
        hi[l] = (float)(p[l] >> 4);
    }
    memcpy(low, lo, sizeof *low);
    memcpy(high, hi, sizeof *high);
#endif
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VF_LANES; i++) s += v[i];
    return s;
}

/* Rows [m0, m0 + MR) of x against weight row n. MR is a constant after inlining. */
static inline __attribute__((always_inline)) void row(const Job *job, int64_t m0, int64_t n, int MR) {
    const int64_t k = job->k, groups = k / job->group;
    const uint8_t *wr = job->w + n * (k / 2);
    vf total[ROWS];
    float offset[ROWS];
    for (int i = 0; i < MR; i++) {
        total[i] = (vf){0};
        offset[i] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {
        vf acc[ROWS];
        for (int i = 0; i < MR; i++) acc[i] = (vf){0};
        for (int64_t kb = g * job->group; kb < (g + 1) * job->group; kb += BLOCK)
            for (int h = 0; h < BLOCK / 2; h += VF_LANES) {
                vf low, high;
                widen_nibbles(wr + kb / 2 + h, &low, &high);
                for (int i = 0; i < MR; i++) {
                    const float *xr = job->x + (m0 + i) * k + kb + h;
                    acc[i] += *(const vf *)xr * low + *(const vf *)(xr + BLOCK / 2) * high;
                }
            }
        const float s = job->scale[n * groups + g], z = job->zero[n * groups + g];
        for (int i = 0; i < MR; i++) {
            total[i] += acc[i] * s;
            offset[i] += s * z * job->xsum[(m0 + i) * groups + g];
        }
    }
    for (int i = 0; i < MR; i++) job->y[(m0 + i) * job->n + n] = hsum(total[i]) - offset[i];
}

static void rows_4(const Job *j, int64_t m0, int64_t n) { row(j, m0, n, 4); }
static void rows_3(const Job *j, int64_t m0, int64_t n) { row(j, m0, n, 3); }
static void rows_2(const Job *j, int64_t m0, int64_t n) { row(j, m0, n, 2); }
static void rows_1(const Job *j, int64_t m0, int64_t n) { row(j, m0, n, 1); }
typedef void (*RowFn)(const Job *, int64_t, int64_t);
static const RowFn ROW_FNS[ROWS + 1] = {NULL, rows_1, rows_2, rows_3, rows_4};

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    for (int64_t n = job->n_start; n < job->n_end; n++)
        for (int64_t m0 = 0; m0 < job->m; m0 += ROWS) ROW_FNS[job->m - m0 < ROWS ? job->m - m0 : ROWS](job, m0, n);
    return NULL;
}

/* Returns 0 on success; 2 on a bad argument (k or group not a multiple of 32, group not dividing k). */
int int4_linear(const float *x, const uint8_t *w, const float *scale, const float *zero, float *y, int64_t m,
                int64_t n, int64_t k, int64_t group, int64_t num_threads) {
    if (m < 0 || n < 0 || k <= 0 || group <= 0 || num_threads <= 0) return 2;
    if (k % BLOCK || group % BLOCK || k % group) return 2;
    const int64_t groups = k / group;
    float *xsum = malloc(sizeof(float) * (size_t)(m * groups + 1));
    if (xsum == NULL) return 3;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) s += x[i * k + kk];
            xsum[i * groups + g] = s;
        }
    if (num_threads > 64) num_threads = 64;
    const int64_t by_work = n * k / 2 / MIN_BYTES_PER_THREAD;
    if (num_threads > by_work) num_threads = by_work > 1 ? by_work : 1;
    const int64_t per_thread = (n + num_threads - 1) / num_threads;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        int64_t start = i * per_thread < n ? i * per_thread : n, end = start + per_thread < n ? start + per_thread : n;
        jobs[i] = (Job){x, w, scale, zero, xsum, y, m, n, k, group, start, end};
    }
    for (int64_t i = 1; i < num_threads; i++)
        if (jobs[i].n_start < jobs[i].n_end) started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else if (jobs[i].n_start < jobs[i].n_end) run_job(&jobs[i]);
    }
    free(xsum);
    return 0;
}

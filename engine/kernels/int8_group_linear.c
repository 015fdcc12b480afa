/* Group-wise int8 weight-only linear layer for CPUs, for a few rows of x (decode steps):
 *
 *   y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k]
 *
 * w int8 [n, k] (symmetric: no zero point), one fp32 scale per group of `group` consecutive inputs:
 * scale fp32 [n, k / group]. Weights are widened to fp32 in registers, as in int8_linear.c, so a
 * decode step reads a quarter of the fp32 weight bytes; the only extra work over the per-channel
 * kernel is one multiply-add per group. `group` is a multiple of 32 (a whole number of vectors on
 * every target). Output channels are split over POSIX threads as in skinny_linear.h.
 */
#include <pthread.h>
#include <stdint.h>

#include "widen.h"

#define ROWS 4 /* rows of x per pass over a weight row: accumulators stay in registers */
#define GROUP_ALIGN 32
#define MIN_BYTES_PER_THREAD ((int64_t)16 << 20)

typedef struct {
    const float *x;
    const int8_t *w;
    const float *scale;
    float *y;
    int64_t m, n, k, group, n_start, n_end;
} Job;

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VF_LANES; i++) s += v[i];
    return s;
}

/* Rows [m0, m0 + MR) of x against weight row n. MR is a constant after inlining. */
static inline __attribute__((always_inline)) void row(const Job *job, int64_t m0, int64_t n, int MR) {
    const int64_t k = job->k, groups = k / job->group;
    const int8_t *wr = job->w + n * k;
    const float *sr = job->scale + n * groups;
    vf total[ROWS];
    for (int i = 0; i < MR; i++) total[i] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        vf acc[ROWS];
        for (int i = 0; i < MR; i++) acc[i] = (vf){0};
        for (int64_t kk = g * job->group; kk < (g + 1) * job->group; kk += VF_LANES) {
            const vf wv = widen_i8_vf(wr + kk);
            for (int i = 0; i < MR; i++) acc[i] += *(const vf *)(job->x + (m0 + i) * k + kk) * wv;
        }
        const float s = sr[g];
        for (int i = 0; i < MR; i++) total[i] += acc[i] * s;
    }
    for (int i = 0; i < MR; i++) job->y[(m0 + i) * job->n + n] = hsum(total[i]);
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

/* Returns 0 on success; 2 on a bad argument (group not a multiple of 32, group not dividing k). */
int int8_group_linear(const float *x, const int8_t *w, const float *scale, float *y, int64_t m, int64_t n, int64_t k,
                      int64_t group, int64_t num_threads) {
    if (m < 0 || n < 0 || k <= 0 || group <= 0 || num_threads <= 0) return 2;
    if (group % GROUP_ALIGN || k % group) return 2;
    if (num_threads > 64) num_threads = 64;
    const int64_t by_work = n * k / MIN_BYTES_PER_THREAD;
    if (num_threads > by_work) num_threads = by_work > 1 ? by_work : 1;
    const int64_t per_thread = (n + num_threads - 1) / num_threads;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        int64_t start = i * per_thread < n ? i * per_thread : n, end = start + per_thread < n ? start + per_thread : n;
        jobs[i] = (Job){x, w, scale, y, m, n, k, group, start, end};
    }
    for (int64_t i = 1; i < num_threads; i++)
        if (jobs[i].n_start < jobs[i].n_end) started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else if (jobs[i].n_start < jobs[i].n_end) run_job(&jobs[i]);
    }
    return 0;
}

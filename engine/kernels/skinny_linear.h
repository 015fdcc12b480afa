/* y[m, n] = SCALE(n) * sum_k x[m, k] * w[n, k] for a few rows of x: the body of the skinny linear kernels
 * (`#include`d by int8_linear.c and fp32_linear.c after they define the macros below, not built alone).
 *
 *   LINEAR_NAME   the exported function's name
 *   WEIGHT_T      the stored weight type (one row per output channel, as checkpoints store it)
 *   LOAD_W(p)     16 weights at p as a v16 of fp32 (widened in registers where WEIGHT_T is narrower)
 *   SCALE(job, n) the factor applied to output channel n once, after its sum
 *
 * x fp32 [m, k] row-major, y fp32 [m, n]. A decode or verify step's few rows make BLAS's packed GEMM
 * slow (it copies the weights per call and its small-m tiles waste most of the FMA lanes), while the
 * step is bound by reading the weights once: here each weight vector is loaded once per 4 rows of x
 * into tiles of 4 rows x 4 output channels (16 accumulators of 16 lanes). Output channels are split
 * over `num_threads` POSIX threads.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "widen.h"

typedef struct {
    const float *x;
    const WEIGHT_T *w;
    const float *scale;
    float *y;
    int64_t m, n, k, n_start, n_end;
} Job;

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* One tile: rows [m0, m0 + MR) of x against weight rows [n0, n0 + NR). MR and NR are constants after
 * inlining (dispatch below), so the loops over them unroll into straight register code. */
static inline __attribute__((always_inline)) void tile(const Job *job, int64_t m0, int64_t n0, int MR, int NR) {
    const int64_t k = job->k, k16 = k & ~(int64_t)15;
    v16 acc[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (v16){0};
    for (int64_t kk = 0; kk < k16; kk += 16) {
        v16 wv[4];
        for (int j = 0; j < NR; j++) wv[j] = LOAD_W(job->w + (n0 + j) * k + kk);
        for (int i = 0; i < MR; i++) {
            const v16 xv = *(const v16 *)(job->x + (m0 + i) * k + kk);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MR; i++) {
        const float *xr = job->x + (m0 + i) * k;
        for (int j = 0; j < NR; j++) {
            const WEIGHT_T *wr = job->w + (n0 + j) * k;
            float s = hsum(acc[i][j]);
            for (int64_t kk = k16; kk < k; kk++) s += xr[kk] * (float)wr[kk];
            job->y[(m0 + i) * job->n + n0 + j] = s * SCALE(job, n0 + j);
        }
    }
}

static void tile_4x4(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 4, 4); }
static void tile_3x4(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 3, 4); }
static void tile_2x4(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 2, 4); }
static void tile_1x4(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 1, 4); }
static void tile_1x1(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 1, 1); }
typedef void (*TileFn)(const Job *, int64_t, int64_t);
static const TileFn TILE_ROWS[5] = {NULL, tile_1x4, tile_2x4, tile_3x4, tile_4x4};

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    int64_t n0 = job->n_start;
    for (; n0 + 4 <= job->n_end; n0 += 4) {
        int64_t m0 = 0;
        for (; m0 + 4 <= job->m; m0 += 4) tile_4x4(job, m0, n0);
        if (m0 < job->m) TILE_ROWS[job->m - m0](job, m0, n0);
    }
    for (; n0 < job->n_end; n0++) /* a few trailing output channels (n not a multiple of 4) */
        for (int64_t m0 = 0; m0 < job->m; m0++) tile_1x1(job, m0, n0);
    return NULL;
}

/* Returns 0 on success, non-zero on a bad argument. `scale` may be NULL where SCALE ignores it. */
int LINEAR_NAME(const float *x, const WEIGHT_T *w, const float *scale, float *y, int64_t m, int64_t n, int64_t k,
                int64_t num_threads) {
    if (m < 0 || n < 0 || k < 0 || num_threads <= 0) return 2;
    if (num_threads > 64) num_threads = 64;
    /* Chunks of whole 4-channel groups: every thread but the last gets full tiles. */
    const int64_t groups = (n + 3) / 4, per_thread = (groups + num_threads - 1) / num_threads;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        int64_t start = i * per_thread * 4, end = start + per_thread * 4;
        start = start < n ? start : n;
        end = end < n ? end : n;
        jobs[i] = (Job){x, w, scale, y, m, n, k, start, end};
    }
    for (int64_t i = 1; i < num_threads; i++)
        if (jobs[i].n_start < jobs[i].n_end) started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else if (jobs[i].n_start < jobs[i].n_end) run_job(&jobs[i]); /* no thread could be made */
    }
    return 0;
}

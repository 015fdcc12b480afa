/* y[m, n] = SCALE(n) * sum_k x[m, k] * w[n, k] for a few rows of x: the body of the skinny linear kernels
 * (`#include`d by int8_linear.c and fp32_linear.c after they define the macros below, not built alone).
 *
 *   LINEAR_NAME   the exported function's name
 *   WEIGHT_T      the stored weight type (one row per output channel, as checkpoints store it)
 *   LOAD_W(p)     VF_LANES weights at p as a `vf` of fp32 (widened in registers where WEIGHT_T is narrower)
 *   SCALE(job, n) the factor applied to output channel n once, after its sum
 *
 * x fp32 [m, k] row-major, y fp32 [m, n]. A decode or verify step's few rows make BLAS's packed GEMM
 * slow (it copies the weights per call and its small-m tiles waste most of the FMA lanes), while the
 * step is bound by reading the weights once: here each weight vector is loaded once per TILE_M rows of x
 * into tiles of TILE_M rows x TILE_N output channels, sized so that the accumulators, the weight
 * vectors and one x vector fit the target's vector registers (widen.h's `vf`): 4 x 4 with AVX-512's 32
 * registers, 4 x 2 with AVX2's 16; one or two rows (a decode step) take 4 channels per tile on every
 * target, more weight rows streaming at once. Output channels are split over `num_threads` POSIX
 * threads.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "widen.h"

#define TILE_M 4
#define MIN_BYTES_PER_THREAD ((int64_t)16 << 20)
#define SMALL_M_TILE_N 4 /* channels per tile for 1-2 rows: at most 8 accumulators, fits any target */
#if VF_LANES == 16
#define TILE_N 4
#else
#define TILE_N 2
#endif

typedef struct {
    const float *x;
    const WEIGHT_T *w;
    const float *scale;
    float *y;
    int64_t m, n, k, n_start, n_end;
} Job;

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VF_LANES; i++) s += v[i];
    return s;
}

/* One tile: rows [m0, m0 + MR) of x against weight rows [n0, n0 + NR). MR and NR are constants after
 * inlining (dispatch below), so the loops over them unroll into straight register code. */
static inline __attribute__((always_inline)) void tile(const Job *job, int64_t m0, int64_t n0, int MR, int NR) {
    const int64_t k = job->k, kv = k & ~(int64_t)(VF_LANES - 1);
    vf acc[TILE_M][SMALL_M_TILE_N]; /* SMALL_M_TILE_N >= TILE_N */
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (vf){0};
    for (int64_t kk = 0; kk < kv; kk += VF_LANES) {
        vf wv[SMALL_M_TILE_N];
        for (int j = 0; j < NR; j++) wv[j] = LOAD_W(job->w + (n0 + j) * k + kk);
        for (int i = 0; i < MR; i++) {
            const vf xv = *(const vf *)(job->x + (m0 + i) * k + kk);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MR; i++) {
        const float *xr = job->x + (m0 + i) * k;
        for (int j = 0; j < NR; j++) {
            const WEIGHT_T *wr = job->w + (n0 + j) * k;
            float s = hsum(acc[i][j]);
            for (int64_t kk = kv; kk < k; kk++) s += xr[kk] * (float)wr[kk];
            job->y[(m0 + i) * job->n + n0 + j] = s * SCALE(job, n0 + j);
        }
    }
}

static void tile_4xn(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 4, TILE_N); }
static void tile_3xn(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 3, TILE_N); }
static void tile_2xn(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 2, TILE_N); }
static void tile_1xn(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 1, TILE_N); }
static void tile_1x1(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 1, 1); }
static void tile_1xs(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 1, SMALL_M_TILE_N); }
static void tile_2xs(const Job *j, int64_t m0, int64_t n0) { tile(j, m0, n0, 2, SMALL_M_TILE_N); }
typedef void (*TileFn)(const Job *, int64_t, int64_t);
static const TileFn TILE_ROWS[TILE_M + 1] = {NULL, tile_1xn, tile_2xn, tile_3xn, tile_4xn};

static void *run_job(void *arg) {
    const Job *job = (const Job *)arg;
    int64_t n0 = job->n_start;
    if (job->m <= 2) /* a decode step's one or two rows: more weight rows in flight per tile */
        for (; n0 + SMALL_M_TILE_N <= job->n_end; n0 += SMALL_M_TILE_N) (job->m == 1 ? tile_1xs : tile_2xs)(job, 0, n0);
    for (; n0 + TILE_N <= job->n_end; n0 += TILE_N) {
        int64_t m0 = 0;
        for (; m0 + TILE_M <= job->m; m0 += TILE_M) tile_4xn(job, m0, n0);
        if (m0 < job->m) TILE_ROWS[job->m - m0](job, m0, n0);
    }
    for (; n0 < job->n_end; n0++) /* a few trailing output channels (n not a multiple of TILE_N) */
        for (int64_t m0 = 0; m0 < job->m; m0++) tile_1x1(job, m0, n0);
    return NULL;
}

/* Returns 0 on success, non-zero on a bad argument. `scale` may be NULL where SCALE ignores it. */
int LINEAR_NAME(const float *x, const WEIGHT_T *w, const float *scale, float *y, int64_t m, int64_t n, int64_t k,
                int64_t num_threads) {
    if (m < 0 || n < 0 || k < 0 || num_threads <= 0) return 2;
    if (num_threads > 64) num_threads = 64;
    /* A thread is created per call: each gets at least MIN_BYTES_PER_THREAD of weights, else the call
     * runs on the caller's thread alone. Measured on the 2-vCPU dev box: a 64 x 64 layer took 500 us
     * with 2 threads under load (13 us through BLAS), and a 4096 x 768 fp32 layer at one row 1.3 ms
     * with 2 threads against 0.66 ms with 1; from ~64 MB of weights (a 1B model's MLP) 2 help. */
    const int64_t by_work = n * k * (int64_t)sizeof(WEIGHT_T) / MIN_BYTES_PER_THREAD;
    if (num_threads > by_work) num_threads = by_work > 1 ? by_work : 1;
    /* Chunks of whole TILE_N-channel groups: every thread but the last gets full tiles. */
    const int64_t groups = (n + TILE_N - 1) / TILE_N, per_thread = (groups + num_threads - 1) / num_threads;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        int64_t start = i * per_thread * TILE_N, end = start + per_thread * TILE_N;
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

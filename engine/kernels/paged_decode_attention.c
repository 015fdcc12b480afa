/* Paged decode attention for CPUs: one query token per sequence, keys/values read in place from the
 * paged cache (no gather into a padded copy, so each KV byte is read once per layer).
 *
 * Layout (the engine's): q [batch, heads, head_dim]; k/v cache [kv_heads, num_blocks, block_size,
 * head_dim]; block_tables [batch, max_blocks] int64; context_lens [batch] int64; out like q.
 * The cache holds fp32 (kind 0), int8 (kind 1) or float8 e4m3fn (kind 2) values; the quantized kinds
 * carry fp32 scales [kv_heads, num_blocks, block_size], one per token and KV head, and are
 * dequantized in registers: a key's scale multiplies its dot product, a value's scale its softmax
 * weight, so no dequantized copy of the cache is ever written.
 * Work items are (sequence, kv head) pairs; each computes softmax(q·Kᵀ·scale)·V for the `group` query
 * heads that share the KV head, with an exact two-pass softmax in fp32. Items are spread over
 * `num_threads` POSIX threads, interleaved so long and short sequences mix. head_dim 64 with at most
 * four query heads per KV head (the demo model, most Llama-likes) takes a register-blocked path.
 * A sliding window (`window` > 0; 0: none) keeps the last `window` positions of each context: the
 * query at position n - 1 sees keys n - window .. n - 1; the blocks before them are never read.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "widen.h"

#define MAX_GROUP 64
enum { KIND_F32 = 0, KIND_I8 = 1, KIND_F8 = 2 };

typedef struct {
    const float *q;
    const char *k, *v;          /* values, `kind` elements */
    const float *k_scale, *v_scale; /* NULL for KIND_F32 */
    float *out;
    const int64_t *block_tables, *context_lens;
    int64_t kind, batch, heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, max_context, window;
    float scale;
    int64_t thread_index, num_threads;
    int status;
} Job;

static inline int64_t element_bytes(int64_t kind) { return kind == KIND_F32 ? 4 : 1; }

/* Element d of a head vector that starts at `base` (inlined with a constant `kind`: no branch left). */
static inline __attribute__((always_inline)) float load1(const char *base, int64_t d, int64_t kind) {
    if (kind == KIND_I8) return (float)((const int8_t *)base)[d];
    if (kind == KIND_F8) return f8_to_f32(((const uint8_t *)base)[d]);
    return ((const float *)base)[d];
}

static inline __attribute__((always_inline)) v16 load16(const char *base, int64_t d, int64_t kind) {
    if (kind == KIND_I8) return widen_i8((const int8_t *)base + d);
    if (kind == KIND_F8) return widen_f8((const uint8_t *)base + d);
    return *(const v16 *)((const float *)base + d);
}

/* Exponentiates each query head's scores in place (max-subtracted) and returns 1 / their sum. */
static void softmax_rows(float *restrict scores, int64_t n, int64_t group, float *restrict inv_sum) {
    for (int64_t g = 0; g < group; g++) {
        float *restrict s = scores + g * n;
        float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] = expf(s[t] - mx);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) sum += s[t];
        inv_sum[g] = 1.0f / sum;
    }
}

/* Where one (sequence, kv head) item reads: the first key/value/scale of the head's block 0. Its keys
 * are positions start .. end - 1 (n = end - start of them, scores indexed from start), in blocks
 * first_block .. num_blocks - 1. */
typedef struct {
    int64_t b, h, group, n, start, end, first_block, num_blocks;
    const int64_t *table;
    const float *q;
    float *out;
    const char *k_head, *v_head;
    const float *ks_head, *vs_head;
} Item;

static inline Item item_of(const Job *job, int64_t item) {
    Item it;
    it.b = item / job->kv_heads;
    it.h = item % job->kv_heads;
    it.group = job->heads / job->kv_heads;
    it.end = job->context_lens[it.b];
    it.start = job->window > 0 && it.end > job->window ? it.end - job->window : 0;
    it.n = it.end - it.start;
    it.first_block = it.start / job->block_size;
    it.num_blocks = (it.end + job->block_size - 1) / job->block_size;
    it.table = job->block_tables + it.b * job->max_blocks;
    it.q = job->q + (it.b * job->heads + it.h * it.group) * job->head_dim;
    it.out = job->out + (it.b * job->heads + it.h * it.group) * job->head_dim;
    const int64_t tokens = it.h * job->num_blocks * job->block_size;
    const int64_t bytes = tokens * job->head_dim * element_bytes(job->kind);
    it.k_head = job->k + bytes;
    it.v_head = job->v + bytes;
    it.ks_head = job->k_scale ? job->k_scale + tokens : NULL;
    it.vs_head = job->v_scale ? job->v_scale + tokens : NULL;
    return it;
}

/* The scale of token `o` of block `block` (1 for fp32 values). */
static inline float token_scale(const float *head_scales, int64_t block, int64_t bs, int64_t o) {
    return head_scales ? head_scales[block * bs + o] : 1.0f;
}

static inline __attribute__((always_inline)) void attend_any(const Job *job, int64_t item,
                                                             float *restrict scores, int64_t kind) {
    const Item it = item_of(job, item);
    const int64_t dim = job->head_dim, bs = job->block_size, n = it.n, group = it.group;
    const int64_t row_bytes = dim * element_bytes(kind);
    /* Pass 1: scores, walking the sequence block by block (no per-token division). */
    for (int64_t blk = it.first_block; blk < it.num_blocks; blk++) {
        const int64_t block = it.table[blk], first = blk * bs - it.start, count = n - first < bs ? n - first : bs;
        for (int64_t o = first < 0 ? -first : 0; o < count; o++) {
            const char *key = it.k_head + (block * bs + o) * row_bytes;
            const float ks = token_scale(it.ks_head, block, bs, o) * job->scale;
            for (int64_t g = 0; g < group; g++) {
                const float *restrict qg = it.q + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qg[d] * load1(key, d, kind);
                scores[g * n + first + o] = dot * ks;
            }
        }
    }
    float inv_sum[MAX_GROUP];
    softmax_rows(scores, n, group, inv_sum);
    memset(it.out, 0, sizeof(float) * group * dim);
    /* Pass 2: weighted sum of values, one query head at a time over each block. */
    for (int64_t blk = it.first_block; blk < it.num_blocks; blk++) {
        const int64_t block = it.table[blk], first = blk * bs - it.start, count = n - first < bs ? n - first : bs;
        for (int64_t g = 0; g < group; g++) {
            const float *restrict w = scores + g * n;
            float *restrict og = it.out + g * dim;
            for (int64_t o = first < 0 ? -first : 0; o < count; o++) {
                const char *value = it.v_head + (block * bs + o) * row_bytes;
                const float wo = w[first + o] * token_scale(it.vs_head, block, bs, o);
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) og[d] += wo * load1(value, d, kind);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) it.out[g * dim + d] *= inv_sum[g];
    }
}

/* dim == 64 and group <= 4: keys and values are loaded (and dequantized) once for all query heads,
 * and the output accumulates in registers, instead of re-reading each key per head and storing `og`
 * per key. Written in `vf` (widen.h: the target's widest vector) and sized to its register file: with
 * AVX2's 16 registers, v16 code spilled most of its 32 accumulators and query vectors to the stack and
 * ran at half the speed of PyTorch's gather + matmul path (measured on an AVX2-only EPYC). */
#define CHUNKS (64 / VF_LANES)
#if VF_LANES == 16
#define SWEEP 4 /* value-pass chunks per sweep over the tokens: group x SWEEP accumulators */
#else
#define SWEEP 2
#endif

static inline __attribute__((always_inline)) vf load_vf(const char *base, int64_t d, int64_t kind) {
    if (kind == KIND_I8) return widen_i8_vf((const int8_t *)base + d);
    if (kind == KIND_F8) return widen_f8_vf((const uint8_t *)base + d);
    return *(const vf *)((const float *)base + d);
}

/* The sum of a vf's lanes as a tree of halves: log2(lanes) dependent adds, not one per lane. */
static inline float hsum_vf(vf v) {
    float lanes[VF_LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = VF_LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

static inline __attribute__((always_inline)) void attend64_any(const Job *job, int64_t item,
                                                               float *restrict scores, int64_t kind) {
    const Item it = item_of(job, item);
    const int64_t bs = job->block_size, n = it.n, group = it.group, row_bytes = 64 * element_bytes(kind);
    for (int64_t blk = it.first_block; blk < it.num_blocks; blk++) {
        const int64_t block = it.table[blk], first = blk * bs - it.start, count = n - first < bs ? n - first : bs;
        for (int64_t o = first < 0 ? -first : 0; o < count; o++) {
            const char *key = it.k_head + (block * bs + o) * row_bytes;
            const float ks = token_scale(it.ks_head, block, bs, o) * job->scale;
            vf kv[CHUNKS];
            for (int c = 0; c < CHUNKS; c++) kv[c] = load_vf(key, c * VF_LANES, kind);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = it.q + g * 64;
                vf even = *(const vf *)qg * kv[0], odd = (vf){0}; /* two chains: half the FMA latency */
                for (int c = 1; c < CHUNKS; c++) {
                    if (c % 2) odd += *(const vf *)(qg + c * VF_LANES) * kv[c];
                    else even += *(const vf *)(qg + c * VF_LANES) * kv[c];
                }
                scores[g * n + first + o] = hsum_vf(even + odd) * ks;
            }
        }
    }
    float inv_sum[4];
    softmax_rows(scores, n, group, inv_sum);
    for (int c0 = 0; c0 < CHUNKS; c0 += SWEEP) { /* each value element is read and widened once */
        vf acc[4][SWEEP];
        for (int64_t g = 0; g < group; g++)
            for (int c = 0; c < SWEEP; c++) acc[g][c] = (vf){0};
        for (int64_t blk = it.first_block; blk < it.num_blocks; blk++) {
            const int64_t block = it.table[blk], first = blk * bs - it.start, count = n - first < bs ? n - first : bs;
            for (int64_t o = first < 0 ? -first : 0; o < count; o++) {
                const char *value = it.v_head + (block * bs + o) * row_bytes;
                const float vs = token_scale(it.vs_head, block, bs, o);
                vf x[SWEEP];
                for (int c = 0; c < SWEEP; c++) x[c] = load_vf(value, (c0 + c) * VF_LANES, kind);
                for (int64_t g = 0; g < group; g++) {
                    const float w = scores[g * n + first + o] * vs;
                    for (int c = 0; c < SWEEP; c++) acc[g][c] += w * x[c];
                }
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int c = 0; c < SWEEP; c++)
                *(vf *)(it.out + g * 64 + (c0 + c) * VF_LANES) = acc[g][c] * inv_sum[g];
    }
}

/* One specialization per (shape, kind): the kind is a constant inside each, so loads are straight. */
static void attend_f32(const Job *j, int64_t i, float *s) { attend_any(j, i, s, KIND_F32); }
static void attend_i8(const Job *j, int64_t i, float *s) { attend_any(j, i, s, KIND_I8); }
static void attend_f8(const Job *j, int64_t i, float *s) { attend_any(j, i, s, KIND_F8); }
static void attend64_f32(const Job *j, int64_t i, float *s) { attend64_any(j, i, s, KIND_F32); }
static void attend64_i8(const Job *j, int64_t i, float *s) { attend64_any(j, i, s, KIND_I8); }
static void attend64_f8(const Job *j, int64_t i, float *s) { attend64_any(j, i, s, KIND_F8); }

typedef void (*AttendFn)(const Job *, int64_t, float *);
static const AttendFn ATTEND[3] = {attend_f32, attend_i8, attend_f8};
static const AttendFn ATTEND64[3] = {attend64_f32, attend64_i8, attend64_f8};

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    const int64_t group = job->heads / job->kv_heads;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (job->max_context > 0 ? job->max_context : 1)));
    if (!scores) { job->status = 1; return NULL; }
    const AttendFn attend = (job->head_dim == 64 && group <= 4 ? ATTEND64 : ATTEND)[job->kind];
    for (int64_t item = job->thread_index; item < job->batch * job->kv_heads; item += job->num_threads)
        attend(job, item, scores);
    free(scores);
    return NULL;
}

/* Returns 0 on success, non-zero on a bad argument or allocation failure. */
int paged_decode_attention(const float *q, const void *k, const void *v, const float *k_scale,
                           const float *v_scale, float *out, const int64_t *block_tables,
                           const int64_t *context_lens, int64_t kind, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t max_blocks, int64_t max_context, float scale, int64_t window,
                           int64_t num_threads) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || num_threads <= 0 || window < 0) return 2;
    if (kind < KIND_F32 || kind > KIND_F8 || (kind != KIND_F32 && (!k_scale || !v_scale))) return 3;
    if (num_threads > 64) num_threads = 64;
    /* A thread is created per call: each gets at least 16 MiB of K/V to read (the longest context's
     * worth for every item bounds the work), else the call runs on the caller's thread alone. */
    const int64_t kv_bytes = 2 * batch * kv_heads * max_context * head_dim * element_bytes(kind);
    const int64_t by_work = kv_bytes >> 24;
    if (num_threads > by_work) num_threads = by_work > 1 ? by_work : 1;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        jobs[i] = (Job){q, (const char *)k, (const char *)v, kind == KIND_F32 ? NULL : k_scale,
                        kind == KIND_F32 ? NULL : v_scale, out, block_tables, context_lens, kind, batch, heads,
                        kv_heads, head_dim, num_blocks, block_size, max_blocks, max_context, window, scale,
                        i, num_threads, 0};
    }
    for (int64_t i = 1; i < num_threads; i++)
        started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++)
        if (!started[i]) run_job(&jobs[i]); /* no thread could be made: do its share here */
    int status = jobs[0].status;
    for (int64_t i = 1; i < num_threads; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        status |= jobs[i].status;
    }
    return status;
}

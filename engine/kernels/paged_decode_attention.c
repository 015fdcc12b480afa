/* Paged decode attention for CPUs: one query token per sequence, keys/values read in place from the
 * paged cache (no gather into a padded copy, so each KV byte is read once per layer).
 *
 * Layout (the engine's): q [batch, heads, head_dim]; k/v cache [kv_heads, num_blocks, block_size,
 * head_dim]; block_tables [batch, max_blocks] int64; context_lens [batch] int64; out like q.
 * Work items are (sequence, kv head) pairs; each computes softmax(q·Kᵀ·scale)·V for the `group` query
 * heads that share the KV head, with an exact two-pass softmax in fp32. Items are spread over
 * `num_threads` POSIX threads, interleaved so long and short sequences mix. head_dim 64 with at most
 * four query heads per KV head (the demo model, most Llama-likes) takes a register-blocked path.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *block_tables, *context_lens;
    int64_t batch, heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, max_context;
    float scale;
    int64_t thread_index, num_threads;
    int status;
} Job;

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

static void attend(const Job *job, int64_t item, float *restrict scores) {
    const int64_t b = item / job->kv_heads, h = item % job->kv_heads;
    const int64_t group = job->heads / job->kv_heads, dim = job->head_dim, bs = job->block_size;
    const int64_t n = job->context_lens[b], num_blocks = (n + bs - 1) / bs;
    const int64_t *table = job->block_tables + b * job->max_blocks;
    const float *restrict q = job->q + (b * job->heads + h * group) * dim;
    float *restrict out = job->out + (b * job->heads + h * group) * dim;
    const float *k_head = job->k + h * job->num_blocks * bs * dim;
    const float *v_head = job->v + h * job->num_blocks * bs * dim;
    /* Pass 1: scores, walking the sequence block by block (no per-token division). */
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const float *restrict keys = k_head + table[blk] * bs * dim;
        const int64_t first = blk * bs, count = n - first < bs ? n - first : bs;
        for (int64_t o = 0; o < count; o++) {
            const float *restrict key = keys + o * dim;
            for (int64_t g = 0; g < group; g++) {
                const float *restrict qg = q + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qg[d] * key[d];
                scores[g * n + first + o] = dot * job->scale;
            }
        }
    }
    float inv_sum[MAX_GROUP];
    softmax_rows(scores, n, group, inv_sum);
    memset(out, 0, sizeof(float) * group * dim);
    /* Pass 2: weighted sum of values, one query head at a time over each block. */
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const float *restrict values = v_head + table[blk] * bs * dim;
        const int64_t first = blk * bs, count = n - first < bs ? n - first : bs;
        for (int64_t g = 0; g < group; g++) {
            const float *restrict w = scores + g * n + first;
            float *restrict og = out + g * dim;
            for (int64_t o = 0; o < count; o++) {
                const float *restrict value = values + o * dim;
                const float wo = w[o];
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) og[d] += wo * value[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] *= inv_sum[g];
    }
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));
/* dim == 64 and group <= 4: keys and values are loaded once for all query heads, and the output
 * accumulates in registers, instead of re-reading each key per head and storing `og` per key. */
static void attend64(const Job *job, int64_t item, float *restrict scores) {
    const int64_t b = item / job->kv_heads, h = item % job->kv_heads;
    const int64_t group = job->heads / job->kv_heads, bs = job->block_size;
    const int64_t n = job->context_lens[b], num_blocks = (n + bs - 1) / bs;
    const int64_t *table = job->block_tables + b * job->max_blocks;
    const float *q = job->q + (b * job->heads + h * group) * 64;
    float *out = job->out + (b * job->heads + h * group) * 64;
    const float *k_head = job->k + h * job->num_blocks * bs * 64;
    const float *v_head = job->v + h * job->num_blocks * bs * 64;
    v16 qv[4][4];
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) qv[g][i] = *(const v16 *)(q + g * 64 + i * 16);
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const float *keys = k_head + table[blk] * bs * 64;
        const int64_t first = blk * bs, count = n - first < bs ? n - first : bs;
        for (int64_t o = 0; o < count; o++) {
            const v16 k0 = *(const v16 *)(keys + o * 64), k1 = *(const v16 *)(keys + o * 64 + 16);
            const v16 k2 = *(const v16 *)(keys + o * 64 + 32), k3 = *(const v16 *)(keys + o * 64 + 48);
            for (int64_t g = 0; g < group; g++) {
                v16 acc = qv[g][0] * k0 + qv[g][1] * k1 + qv[g][2] * k2 + qv[g][3] * k3;
                float dot = 0.0f;
                for (int i = 0; i < 16; i++) dot += acc[i];
                scores[g * n + first + o] = dot * job->scale;
            }
        }
    }
    float inv_sum[4];
    softmax_rows(scores, n, group, inv_sum);
    v16 acc[4][4] = {{{0}}};
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const float *values = v_head + table[blk] * bs * 64;
        const int64_t first = blk * bs, count = n - first < bs ? n - first : bs;
        for (int64_t o = 0; o < count; o++) {
            const v16 x0 = *(const v16 *)(values + o * 64), x1 = *(const v16 *)(values + o * 64 + 16);
            const v16 x2 = *(const v16 *)(values + o * 64 + 32), x3 = *(const v16 *)(values + o * 64 + 48);
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[g * n + first + o];
                acc[g][0] += w * x0; acc[g][1] += w * x1; acc[g][2] += w * x2; acc[g][3] += w * x3;
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) *(v16 *)(out + g * 64 + i * 16) = acc[g][i] * inv_sum[g];
}

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    const int64_t group = job->heads / job->kv_heads;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (job->max_context > 0 ? job->max_context : 1)));
    if (!scores) { job->status = 1; return NULL; }
    for (int64_t item = job->thread_index; item < job->batch * job->kv_heads; item += job->num_threads)
        (job->head_dim == 64 && job->heads / job->kv_heads <= 4 ? attend64 : attend)(job, item, scores);
    free(scores);
    return NULL;
}

/* Returns 0 on success, non-zero on a bad argument or allocation failure. */
int paged_decode_attention(const float *q, const float *k, const float *v, float *out,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                           int64_t block_size, int64_t max_blocks, int64_t max_context, float scale,
                           int64_t num_threads) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || num_threads <= 0) return 2;
    if (num_threads > 64) num_threads = 64;
    Job jobs[64];
    pthread_t threads[64];
    int started[64] = {0};
    for (int64_t i = 0; i < num_threads; i++) {
        jobs[i] = (Job){q, k, v, out, block_tables, context_lens, batch, heads, kv_heads, head_dim, num_blocks,
                        block_size, max_blocks, max_context, scale, i, num_threads, 0};
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

/* fp32 linear layer for a few rows (decode and verify steps): y[m, n] = sum_k x[m, k] * w[n, k].
 *
 * w fp32 [n, k]; `scale` is unused (pass NULL). The weights are read once per 4 rows of x, where BLAS
 * packs them per call: measured in benchmarks/bench_int8_matmul.py (fp32_native). The tiling and threading are
 * skinny_linear.h's.
 */
#include <stdint.h>

#define LINEAR_NAME fp32_linear
#define WEIGHT_T float
#define LOAD_W(p) (*(const vf *)(p))
#define SCALE(job, n) 1.0f
#include "skinny_linear.h"

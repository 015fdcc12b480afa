/* Weight-only int8 linear layer for CPUs: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k].
 *
 * w int8 [n, k] with one fp32 scale per output channel. Weights are widened to fp32 in registers,
 * never written back: a decode step reads a quarter of the fp32 weight bytes. The tiling and
 * threading are skinny_linear.h's.
 */
#include <stdint.h>

#define LINEAR_NAME int8_linear
#define WEIGHT_T int8_t
#define LOAD_W(p) widen_i8_vf(p)
#define SCALE(job, n) ((job)->scale[n])
#include "skinny_linear.h"

/* RMSNorm of fp32 rows in one call, the same bits as torch's CPU ``rms_norm`` (torch 2.13's composite: the squares,
 * their mean as a sum then one division by the width, plus eps, 1 / sqrt, then the row times that and times the
 * weight). torch runs those as seven ops, each a few microseconds of dispatch on a 576-wide row: 61 norms made 3.9
 * ms of a 25 ms decode step of the embedded model here.
 *
 * Why the bits are the same: every step but the sum is one IEEE float operation, as torch performs it. The sum
 * follows ATen's float sum for a contiguous row (SumKernel.cpp: vectorized_inner_sum, row_sum's four interleaved
 * partial sums, multi_row_sum's four-level cascade) over vectors of ``lanes`` floats, the width of the
 * Vectorized<float> that torch's sum runs (8 under its AVX2 kernels, and measured 8 on an AVX-512 machine too; 16
 * would be an AVX-512 sum), with each vector add done lane by lane. kernels/__init__.py takes the width whose norms
 * equal torch's on random rows before it is used, and tests/unit/test_step_kernels.py checks many widths and
 * scales.
 *
 * Built with -ffp-contract=off: no multiply-add is contracted.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_LANES 16
#define LEVELS 4
#define ILP 4

static int ceil_log2(int64_t n) {
    int bits = 0;
    while (((int64_t)1 << bits) < n) bits++;
    return bits;
}

static inline void add_vector(float *acc, const float *x, int lanes) {
    for (int lane = 0; lane < lanes; lane++) acc[lane] += x[lane] * x[lane];
}

static inline void add_acc(float *acc, const float *other, int lanes) {
    for (int lane = 0; lane < lanes; lane++) acc[lane] += other[lane];
}

/* ATen's float sum of the squares of x[0..n) (the squares rounded to float first, as torch's pow materialises them) */
static float sum_of_squares(const float *x, int64_t n, int lanes) {
    const int64_t vectors = n / lanes;
    const int64_t size = vectors / ILP;           /* multi_row_sum's rows: ILP vectors each */
    const int level_power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++) add_vector(acc[0][k], x + (i * ILP + k) * lanes, lanes);
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++) {
                add_acc(acc[level][k], acc[level - 1][k], lanes);
                memset(acc[level - 1][k], 0, sizeof(float) * lanes);
            }
            if ((i & (level_mask << (level * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++) add_vector(acc[0][k], x + (i * ILP + k) * lanes, lanes);
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < ILP; k++) add_acc(acc[0][k], acc[level][k], lanes);
    for (int64_t v = size * ILP; v < vectors; v++) add_vector(acc[0][0], x + v * lanes, lanes);  /* row_sum's tail */
    for (int k = 1; k < ILP; k++) add_acc(acc[0][0], acc[0][k], lanes);
    float total = 0.0f;
    for (int64_t e = vectors * lanes; e < n; e++) total += x[e] * x[e];                 /* the scalar tail */
    for (int lane = 0; lane < lanes; lane++) total += acc[0][0][lane];
    return total;
}

/* y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * weight, for rows r of width n; 0, or -1 for an unknown width */
int rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps, int lanes, float *y) {
    if (lanes != 8 && lanes != 16) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float *out = y + r * n;
        float mean = sum_of_squares(row, n, lanes) / (float)n;
        float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t e = 0; e < n; e++) out[e] = row[e] * scale * weight[e];
    }
    return 0;
}

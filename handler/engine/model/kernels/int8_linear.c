/* The lean engine's int8 Linear, for any number of rows (a decode step's few, a prefill chunk's hundreds): per-channel
 * int8 weights in [-127, 127], activations quantised symmetrically to int8 in [-127, 127] per block of ``block``
 * inputs of each row, one pass.
 *
 * What it computes, per row x and output channel c (linear.py's ``reference_linear`` is the same in torch ops):
 *   for each block b of inputs: d_b = max|x_j| / 127, q_j = nearbyint(x_j * (1 / d_b)) (0 where d_b is 0),
 *   s_b = sum_j q_j * W[c, j] (an exact integer); then acc = 0, acc = acc + d_b * float(s_b) block by block (fp32,
 *   a rounded multiply then a rounded add, in block order); y = acc * scale_c, then + bias_c, then residual + y.
 *
 * Why the bits do not depend on the CPU, the number of rows or the threads: every block sum s_b is an exact integer
 * however it is summed (AVX2's maddubs of |w| by sign(w) * q never saturates: 2 * 127 * 127 < 32768; AVX-512 VNNI's
 * vpdpbusd sums (w + 128) * q into int32 exactly, and the 128 * sum(q) it adds is taken off); every float operation is
 * one IEEE operation in the order above, per (row, channel), on one thread (-ffp-contract=off: nothing is fused); and a
 * row's quantisation reads that row only.
 *
 * The weights are packed at load (linear.py ``pack``) into groups of 16 output channels, each group's inputs in steps
 * of 4: [groups][k4 / 4][16][4] int8, so one 64-byte load holds 4 inputs of 16 channels and a broadcast of 4 of a
 * row's codes multiplies all 16 at once, each channel's sum landing in its own 32-bit lane (no horizontal sums).
 * Channels are split over torch's own OpenMP threads, a group at a time (the library is loaded after torch, so its
 * libgomp.so.1 is torch's: a second pool spinning beside torch's made a step slower); each group is read from memory
 * once per call and reused from cache by every tile of rows.
 *
 * Built by build.py with -O3 -mavx2 -mfma -ffp-contract=off -fopenmp; the AVX-512 VNNI sums are compiled for that
 * target and taken where the CPU has them (``int8_use_vnni``).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 16 /* output channels per packed group */
#define CODE_MAX 32767.0f /* activation codes lie in [-32767, 32767] */
/* the widest block: its int32 sums stay exact (512 * 32767 * 127 < 2^31) */
#define MAX_BLOCK 512
/* how far ahead of the weights being read to ask for them (bytes): the weights stream from memory once per call */
#define PREFETCH 2048
#define AVX2_ROWS 4 /* rows per AVX2 tile: 8 int32 accumulators (4 rows, 16 channels) leave registers for the rest */
#define VNNI_ROWS 8 /* rows per AVX-512 tile */

typedef struct {
    const int8_t *weight;  /* packed [groups][k2 / 2][16][2] */
    const float *scales;   /* [n]: per-channel weight scales */
    const float *bias;     /* [n] or NULL */
    const float *residual; /* [rows, n] added to the output, or NULL */
    const int16_t *q;      /* [rows][k2]: the rows' codes, zero past k */
    const float *d;        /* [rows][blocks]: each block's scale */
    float *y;              /* [rows, n] */
    int rows, n, k2, block, blocks;
} job_t;

/* ---- quantising the rows ------------------------------------------------------------------------------------- */

static inline float block_absmax(const float *x, int len) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= len; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    float lanes[8], best = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    for (; j < len; j++) {
        const float a = fabsf(x[j]);
        best = a > best ? a : best;
    }
    return best;
}

/* One row: codes q[0..k2) (zero past k), and each block's scale d. The vector body and the scalar tail are the same
 * IEEE operations (a multiply, round half to even, a clamp), so the codes are the same either way. */
static void quantise_row(const float *x, int k, int k2, int block, int16_t *q, float *d) {
    const __m256 low = _mm256_set1_ps(-CODE_MAX), high = _mm256_set1_ps(CODE_MAX);
    for (int b = 0, start = 0; start < k; b++, start += block) {
        const int len = start + block <= k ? block : k - start;
        const float amax = block_absmax(x + start, len);
        const float scale = amax / CODE_MAX;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        const __m256 inv = _mm256_set1_ps(inverse);
        int j = 0;
        for (; j + 16 <= len; j += 16) {
            __m256i v[2];
            for (int i = 0; i < 2; i++) {
                __m256 f = _mm256_mul_ps(_mm256_loadu_ps(x + start + j + 8 * i), inv);
                f = _mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, low), high));
            }
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xd8);
            _mm256_storeu_si256((__m256i *)(q + start + j), packed);
        }
        for (; j < len; j++) {
            float f = nearbyintf(x[start + j] * inverse);
            f = f < -CODE_MAX ? -CODE_MAX : f > CODE_MAX ? CODE_MAX : f;
            q[start + j] = (int16_t)f;
        }
        d[b] = scale;
    }
    for (int j = k; j < k2; j++) q[j] = 0;
}

/* ---- the products -------------------------------------------------------------------------------------------- */

/* Channels c0..c0+width of rows r0..r0+rows from their float sums: y = acc * scale (+ bias) (+ residual before it) */
static inline void store(const job_t *job, int r0, int rows, int c0, int width, const float *acc) {
    for (int r = 0; r < rows; r++) {
        float *y = job->y + (size_t)(r0 + r) * job->n;
        for (int c = 0; c < width; c++) {
            float v = acc[r * GROUP + c] * job->scales[c0 + c];
            if (job->bias) v = v + job->bias[c0 + c];
            if (job->residual) v = job->residual[(size_t)(r0 + r) * job->n + c0 + c] + v;
            y[c0 + c] = v;
        }
    }
}

/* AVX2: the 16 channels of group g for ``rows`` rows (a constant in each inlined copy, so the accumulators stay in
 * registers). Per step of 2 inputs: the group's 32 weights widened to int16 once, then per row its 2 codes
 * broadcast and vpmaddwd (products and pair sums, exact) into 8 int32 lanes per half. */
static inline __attribute__((always_inline)) void tile_avx2(const job_t *job, int g, int r0, const int rows) {
    const int steps = job->k2 / 2, per_block = job->block / 2;
    const int8_t *w = job->weight + (size_t)g * steps * 32;
    const int32_t *q[AVX2_ROWS];
    for (int r = 0; r < rows; r++) q[r] = (const int32_t *)(job->q + (size_t)(r0 + r) * job->k2);
    __m256 acc[AVX2_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0, s0 = 0; s0 < steps; b++, s0 += per_block) {
        const int s1 = s0 + per_block < steps ? s0 + per_block : steps;
        __m256i sums[AVX2_ROWS][2];
        for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int s = s0; s < s1; s++) {
            _mm_prefetch((const char *)(w + (size_t)s * 32) + PREFETCH, _MM_HINT_T0);
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (size_t)s * 32)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (size_t)s * 32 + 16)));
            for (int r = 0; r < rows; r++) {
                const __m256i codes = _mm256_set1_epi32(q[r][s]);
                sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(w0, codes));
                sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(w1, codes));
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 scale = _mm256_set1_ps(job->d[(size_t)(r0 + r) * job->blocks + b]);
            for (int h = 0; h < 2; h++)
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(sums[r][h])));
        }
    }
    const int c0 = g * GROUP;
    if (c0 + GROUP <= job->n && !job->residual && !job->bias) {
        for (int h = 0; h < 2; h++) {
            const __m256 scales = _mm256_loadu_ps(job->scales + c0 + 8 * h);
            for (int r = 0; r < rows; r++)
                _mm256_storeu_ps(job->y + (size_t)(r0 + r) * job->n + c0 + 8 * h, _mm256_mul_ps(acc[r][h], scales));
        }
        return;
    }
    float out[AVX2_ROWS * GROUP];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + GROUP * r + 8 * h, acc[r][h]);
    store(job, r0, rows, c0, c0 + GROUP <= job->n ? GROUP : job->n - c0, out);
}

static void group_avx2(const job_t *job, int g) {
    int r = 0;
    for (; r + AVX2_ROWS <= job->rows; r += AVX2_ROWS) tile_avx2(job, g, r, AVX2_ROWS);
    switch (job->rows - r) {
    case 1: tile_avx2(job, g, r, 1); break;
    case 2: tile_avx2(job, g, r, 2); break;
    case 3: tile_avx2(job, g, r, 3); break;
    default: break;
    }
}

/* AVX-512 VNNI: the 16 channels of group g for ``rows`` rows; vpdpwssd multiplies the widened weights by each row's 2
 * codes broadcast from memory and adds the pair into its int32 lane, exactly: the same integers as AVX2's. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static inline __attribute__((always_inline)) VNNI void tile_vnni(const job_t *job, int g, int r0, const int rows) {
    const int steps = job->k2 / 2, per_block = job->block / 2;
    const int8_t *w = job->weight + (size_t)g * steps * 32;
    const int32_t *q[VNNI_ROWS];
    for (int r = 0; r < rows; r++) q[r] = (const int32_t *)(job->q + (size_t)(r0 + r) * job->k2);
    __m512 acc[VNNI_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0, s0 = 0; s0 < steps; b++, s0 += per_block) {
        const int s1 = s0 + per_block < steps ? s0 + per_block : steps;
        __m512i sums[VNNI_ROWS];
        for (int r = 0; r < rows; r++) sums[r] = _mm512_setzero_si512();
        for (int s = s0; s < s1; s++) {
            _mm_prefetch((const char *)(w + (size_t)s * 32) + PREFETCH, _MM_HINT_T0);
            const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + (size_t)s * 32)));
            for (int r = 0; r < rows; r++) sums[r] = _mm512_dpwssd_epi32(sums[r], wv, _mm512_set1_epi32(q[r][s]));
        }
        for (int r = 0; r < rows; r++) {
            const __m512 scale = _mm512_set1_ps(job->d[(size_t)(r0 + r) * job->blocks + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sums[r])));
        }
    }
    const int c0 = g * GROUP;
    if (c0 + GROUP <= job->n && !job->residual && !job->bias) {
        const __m512 scales = _mm512_loadu_ps(job->scales + c0);
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(job->y + (size_t)(r0 + r) * job->n + c0, _mm512_mul_ps(acc[r], scales));
        return;
    }
    float out[VNNI_ROWS * GROUP];
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + GROUP * r, acc[r]);
    store(job, r0, rows, c0, c0 + GROUP <= job->n ? GROUP : job->n - c0, out);
}

static VNNI void group_vnni(const job_t *job, int g) {
    int r = 0;
    for (; r + VNNI_ROWS <= job->rows; r += VNNI_ROWS) tile_vnni(job, g, r, VNNI_ROWS);
    switch (job->rows - r) {
    case 1: tile_vnni(job, g, r, 1); break;
    case 2: tile_vnni(job, g, r, 2); break;
    case 3: tile_vnni(job, g, r, 3); break;
    case 4: tile_vnni(job, g, r, 4); break;
    case 5: tile_vnni(job, g, r, 5); break;
    case 6: tile_vnni(job, g, r, 6); break;
    case 7: tile_vnni(job, g, r, 7); break;
    default: break;
    }
}

static int use_vnni = 0;

/* Whether to take the AVX-512 VNNI sums (where the CPU has them): returns whether they are taken now */
int int8_use_vnni(int wanted) {
    __builtin_cpu_init();
    use_vnni = wanted && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    return use_vnni;
}

static void run_group(const job_t *job, int g) {
    if (use_vnni)
        group_vnni(job, g);
    else
        group_avx2(job, g);
}

/* Bytes of scratch ``int8_linear`` and ``int8_mlp`` need for the codes of ``rows`` rows of width k in blocks of
 * ``block`` */
int64_t int8_scratch_bytes(int rows, int k, int block) {
    const int64_t k2 = (k + 1) & ~1, blocks = (k + block - 1) / block;
    return (int64_t)rows * (2 * k2 + 4 * blocks) + 64;
}

int rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps, int lanes, float *y);
int silu_mul_rows(const float *gate_up, int64_t rows, int64_t inter, int lanes, float *out);

/* The phases of a call. A decode step's few rows are normed and quantised by the calling thread before the threads
 * start (waiting for them at a barrier cost more than the work); a prefill chunk's many, by ``omp for`` inside the
 * parallel region. Each row and each channel is computed by one thread, whole, so the bits are the same either way. */
#define SHARED_ROWS 16 /* from this many rows the threads share the rows' norms, quantisation and SiLU */

static void prepare_row(const float *x, int r, int k, const float *norm_weight, float eps, int lanes, float *normed,
                        int block, int16_t *q, float *d) {
    const int k2 = (k + 1) & ~1, blocks = (k + block - 1) / block;
    const float *row = x + (size_t)r * k;
    if (norm_weight) {
        rms_norm_rows(row, 1, k, norm_weight, eps, lanes, normed + (size_t)r * k);
        row = normed + (size_t)r * k;
    }
    quantise_row(row, k, k2, block, q + (size_t)r * k2, d + (size_t)r * blocks);
}

/* rms_norm (where given) and quantisation of x[rows, k] into the codes ``q`` and scales ``d``: by ``omp for`` where
 * ``shared``, else whole (by the caller, outside any region) */
static void prepare_rows(const float *x, int rows, int k, const float *norm_weight, float eps, int lanes,
                         float *normed, int block, int16_t *q, float *d, int shared) {
    if (shared) {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) prepare_row(x, r, k, norm_weight, eps, lanes, normed, block, q, d);
    } else {
        for (int r = 0; r < rows; r++) prepare_row(x, r, k, norm_weight, eps, lanes, normed, block, q, d);
    }
}

/* silu(gate) * up of gate_up[rows, 2 * inter] into gated, then its quantisation (as prepare_rows) */
static void gate_rows(const float *gate_up, int rows, int inter, int lanes, float *gated, int block, int16_t *q,
                      float *d, int shared) {
    if (shared) {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            silu_mul_rows(gate_up + (size_t)r * 2 * inter, 1, inter, lanes, gated + (size_t)r * inter);
            prepare_row(gated, r, inter, NULL, 0.0f, 0, NULL, block, q, d);
        }
    } else {
        silu_mul_rows(gate_up, rows, inter, lanes, gated);
        for (int r = 0; r < rows; r++) prepare_row(gated, r, inter, NULL, 0.0f, 0, NULL, block, q, d);
    }
}

/* y = the product of the prepared codes with one Linear's weights, channel groups by ``omp for`` */
static void product(const int16_t *q, const float *d, int rows, int k, const int8_t *weight, const float *scales,
                    const float *bias, int n, int block, float *y, const float *residual) {
    const int k2 = (k + 1) & ~1, blocks = (k + block - 1) / block;
    const job_t job = {weight, scales, bias, residual, q, d, y, rows, n, k2, block, blocks};
    const int groups = (n + GROUP - 1) / GROUP;
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) run_group(&job, g);
}

static int bad_block(int block) { return block < 2 || block % 2 || block > MAX_BLOCK; }

static int16_t *codes_of(uint8_t *scratch) { return (int16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); }

/* y[rows, n] = the int8 linear of x[rows, k] (weights packed as above, ``n`` channels; scratch of
 * int8_scratch_bytes). With ``norm_weight``, of rms_norm_rows(x, norm_weight, eps, lanes) instead (written to
 * ``normed``, rows * k floats): the norm before a Linear in one call. With ``residual`` ([rows, n]), residual + that,
 * as torch's add after the Linear: one IEEE add, so the same bits. Returns 0, or -1 for a bad size, block or lanes. */
int int8_linear(const float *x, int rows, int k, const int8_t *weight, const float *scales, const float *bias, int n,
                int block, uint8_t *scratch, float *y, const float *residual, const float *norm_weight, float eps,
                int lanes, float *normed) {
    if (rows < 1 || k < 1 || n < 1 || bad_block(block) || (norm_weight && lanes != 8 && lanes != 16)) return -1;
    const int shared = rows >= SHARED_ROWS;
    int16_t *q = codes_of(scratch);
    float *d = (float *)(q + (size_t)rows * ((k + 1) & ~1));
    if (!shared) prepare_rows(x, rows, k, norm_weight, eps, lanes, normed, block, q, d, 0);
    /* threads only where there is work to share (a region costs a microsecond or two) */
#pragma omp parallel if (shared || n > 8 * GROUP)
    {
        if (shared) prepare_rows(x, rows, k, norm_weight, eps, lanes, normed, block, q, d, 1);
        product(q, d, rows, k, weight, scales, bias, n, block, y, residual);
    }
    return 0;
}

/* A gated MLP in one call: y = residual + down(silu(gate) * up) of gate_up(rms_norm(x)) (each part where given:
 * ``norm_weight`` NULL takes x as it is, ``residual`` NULL adds nothing), every step the function the separate calls
 * run (rms_norm_rows, int8_linear's product, silu_mul_rows with ``silu_lanes``), so the same bits, in one parallel
 * region. gate_up's weights have 2 * inter channels (gate first), down's ``hidden``; scratch holds the codes of the
 * wider input (int8_scratch_bytes), ``normed`` rows * hidden floats, ``gate_up`` rows * 2 * inter, ``gated`` rows *
 * inter. Returns 0, or -1 for a bad size, block or lanes. */
int int8_mlp(const float *x, int rows, int hidden, int inter, const int8_t *w1, const float *s1, const float *b1,
             const int8_t *w2, const float *s2, const float *b2, int block, uint8_t *scratch, float *y,
             const float *residual, const float *norm_weight, float eps, int norm_lanes, float *normed, int silu_lanes,
             float *gate_up, float *gated) {
    if (rows < 1 || hidden < 1 || inter < 1 || bad_block(block) || (silu_lanes != 8 && silu_lanes != 16) ||
        (norm_weight && norm_lanes != 8 && norm_lanes != 16))
        return -1;
    const int shared = rows >= SHARED_ROWS;
    int16_t *q = codes_of(scratch);
    float *d1 = (float *)(q + (size_t)rows * ((hidden + 1) & ~1)), *d2 = (float *)(q + (size_t)rows * ((inter + 1) & ~1));
    if (!shared) prepare_rows(x, rows, hidden, norm_weight, eps, norm_lanes, normed, block, q, d1, 0);
#pragma omp parallel
    {
        if (shared) prepare_rows(x, rows, hidden, norm_weight, eps, norm_lanes, normed, block, q, d1, 1);
        product(q, d1, rows, hidden, w1, s1, b1, 2 * inter, block, gate_up, NULL);
        if (shared) {
            gate_rows(gate_up, rows, inter, silu_lanes, gated, block, q, d2, 1);
        } else {
#pragma omp single
            gate_rows(gate_up, rows, inter, silu_lanes, gated, block, q, d2, 0);
        }
        product(q, d2, rows, inter, w2, s2, b2, hidden, block, y, residual);
    }
    return 0;
}

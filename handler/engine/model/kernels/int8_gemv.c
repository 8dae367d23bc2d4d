/* The lean engine's int8 Linear for a few rows (a decode step's batch), with 14-bit activations split into two 7-bit
 * halves: the same numbers as linear.py's ``_split_int8_linear`` (fbgemm's GEMM between torch's elementwise ops), in
 * one call instead of a dozen torch ops and a GEMM sized for big batches.
 *
 * Why the bits are the same: every step is either an exact integer operation or one IEEE float operation in the
 * order torch performs it (sub, div, round half to even, floor, one multiply, one add, and addcmul's fused
 * multiply-add, which torch's CPU kernel contracts: checked bit for bit in tests/unit/test_int8_kernel.py). The
 * integer product W·h is exact on both sides, so it does not matter that fbgemm blocks its sums differently.
 *
 * Built by build.py with -O3 -mavx2 -mfma -ffp-contract=off (no contraction but the explicit fmaf) and -fopenmp;
 * loaded with ctypes after torch, so its libgomp.so.1 is torch's and the output channels are split over torch's own
 * OpenMP threads (a second pool spinning beside torch's made a step slower). Each channel's sum is computed whole by
 * one thread, so the result does not depend on the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MAX_ROWS 8
/* how far ahead of the weights being read to ask for them (bytes): the weights stream from memory once per step,
 * and asking a few channels ahead made a decode step of the embedded model ~8% faster here (1024 and 8192 within
 * this machine's noise of 2048) */
#define PREFETCH 2048

typedef struct {
    const int8_t *weight;     /* [n, k] */
    const int32_t *col_sums;  /* [n]: sum of each output channel's int8 weights */
    const float *scales;      /* [n]: per-channel weight scale (fp32, as fbgemm applies it) */
    const float *row_sums;    /* [n]: dequantised row sums (linear.py's row_sums) */
    const float *bias;        /* [n] or NULL */
    const float *residual;    /* [rows, n] added to the output, or NULL */
    const uint8_t *codes;     /* [rows][2][k]: h + 64 then l + 64 per row, in 0..127 */
    const float *step, *centre;
    float *y;                 /* [rows, n] */
    int rows, n, k;
} job_t;

/* 32 int8 * u8 products of one weight block against one code block, summed into 8 int32 lanes */
static inline __m256i dot32(__m256i w, __m256i codes, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, w), ones);
}

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* One output channel against every row: the raw sums of (h + 64) and (l + 64) with its weights. Pairs of u8*s8
 * products fit int16 (127 * 128 * 2 < 32768), so maddubs does not saturate. */
static void channel(const job_t *job, int c, int32_t *raw) {
    const int k = job->k, body = k & ~31;
    const int8_t *w = job->weight + (size_t)c * k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[2 * MAX_ROWS];
    for (int i = 0; i < 2 * job->rows; i++) acc[i] = _mm256_setzero_si256();
    for (int j = 0; j < body; j += 32) {
        _mm_prefetch((const char *)(w + j) + PREFETCH, _MM_HINT_T0);
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j));
        for (int i = 0; i < 2 * job->rows; i++) {
            __m256i cv = _mm256_loadu_si256((const __m256i *)(job->codes + (size_t)i * k + j));
            acc[i] = _mm256_add_epi32(acc[i], dot32(wv, cv, ones));
        }
    }
    for (int i = 0; i < 2 * job->rows; i++) {
        int32_t sum = hsum(acc[i]);
        const uint8_t *codes = job->codes + (size_t)i * k;
        for (int j = body; j < k; j++) sum += (int32_t)w[j] * codes[j];
        raw[i] = sum;
    }
}

static void run_channels(const job_t *job, int first, int last) {
    int32_t raw[2 * MAX_ROWS];
    for (int c = first; c < last; c++) {
        channel(job, c, raw);
        const float scale = job->scales[c], row_sum = job->row_sums[c];
        const int32_t offset = 64 * job->col_sums[c];  /* the codes carry +64 */
        for (int r = 0; r < job->rows; r++) {
            /* fbgemm's epilogue: float(exact integer) * scale; then torch's, op by op */
            float high = (float)(raw[2 * r] - offset) * scale;
            float low = (float)(raw[2 * r + 1] - offset) * scale;
            float y = (high * 128.0f + low) * job->step[r];
            y = fmaf(job->centre[r], row_sum, y);
            if (job->bias) y = y + job->bias[c];
            if (job->residual) y = job->residual[(size_t)r * job->n + c] + y;
            job->y[(size_t)r * job->n + c] = y;
        }
    }
}

/* Four channels' sums (each of 8 int32 lanes over the first ``body`` inputs) reduced in one tree per row half, the
 * rest of the inputs added, and the float epilogue on four lanes, each lane the same IEEE operations in the same
 * order as run_channels' scalar ones, so the bits are the same. */
static inline __attribute__((always_inline)) void finish_four(const job_t *job, int c, const int rows, int body,
                                                             __m256i sums[4][2 * MAX_ROWS]) {
    const int k = job->k;
    const __m128i offset = _mm_slli_epi32(_mm_loadu_si128((const __m128i *)(job->col_sums + c)), 6);  /* 64 * */
    const __m128 scale = _mm_loadu_ps(job->scales + c), row_sums = _mm_loadu_ps(job->row_sums + c);
    for (int r = 0; r < rows; r++) {
        __m128i raw[2];
        for (int half = 0; half < 2; half++) {
            const int i = 2 * r + half;
            /* the four channels' sums, exact whatever the order: [c, c+1, c+2, c+3] */
            const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0][i], sums[1][i]),
                                                _mm256_hadd_epi32(sums[2][i], sums[3][i]));
            raw[half] = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            if (body < k) {
                const uint8_t *codes = job->codes + (size_t)i * k;
                int32_t tail[4] = {0, 0, 0, 0};
                for (int q = 0; q < 4; q++)
                    for (int j = body; j < k; j++) tail[q] += (int32_t)job->weight[(size_t)(c + q) * k + j] * codes[j];
                raw[half] = _mm_add_epi32(raw[half], _mm_loadu_si128((const __m128i *)tail));
            }
        }
        const __m128 hi = _mm_mul_ps(_mm_cvtepi32_ps(_mm_sub_epi32(raw[0], offset)), scale);
        const __m128 lo = _mm_mul_ps(_mm_cvtepi32_ps(_mm_sub_epi32(raw[1], offset)), scale);
        __m128 y = _mm_mul_ps(_mm_add_ps(_mm_mul_ps(hi, _mm_set1_ps(128.0f)), lo), _mm_set1_ps(job->step[r]));
        y = _mm_fmadd_ps(_mm_set1_ps(job->centre[r]), row_sums, y);
        if (job->bias) y = _mm_add_ps(y, _mm_loadu_ps(job->bias + c));
        if (job->residual) y = _mm_add_ps(_mm_loadu_ps(job->residual + (size_t)r * job->n + c), y);
        _mm_storeu_ps(job->y + (size_t)r * job->n + c, y);
    }
}

/* A decode step's rows (up to MAX_ROWS streams) against four channels: their sums reduce in one tree per row half, and
 * the float epilogue runs on four lanes, each lane the same IEEE operations in the same order as run_channels' scalar
 * ones, so the bits are the same. Per channel, the reduction and the epilogue had cost about what its 576 products
 * cost. Channel after channel: the weights stream in order, as the hardware prefetcher wants (reading the four
 * channels' rows side by side was slower from memory, measured: the head 2.3 -> 3.8 ms). ``rows`` is a constant in
 * each copy (always inlined), so a channel's accumulators stay in registers. */
static inline __attribute__((always_inline)) void four_channels_rows(const job_t *job, int c, const int rows) {
    const int k = job->k, body = k & ~31;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[4][2 * MAX_ROWS];
    for (int q = 0; q < 4; q++) {
        const int8_t *w = job->weight + (size_t)(c + q) * k;
        __m256i acc[2 * MAX_ROWS];
        for (int i = 0; i < 2 * rows; i++) acc[i] = _mm256_setzero_si256();
        for (int j = 0; j < body; j += 32) {
            _mm_prefetch((const char *)(w + j) + PREFETCH, _MM_HINT_T0);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j));
            for (int i = 0; i < 2 * rows; i++)
                acc[i] = _mm256_add_epi32(acc[i], dot32(wv, _mm256_loadu_si256((const __m256i *)(job->codes +
                                                                                              (size_t)i * k + j)), ones));
        }
        for (int i = 0; i < 2 * rows; i++) sums[q][i] = acc[i];
    }
    finish_four(job, c, rows, body, sums);
}

/* The same sums with AVX-512 VNNI: one vpdpbusd adds 64 u8*s8 products into 16 int32 lanes, where AVX2 takes three
 * instructions for 32. Integer sums, exact in any order, so the bits are AVX2's. Taken where the CPU has it
 * (``int8_use_vnni``). */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static inline __attribute__((always_inline)) VNNI void four_channels_rows_vnni(const job_t *job, int c,
                                                                               const int rows) {
    const int k = job->k, body = k & ~63;
    __m256i sums[4][2 * MAX_ROWS];
    for (int q = 0; q < 4; q++) {
        const int8_t *w = job->weight + (size_t)(c + q) * k;
        __m512i acc[2 * MAX_ROWS];
        for (int i = 0; i < 2 * rows; i++) acc[i] = _mm512_setzero_si512();
        for (int j = 0; j < body; j += 64) {
            _mm_prefetch((const char *)(w + j) + PREFETCH, _MM_HINT_T0);
            const __m512i wv = _mm512_loadu_si512((const void *)(w + j));
            for (int i = 0; i < 2 * rows; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512((const void *)(job->codes + (size_t)i * k + j)),
                                             wv);
        }
        for (int i = 0; i < 2 * rows; i++)
            sums[q][i] = _mm256_add_epi32(_mm512_castsi512_si256(acc[i]), _mm512_extracti64x4_epi64(acc[i], 1));
    }
    finish_four(job, c, rows, body, sums);
}

static int use_vnni = 0;

/* Whether to take the AVX-512 VNNI sums (where the CPU has them): returns whether they are taken now */
int int8_use_vnni(int wanted) {
    __builtin_cpu_init();
    use_vnni = wanted && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    return use_vnni;
}

/* fn(job, c, rows) with rows a constant in each case, so each copy keeps its accumulators in registers */
#define BY_ROWS(fn, job, c)                          \
    switch ((job)->rows) {                           \
    case 1: fn(job, c, 1); break;                    \
    case 2: fn(job, c, 2); break;                    \
    case 3: fn(job, c, 3); break;                    \
    case 4: fn(job, c, 4); break;                    \
    case 5: fn(job, c, 5); break;                    \
    case 6: fn(job, c, 6); break;                    \
    case 7: fn(job, c, 7); break;                    \
    default: fn(job, c, 8); break;                   \
    }

static VNNI void four_channels_vnni(const job_t *job, int c) { BY_ROWS(four_channels_rows_vnni, job, c) }

static void four_channels(const job_t *job, int c) {
    if (use_vnni) {
        four_channels_vnni(job, c);
        return;
    }
    BY_ROWS(four_channels_rows, job, c)
}

/* Per row: the 14-bit grid (step, centre) and the two 7-bit halves of each activation, as linear.py computes them */
static void quantise_rows(const float *x, int rows, int k, uint8_t *codes, float *step, float *centre) {
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * k;
        float lo = row[0], hi = row[0];
        for (int j = 1; j < k; j++) {
            lo = row[j] < lo ? row[j] : lo;
            hi = row[j] > hi ? row[j] : hi;
        }
        float s = (hi - lo) * (float)(1.0 / 16383.0);
        s = s < 1e-9f ? 1e-9f : s;
        const float c = lo + s * 8256.0f;
        uint8_t *high = codes + (size_t)(2 * r) * k, *low = high + k;
        for (int j = 0; j < k; j++) {
            float shifted = nearbyintf((row[j] - c) / s) + 64.0f;  /* k + 64 */
            float h = floorf(shifted / 128.0f);
            float l = shifted - h * 128.0f - 64.0f;
            /* the 7-bit kernel's codes: q = value + 64, clamped to 0..127 as fbgemm clamps */
            float qh = h + 64.0f, ql = l + 64.0f;
            high[j] = (uint8_t)(qh < 0.0f ? 0.0f : qh > 127.0f ? 127.0f : qh);
            low[j] = (uint8_t)(ql < 0.0f ? 0.0f : ql > 127.0f ? 127.0f : ql);
        }
        step[r] = s;
        centre[r] = c;
    }
}

int rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *weight, float eps, int lanes, float *y);

/* y[rows, n] = the split int8 linear of x[rows, k]; codes: scratch of rows * 2 * k bytes. With ``norm_weight``, of
 * rms_norm_rows(x, norm_weight, eps, lanes) instead (written to ``normed``, rows * k floats of scratch): the norm
 * before a Linear in one call. With ``residual`` ([rows, n]), residual + that, as torch's add after the Linear: one
 * IEEE add, so the same bits. Returns 0, or -1 when rows is out of range or the norm refuses its lanes. */
int int8_split_linear(const float *x, int rows, int k, const int8_t *weight, const int32_t *col_sums,
                      const float *scales, const float *row_sums, const float *bias, int n, uint8_t *codes,
                      float *y, const float *residual, const float *norm_weight, float eps, int lanes, float *normed) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    if (norm_weight) {
        if (rms_norm_rows(x, rows, k, norm_weight, eps, lanes, normed) != 0) return -1;
        x = normed;
    }
    float step[MAX_ROWS], centre[MAX_ROWS];
    quantise_rows(x, rows, k, codes, step, centre);
    job_t job = {weight, col_sums, scales, row_sums, bias, residual, codes, step, centre, y, rows, n, k};
    /* channels in blocks of 8, statically over torch's own OpenMP threads */
    const int blocks = (n + 7) / 8;
#pragma omp parallel for schedule(static) if (blocks > 8)
    for (int b = 0; b < blocks; b++) {
        const int first = b * 8, last = first + 8 < n ? first + 8 : n;
        int c = first;
        for (; c + 4 <= last; c += 4) four_channels(&job, c);
        run_channels(&job, c, last);
    }
    return 0;
}

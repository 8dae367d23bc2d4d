/* Causal attention of a step's rows over their cached keys and values, one layer in one call: decode rows and prefill
 * chunks alike, the query heads of a KV head against one read of its keys, over torch's OpenMP threads.
 *
 * Each row (a query position p and a query head) is computed alone, in an order fixed by p and nothing else: keys
 * 0..p (with a window, p - window + 1..p) in tiles at multiples of TILE, tiles past p never read (the causal mask
 * costs nothing), an online softmax across tiles. So a row's bits do not depend on how its prompt was chunked, on
 * what else is in the step, on whether it is a prefill or a decode row, on the thread count, or on the instructions:
 *   - a score q.k is q[0] * k[0], then one fused multiply-add for each next dim in order (the tile's keys transposed,
 *     so that a vector's lanes are keys);
 *   - per tile: its max over the row's keys, m' = max(m, that); the running sums scaled by exp(m - m') where m' > m;
 *     p_j = exp(s_j - m') (exp: the polynomial below, lane by lane); the normaliser's eight lanes (keys j = 8i + lane)
 *     add each group of eight keys' p in key order; the output accumulates p_j * v_j (one fused multiply-add per
 *     element) in key order;
 *   - at the end: the normaliser's lanes summed ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), gpt_oss's sink logit
 *     folded in where the layer has sinks, and the output divided by it.
 * A key outside a row's range within a tile it reads gets a zero weight, which adds exact zeros (the sums are never
 * -0), so how many such keys a tile carries for the rows beside it changes nothing.
 * Every operation is one IEEE single-precision operation per lane. The AVX2 and FMA code runs everywhere; where the
 * CPU has AVX-512, the scores, the softmax, the output sums and the key transposes take 16-lane instructions doing the
 * same operations on the same lanes (``attention_use_avx512``), so both give the same bits
 * (tests/unit/test_attention_kernel.py checks it, and the kernel against float64 attention).
 *
 * Built with -ffp-contract=off: the fused multiply-adds are the explicit ones.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64       /* keys per tile, at multiples of TILE (the cache's KEY_BLOCK) */
#define ITEM_ROWS 16  /* rows of one slot that one work item takes, so each tile of keys is read once for them */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_DIM 256
#define ALIGNED __attribute__((aligned(64)))
#define INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl")))

/* The rows of one decode group or prefill chunk, as the cache holds their keys for one layer */
typedef struct {
    const float *keys, *values;  /* KV head 0 of the first row's slot: [kv_heads][capacity][dim], head_stride apart */
    int64_t slot_stride;         /* floats from one row's slot to the next row's (0: every row reads one slot) */
    int64_t head_stride;         /* floats from one KV head to the next: capacity * dim */
    int64_t first_row, count;    /* the rows of q and out */
    const int64_t *positions;    /* each row's position, or NULL: row i at start + i */
    int64_t start;
} segment_t;

typedef struct {
    const float *q;        /* [rows][q_stride]: heads * dim values from each row's start */
    int64_t q_stride;
    float *out;            /* [rows][heads * dim] */
    int heads, kv_heads, dim;
    int64_t window;        /* 0: none */
    const float *sinks;    /* [heads] or NULL */
    const segment_t *segments;
} job_t;

typedef struct {
    int segment, kv_head;
    int64_t first, count;  /* rows of the segment */
    int64_t cost;
} item_t;

/* one query row's running softmax: the max so far and the normaliser's eight lanes (its output sums: ``accs``) */
typedef struct {
    float max, unused[7];
    float sums[8];
} row_state_t;

/* ---- the arithmetic every path shares ---------------------------------------------------------------------------- */

/* e^x, lane by lane (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n; 0 below -87.3) */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    /* n >= -127 here, so the exponent field n + 127 is 0 (the result 0) or a normal number's */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

INLINE float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

/* exp8's operations on 16 lanes */
INLINE AVX512 __m512 exp16(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

INLINE float sum_lanes(__m256 a) {
    float v[8] ALIGNED;
    _mm256_store_ps(v, a);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* ---- a tile's keys transposed: kt[d * TILE + j] = keys[j * dim + d] (exact copies) ------------------------------ */

INLINE void transpose8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* the first ``count`` keys of a tile (32 or 64: what the scores read) */
static void transpose_avx2(const float *keys, int count, const int dim, float *kt) {
    for (int j = 0; j < count; j += 8)
        for (int d = 0; d < dim; d += 8) transpose8(keys + (int64_t)j * dim + d, dim, kt + d * TILE + j, TILE);
}

INLINE AVX512 void transpose16(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 16; i += 2) {  /* lane L of t[2i] / t[2i + 1]: columns 4L..4L+1 / 4L+2..4L+3 of rows 2i, 2i+1 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* lane L of r[i + k]: column 4L + k of rows i..i+3 */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int k = 0; k < 4; k++) {  /* lanes of columns k, 8 + k (t[k]) and 4 + k, 12 + k (t[4 + k]), rows 0-7 */
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; k++) {
        _mm512_storeu_ps(dst + k * dst_stride, _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88));
        _mm512_storeu_ps(dst + (8 + k) * dst_stride, _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd));
        _mm512_storeu_ps(dst + (4 + k) * dst_stride, _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88));
        _mm512_storeu_ps(dst + (12 + k) * dst_stride, _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd));
    }
}

static AVX512 void transpose_avx512(const float *keys, int count, const int dim, float *kt) {
    for (int j = 0; j < count; j += 16)
        for (int d = 0; d < dim; d += 16) transpose16(keys + (int64_t)j * dim + d, dim, kt + d * TILE + j, TILE);
}

/* ---- scores: s[r][j] = q_r . k_j, lane j of a vector per key, one chain over d: a product, then FMAs ------------- */

/* rows nr (q[r]) against keys 8 * nv from kt's column c */
INLINE void scores_block(const float *const *q, const float *kt, int c, const int dim, const int nr, const int nv,
                         float *const *s) {
    __m256 acc[3][4];
    for (int r = 0; r < nr; r++) {
        const __m256 qd = _mm256_broadcast_ss(q[r]);
        for (int i = 0; i < nv; i++) acc[r][i] = _mm256_mul_ps(qd, _mm256_load_ps(kt + c + 8 * i));
    }
    for (int d = 1; d < dim; d++) {
        __m256 k[4];
        for (int i = 0; i < nv; i++) k[i] = _mm256_load_ps(kt + d * TILE + c + 8 * i);
        for (int r = 0; r < nr; r++) {
            const __m256 qd = _mm256_broadcast_ss(q[r] + d);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm256_fmadd_ps(qd, k[i], acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm256_store_ps(s[r] + c + 8 * i, acc[r][i]);
}

/* the scores of rows (q[r], s[r]) against the tile's first 8 * vectors keys (whole halves of the tile: the keys past
 * the last needed are computed and unused) */
static void scores_avx2(const float *const *q, int rows, const float *kt, int vectors, const int dim, float *const *s) {
    for (int r = 0; r < rows; r += 3) {
        for (int c = 0; c < 8 * vectors; c += 32) {
            switch (rows - r < 3 ? rows - r : 3) {  /* constants, so the accumulators stay in registers */
            case 3: scores_block(q + r, kt, c, dim, 3, 4, s + r); break;
            case 2: scores_block(q + r, kt, c, dim, 2, 4, s + r); break;
            default: scores_block(q + r, kt, c, dim, 1, 4, s + r); break;
            }
        }
    }
}

INLINE AVX512 void scores_block_avx512(const float *const *q, const float *kt, int c, const int dim, const int nr,
                                       const int nv, float *const *s) {
    __m512 acc[6][4];
    for (int r = 0; r < nr; r++) {
        const __m512 qd = _mm512_set1_ps(q[r][0]);
        for (int i = 0; i < nv; i++) acc[r][i] = _mm512_mul_ps(qd, _mm512_load_ps(kt + c + 16 * i));
    }
    for (int d = 1; d < dim; d++) {
        __m512 k[4];
        for (int i = 0; i < nv; i++) k[i] = _mm512_load_ps(kt + d * TILE + c + 16 * i);
        for (int r = 0; r < nr; r++) {
            const __m512 qd = _mm512_set1_ps(q[r][d]);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm512_fmadd_ps(qd, k[i], acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm512_store_ps(s[r] + c + 16 * i, acc[r][i]);
}

#define SCORES_512(nr)                                                                                             \
    case nr:                                                                                                           \
        if (nv == 4) scores_block_avx512(q + r, kt, 0, dim, nr, 4, s + r);                                             \
        else scores_block_avx512(q + r, kt, 0, dim, nr, 2, s + r);                                                     \
        break;

static AVX512 void scores_avx512(const float *const *q, int rows, const float *kt, int vectors, const int dim,
                                 float *const *s) {
    const int nv = vectors > 4 ? 4 : 2;  /* 16-key vectors: the tile's first half, or all of it */
    for (int r = 0; r < rows; r += 6) {
        switch (rows - r < 6 ? rows - r : 6) {  /* constants, so the accumulators stay in registers */
            SCORES_512(6)
            SCORES_512(5)
            SCORES_512(4)
            SCORES_512(3)
            SCORES_512(2)
            SCORES_512(1)
        }
    }
}

/* ---- the output: acc_r[d] += p_r[j] * v_j[d] in key order, lane d of a vector per dim --------------------------- */

INLINE void values_block(const float *const *p, const float *v, int count, const int dim, int d, const int nr,
                         const int nv, float *const *accs) {
    __m256 acc[2][4];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = _mm256_load_ps(accs[r] + d + 8 * i);
    for (int j = 0; j < count; j++) {
        const float *vj = v + (int64_t)j * dim + d;
        __m256 vv[4];
        for (int i = 0; i < nv; i++) vv[i] = _mm256_loadu_ps(vj + 8 * i);
        for (int r = 0; r < nr; r++) {
            const __m256 w = _mm256_broadcast_ss(p[r] + j);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm256_fmadd_ps(w, vv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm256_store_ps(accs[r] + d + 8 * i, acc[r][i]);
}

static void values_avx2(const float *const *p, int rows, const float *v, int count, const int dim,
                        float *const *accs) {
    for (int r = 0; r < rows; r += 2) {
        const int nr = rows - r < 2 ? rows - r : 2;
        int d = 0;
        for (; d + 32 <= dim; d += 32) {
            if (nr == 2) values_block(p + r, v, count, dim, d, 2, 4, accs + r);
            else values_block(p + r, v, count, dim, d, 1, 4, accs + r);
        }
        for (; d < dim; d += 8) values_block(p + r, v, count, dim, d, nr, 1, accs + r);
    }
}

INLINE AVX512 void values_block_avx512(const float *const *p, const float *v, int count, const int dim, int d,
                                       const int nr, const int nv, float *const *accs) {
    __m512 acc[6][4];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = _mm512_load_ps(accs[r] + d + 16 * i);
    for (int j = 0; j < count; j++) {
        const float *vj = v + (int64_t)j * dim + d;
        __m512 vv[4];
        for (int i = 0; i < nv; i++) vv[i] = _mm512_loadu_ps(vj + 16 * i);
        for (int r = 0; r < nr; r++) {
            const __m512 w = _mm512_set1_ps(p[r][j]);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm512_fmadd_ps(w, vv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm512_store_ps(accs[r] + d + 16 * i, acc[r][i]);
}

static AVX512 void values_avx512(const float *const *p, int rows, const float *v, int count, const int dim,
                                 float *const *accs) {
    for (int r = 0; r < rows; r += 6) {
        const int nr = rows - r < 6 ? rows - r : 6;
        int d = 0;
        for (; d + 64 <= dim; d += 64) {
            switch (nr) {
            case 6: values_block_avx512(p + r, v, count, dim, d, 6, 4, accs + r); break;
            case 3: values_block_avx512(p + r, v, count, dim, d, 3, 4, accs + r); break;
            default: values_block_avx512(p + r, v, count, dim, d, nr, 4, accs + r); break;
            }
        }
        for (; d < dim; d += 16) values_block_avx512(p + r, v, count, dim, d, nr, 1, accs + r);
    }
}

/* ---- a tile, a work item, a call ---------------------------------------------------------------------------------- */

/* One row's softmax over its keys lo..hi of the tile at t0, whose scores are s[0..TILE): the running max, the
 * normaliser's lanes and the output's sums rescaled where the max grows; s becomes the weights (0 outside lo..hi) */
static void softmax_avx2(float *s, int64_t t0, int64_t lo, int64_t hi, int groups, row_state_t *state, float *acc,
                         const int dim) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), minus_inf = _mm256_set1_ps(-INFINITY);
    const __m256 first = _mm256_set1_ps((float)(lo - t0)), last = _mm256_set1_ps((float)(hi - t0));
    float top[8] ALIGNED;
    __m256 most = minus_inf;
    for (int g = 0; g < groups; g++) {  /* keys outside lo..hi take no part: -inf scores, zero weights */
        const __m256 index = _mm256_add_ps(lane, _mm256_set1_ps((float)(8 * g)));
        const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(index, first, _CMP_GE_OQ),
                                            _mm256_cmp_ps(index, last, _CMP_LE_OQ));
        const __m256 v = _mm256_blendv_ps(minus_inf, _mm256_load_ps(s + 8 * g), inside);
        _mm256_store_ps(s + 8 * g, v);
        most = _mm256_max_ps(most, v);
    }
    _mm256_store_ps(top, most);
    float m = top[0];
    for (int i = 1; i < 8; i++) m = top[i] > m ? top[i] : m;
    __m256 sums = _mm256_load_ps(state->sums);
    if (m > state->max) {
        if (state->max != -INFINITY) {  /* before the first keys every sum is zero */
            const __m256 f = _mm256_set1_ps(exp1(state->max - m));
            sums = _mm256_mul_ps(sums, f);
            for (int d = 0; d < dim; d += 8) _mm256_store_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(acc + d), f));
        }
        state->max = m;
    }
    const __m256 mv = _mm256_set1_ps(state->max);
    for (int g = 0; g < groups; g++) {  /* a zero weight adds exact zeros below: keys past hi change nothing */
        const __m256 v = _mm256_load_ps(s + 8 * g);
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(v, mv)), _mm256_cmp_ps(v, minus_inf, _CMP_NEQ_OQ));
        _mm256_store_ps(s + 8 * g, p);
        sums = _mm256_add_ps(sums, p);
    }
    _mm256_store_ps(state->sums, sums);
}

/* softmax_avx2's operations, two groups of eight keys to a vector: the same lanes, the normaliser's sums added group
 * by group in the same order */
static AVX512 void softmax_avx512(float *s, int64_t t0, int64_t lo, int64_t hi, int groups, row_state_t *state,
                                  float *acc, const int dim) {
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512 first = _mm512_set1_ps((float)(lo - t0)), last = _mm512_set1_ps((float)(hi - t0));
    const int pairs = (groups + 1) / 2;  /* a last odd group's partner: keys past hi, so -inf and zero weights */
    __m512 most = minus_inf;
    for (int g = 0; g < pairs; g++) {
        const __m512 index = _mm512_add_ps(lane, _mm512_set1_ps((float)(16 * g)));
        const __mmask16 inside = _mm512_cmp_ps_mask(index, first, _CMP_GE_OQ) & _mm512_cmp_ps_mask(index, last,
                                                                                                    _CMP_LE_OQ);
        const __m512 v = _mm512_mask_blend_ps(inside, minus_inf, _mm512_load_ps(s + 16 * g));
        _mm512_store_ps(s + 16 * g, v);
        most = _mm512_max_ps(most, v);
    }
    const float m = _mm512_reduce_max_ps(most);
    __m256 sums = _mm256_load_ps(state->sums);
    if (m > state->max) {
        if (state->max != -INFINITY) {  /* before the first keys every sum is zero */
            const float f = exp1(state->max - m);
            sums = _mm256_mul_ps(sums, _mm256_set1_ps(f));
            for (int d = 0; d < dim; d += 16)
                _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(f)));
        }
        state->max = m;
    }
    const __m512 mv = _mm512_set1_ps(state->max);
    for (int g = 0; g < pairs; g++) {
        const __m512 v = _mm512_load_ps(s + 16 * g);
        const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, minus_inf, _CMP_NEQ_OQ),
                                             exp16(_mm512_sub_ps(v, mv)));
        _mm512_store_ps(s + 16 * g, p);
        sums = _mm256_add_ps(sums, _mm512_castps512_ps256(p));
        sums = _mm256_add_ps(sums, _mm512_extractf32x8_ps(p, 1));
    }
    _mm256_store_ps(state->sums, sums);
}

typedef void (*scores_fn)(const float *const *, int, const float *, int, int, float *const *);
typedef void (*values_fn)(const float *const *, int, const float *, int, int, float *const *);
typedef void (*softmax_fn)(float *, int64_t, int64_t, int64_t, int, row_state_t *, float *, int);
typedef void (*transpose_fn)(const float *, int, int, float *);
static transpose_fn transpose = transpose_avx2;
static scores_fn scores = scores_avx2;
static values_fn values = values_avx2;
static softmax_fn softmax = softmax_avx2;

/* Whether to take the AVX-512 scores and output sums (where the CPU has AVX-512; the same bits either way): returns
 * whether they are taken now */
int attention_use_avx512(int wanted) {
    __builtin_cpu_init();
    const int use = wanted && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                    __builtin_cpu_supports("avx512vl");
    scores = use ? scores_avx512 : scores_avx2;
    values = use ? values_avx512 : values_avx2;
    softmax = use ? softmax_avx512 : softmax_avx2;
    transpose = use ? transpose_avx512 : transpose_avx2;
    return use;
}

INLINE int64_t position_of(const segment_t *s, int64_t i) { return s->positions ? s->positions[i] : s->start + i; }

INLINE int64_t first_key(int64_t window, int64_t position) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* A thread's scratch for its work items, grown as needed and kept (an item's buffers are a few kilobytes to a few
 * hundred; allocating them per item cost more than a short decode row's arithmetic) */
static __thread char *scratch;
static __thread size_t scratch_size;

static char *scratch_of(size_t size) {
    if (size > scratch_size) {
        free(scratch);
        scratch_size = size > 2 * scratch_size ? size : 2 * scratch_size;
        scratch = aligned_alloc(64, scratch_size);
    }
    return scratch;
}

#define ROUND64(n) (((n) + 63) & ~(size_t)63)

INLINE void run_item_dim(const job_t *job, const item_t *item, const int dim) {
    const segment_t *seg = job->segments + item->segment;
    const int group = job->heads / job->kv_heads, g = item->kv_head;
    const int rows = (int)item->count * group;  /* row r: position first + r / group, query head g * group + r % group */
    /* every row of an item reads one slot: a prefill chunk's, or a decode row's own */
    const int64_t kv = item->first * seg->slot_stride + (int64_t)g * seg->head_stride;
    const float *keys = seg->keys + kv, *vals = seg->values + kv;
    const size_t sizes[] = {ROUND64(sizeof(row_state_t) * rows), ROUND64(sizeof(float) * dim * rows),
                            ROUND64(sizeof(float) * TILE * rows), ROUND64(sizeof(float) * TILE * dim),
                            ROUND64(sizeof(void *) * rows * 3), ROUND64(sizeof(int64_t) * rows * 2),
                            ROUND64(sizeof(int) * rows)};
    char *at = scratch_of(sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4] + sizes[5] + sizes[6]);
    row_state_t *states = (row_state_t *)at;
    float *accs = (float *)(at += sizes[0]), *s = (float *)(at += sizes[1]), *kt = (float *)(at += sizes[2]);
    void **pointers = (void **)(at += sizes[3]);  /* the rows a tile takes: their q, scores and sums */
    const float **active_q = (const float **)pointers;
    float **active_s = (float **)(pointers + rows), **active_acc = (float **)(pointers + 2 * rows);
    int64_t *lo = (int64_t *)(at += sizes[4]), *pos = lo + rows;
    int *active = (int *)(at + sizes[5]);
    memset(accs, 0, sizeof(float) * dim * rows);
    int64_t lo_tile = INT64_MAX, hi_tile = 0;
    for (int r = 0; r < rows; r++) {
        const int64_t i = item->first + r / group;
        pos[r] = position_of(seg, i);
        lo[r] = first_key(job->window, pos[r]);
        lo_tile = lo[r] / TILE < lo_tile ? lo[r] / TILE : lo_tile;
        hi_tile = pos[r] / TILE > hi_tile ? pos[r] / TILE : hi_tile;
        states[r].max = -INFINITY;
        memset(states[r].sums, 0, sizeof(states[r].sums));
    }
    for (int64_t t = lo_tile; t <= hi_tile; t++) {  /* each tile once for the item's rows */
        const int64_t t0 = t * TILE;
        int n = 0;
        int64_t top = -1;
        for (int r = 0; r < rows; r++) {
            if (pos[r] < t0 || lo[r] > t0 + TILE - 1) continue;
            active[n] = r;
            active_q[n] = job->q + (seg->first_row + item->first + r / group) * job->q_stride +
                          (int64_t)(g * group + r % group) * dim;
            active_s[n] = s + (int64_t)r * TILE;
            active_acc[n++] = accs + (int64_t)r * dim;
            const int64_t hi = pos[r] < t0 + TILE - 1 ? pos[r] : t0 + TILE - 1;
            top = hi > top ? hi : top;
        }
        if (!n) continue;
        const int groups = (int)((top - t0) / 8 + 1);  /* the tile's keys up to the last any row reads */
        transpose(keys + t0 * dim, groups > 4 ? TILE : TILE / 2, dim, kt);
        scores(active_q, n, kt, groups, dim, active_s);
        for (int a = 0; a < n; a++) {
            const int r = active[a];
            softmax(active_s[a], t0, lo[r] > t0 ? lo[r] : t0, pos[r] < top ? pos[r] : top, groups, states + r,
                         active_acc[a], dim);
        }
        values((const float *const *)active_s, n, vals + t0 * dim, (int)(top - t0 + 1), dim, active_acc);
    }
    for (int r = 0; r < rows; r++) {
        float *out = job->out + (seg->first_row + item->first + r / group) * (int64_t)job->heads * dim +
                     (int64_t)(g * group + r % group) * dim;
        const row_state_t *st = states + r;
        const float *acc = accs + (int64_t)r * dim;
        float total = sum_lanes(_mm256_load_ps(st->sums));
        __m256 kept = _mm256_set1_ps(1.0f);
        if (job->sinks) {  /* the sink's logit takes a share of the weight and brings no value */
            const float sink = job->sinks[g * group + r % group], m = sink > st->max ? sink : st->max;
            const float scale = exp1(st->max - m);
            total = total * scale + exp1(sink - m);
            kept = _mm256_set1_ps(scale);
        }
        const __m256 norm = _mm256_set1_ps(total);
        for (int d = 0; d < dim; d += 8)
            _mm256_storeu_ps(out + d, _mm256_div_ps(_mm256_mul_ps(_mm256_load_ps(acc + d), kept), norm));
    }
}

static void run_item(const job_t *job, const item_t *item) {
    switch (job->dim) {  /* a constant head_dim lets the compiler unroll the loops over it */
    case 64: run_item_dim(job, item, 64); break;
    case 128: run_item_dim(job, item, 128); break;
    default: run_item_dim(job, item, job->dim); break;
    }
}

static int by_cost(const void *a, const void *b) {
    const int64_t x = ((const item_t *)a)->cost, y = ((const item_t *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* out[rows, heads * dim] = attention of q's rows (q: [rows][q_stride] floats, heads * dim from each row's start)
 * over the segments' keys and values; window: a query at p sees keys in (p - window, p] (0: all up to p); sinks:
 * one logit per query head, or NULL. Returns 0, or -1 (computing nothing) for a shape the kernel does not take or a
 * position outside a segment's capacity. */
int attention_rows(const float *q, int64_t q_stride, float *out, int heads, int kv_heads, int dim,
                   const segment_t *segments, int num_segments, int64_t window, const float *sinks) {
    if (kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim % 16 || dim < 16 || dim > MAX_DIM)
        return -1;
    int64_t num_items = 0;
    for (int i = 0; i < num_segments; i++) {
        const segment_t *s = segments + i;
        /* whole groups of eight keys are read: a capacity of whole groups keeps them inside each head's keys */
        if (s->count < 0 || s->head_stride % (8 * dim)) return -1;
        for (int64_t r = 0; r < s->count; r++) {
            const int64_t p = position_of(s, r);
            if (p < 0 || p >= s->head_stride / dim) return -1;
        }
        num_items += (s->slot_stride ? s->count : (s->count + ITEM_ROWS - 1) / ITEM_ROWS) * kv_heads;
    }
    item_t few[64], *items = num_items <= 64 ? few : malloc(sizeof(item_t) * num_items);
    int64_t n = 0, total = 0;
    for (int i = 0; i < num_segments; i++) {
        const segment_t *s = segments + i;
        const int64_t rows = s->slot_stride ? 1 : ITEM_ROWS;
        for (int64_t first = 0; first < s->count; first += rows) {
            const int64_t count = s->count - first < rows ? s->count - first : rows;
            int64_t keys = 0;
            for (int64_t r = first; r < first + count; r++)
                keys += position_of(s, r) + 1 - first_key(window, position_of(s, r));
            for (int g = 0; g < kv_heads; g++) {
                items[n++] = (item_t){i, g, first, count, keys};
                total += keys;
            }
        }
    }
    qsort(items, n, sizeof(item_t), by_cost);  /* the longest first, so the threads finish together */
    const job_t job = {q, q_stride, out, heads, kv_heads, dim, window, sinks, segments};
#pragma omp parallel for schedule(dynamic, 1) if (total * heads > 32768)
    for (int64_t i = 0; i < n; i++) run_item(&job, items + i);
    if (items != few) free(items);
    return 0;
}

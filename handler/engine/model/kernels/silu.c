/* A gated MLP's ``silu(gate) * up`` of the fused gate_up projection's rows, in one call: the same bits as torch's
 * ``F.silu(gate) * up`` on CPU (three ops, 15 us a layer of a decode step of the embedded model here, 30 layers).
 *
 * Why the bits are the same: torch's CPU silu is ``x / (1 + exp(-x))`` on vectors of its Vectorized<float> width,
 * two vectors at a time, with exp from the SLEEF library it carries (Sleef_expf8_u10 or Sleef_expf16_u10), and the
 * elements past the last whole pair of vectors as scalars with the C library's expf; then the product with up is one
 * IEEE multiply per element. This does the same, calling torch's own SLEEF functions (their addresses are given by
 * ``silu_use_exp``), and kernels/__init__.py takes the width whose output equals torch's ops on random rows before it
 * is used. Built with -ffp-contract=off: nothing is fused.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

typedef __m256 (*exp8_fn)(__m256);
typedef __m512 (*exp16_fn)(__m512) __attribute__((target("avx512f")));

static exp8_fn exp8;
static exp16_fn exp16;

/* torch's SLEEF exp for 8 and 16 floats (NULL where it has none) */
void silu_use_exp(void *e8, void *e16) {
    exp8 = (exp8_fn)e8;
    exp16 = (exp16_fn)e16;
}

static inline float silu_scalar(float x) { return x / (1.0f + expf(-x)); }

static int64_t vectors8(const float *gate, const float *up, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const int64_t end = n - n % 16;  /* whole pairs of vectors, as torch's vectorized loop */
    for (int64_t i = 0; i < end; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    return end;
}

__attribute__((target("avx512f"))) static int64_t vectors16(const float *gate, const float *up, int64_t n, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const int64_t end = n - n % 32;
    for (int64_t i = 0; i < end; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate + i);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(neg)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
    return end;
}

/* gate_up [rows, 2 * inter] (gate columns first); out [rows, inter]; lanes 8 or 16: returns 0, or -1 for lanes
 * whose exp is not given */
int silu_mul_rows(const float *gate_up, int64_t rows, int64_t inter, int lanes, float *out) {
    if ((lanes == 8 && !exp8) || (lanes == 16 && !exp16) || (lanes != 8 && lanes != 16)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = lanes == 16 ? vectors16(gate, up, inter, o) : vectors8(gate, up, inter, o);
        for (; i < inter; i++) o[i] = silu_scalar(gate[i]) * up[i];
    }
    return 0;
}

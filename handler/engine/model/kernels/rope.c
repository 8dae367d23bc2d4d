/* A Llama layer's projection split into q, k (RoPE applied) and v, in one call: the same bits as qk_split.py's
 * ``split_and_rotate`` (torch's ``qk * cos + cat(-qk[half:], qk[:half]) * sin``: two multiplies, each rounded, then
 * one add; the negation and the copies are exact), without its dozen ops' dispatch per layer (73 us of a 25 ms
 * decode step of the embedded model here, 30 layers). Built with -ffp-contract=off: nothing is fused.
 */
#include <stdint.h>

/* qkv [rows, (heads + 2 kv_heads) * dim]; cos, sin [rows, dim]; out [rows, heads + 2 kv_heads, dim] (written): q and
 * k rotated, v copied, so the caller's three views are one split of one tensor */
void split_rotate_rows(const float *qkv, int64_t rows, int heads, int kv_heads, int dim, const float *cos,
                       const float *sin, float *out_rows) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * dim;
    const int half = dim / 2, first = dim - half;  /* rotated[i] = -x[half + i] for i < first, else x[i - first] */
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int h = 0; h < heads + kv_heads; h++) {
            const float *x = qkv + r * width + (int64_t)h * dim;
            float *out = out_rows + r * width + (int64_t)h * dim;
            for (int i = 0; i < dim; i++) {
                const float rotated = i < first ? -x[half + i] : x[i - first];
                const float a = x[i] * c[i], b = rotated * s[i];
                out[i] = a + b;
            }
        }
        for (int64_t i = (int64_t)(heads + kv_heads) * dim; i < width; i++)
            out_rows[r * width + i] = qkv[r * width + i];
    }
}

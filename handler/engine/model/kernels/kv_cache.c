/* A decode step's keys and values into their slots, one layer in one call: what kv_cache.py's write_decode does with
 * two index_put ops (19 us each here, two per layer) as plain copies. Refuses (returns -1, writing nothing) a
 * position outside the slots' capacity, as torch's indexing would raise.
 */
#include <stdint.h>
#include <string.h>

/* keys, values: one layer's [slots, kv_heads, capacity, dim]; k, v: count rows of [kv_heads, dim] (contiguous within
 * a row), rows k_stride / v_stride floats apart; row i goes to slot first + i at positions[i] */
int kv_write_rows(float *keys, float *values, int64_t slots, int64_t capacity, int kv_heads, int dim, int64_t first,
                  int64_t count, const int64_t *positions, const float *k, int64_t k_stride, const float *v,
                  int64_t v_stride) {
    if (first < 0 || count < 0 || first + count > slots) return -1;
    for (int64_t i = 0; i < count; i++)
        if (positions[i] < 0 || positions[i] >= capacity) return -1;
    const size_t bytes = sizeof(float) * (size_t)dim;
    for (int64_t i = 0; i < count; i++) {
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = (((first + i) * kv_heads + h) * capacity + positions[i]) * dim;
            memcpy(keys + at, k + i * k_stride + (int64_t)h * dim, bytes);
            memcpy(values + at, v + i * v_stride + (int64_t)h * dim, bytes);
        }
    }
    return 0;
}

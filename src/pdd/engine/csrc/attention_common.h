/* What the two attention kernels share (attention_bf16.c, attention_f32.c): the context a
   query attends, the softmax block and tile sizes, the vector helpers. The including file
   first defines ELEM, its element type (bf16's bits or float). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* What a query attends: `prefix` tokens read from the paged pool through a block table,
   then `nown` tokens of its own (the chunk's K/V as the model computed them). */
typedef struct {
    const ELEM *kpool, *vpool;    /* one layer's K and V: [slots, KVH, D] */
    long pool_ts;                 /* elements between slots (KVH * D) */
    const int64_t *table;         /* block ids */
    int block_size, prefix;
    const ELEM *kown, *vown;      /* [nown, KVH, D], token stride own_ts */
    long own_ts;
    int nown;
} Context;
#define D 64
#define KB 64               /* keys per softmax block */
#define RT 4                /* query rows per tile */

/* exp(x) for x <= 0: 2^n x a degree-6 polynomial of the remainder (relative error ~1e-7). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 16 vectors of 16 floats transposed in registers: r[i] lane j <- r[j] lane i. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
    }
}


static const ELEM zero_row[D] __attribute__((aligned(64)));

static inline float hmax(__m512 a, __m512 b, __m512 c, __m512 d) {
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
}

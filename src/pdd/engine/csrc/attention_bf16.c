/* Attention in bf16 on CPUs with AVX512-BF16: the engine's prefill chunks (pdd.engine.native_attention).

   A flash-style pass per KV head: the context's K and V are packed once per call so that one
   vdpbf16ps computes a pair of dimensions for 16 keys (scores) or 16 dimensions for a pair of
   keys (output); a tile of 4 query rows (the query heads of one KV head, token by token) shares
   each load; softmax runs online in fp32 over blocks of 64 keys; the probabilities are rounded
   to bf16 for P x V, as GPU flash kernels do, and the row sums add the rounded values, so the
   weights used sum to one. Scores and output accumulate in fp32. */
#include <stdint.h>

typedef uint16_t bf16;
#define ELEM bf16
#define ATTEND pdd_attend_bf16
#define ATTEND_STEP pdd_attend_bf16_step
#include "attention_common.h"

#define NP (D / 2)          /* bf16 pairs in a row */

static __thread uint32_t *kbuf = NULL, *vbuf = NULL;
static __thread size_t cap = 0;

static int grow(size_t keys) {
    if (keys <= cap) return 0;
    free(kbuf); free(vbuf);
    size_t bytes = keys * D * sizeof(bf16);
    kbuf = aligned_alloc(64, bytes); vbuf = aligned_alloc(64, bytes);
    if (!kbuf || !vbuf) { free(kbuf); free(vbuf); kbuf = vbuf = NULL; cap = 0; return -1; }
    cap = keys;
    return 0;
}

/* Key j's K (v = 0) or V (v = 1) row of KV head h: in the pool through the block table, or
   among the step's own tokens. */
static inline const bf16 *key_row(const Context *c, size_t j, int h, int v) {
    if (j < (size_t)c->prefix) {
        long slot = c->table[j / c->block_size] * c->block_size + (long)(j % c->block_size);
        return (v ? c->vpool : c->kpool) + slot * c->pool_ts + (long)h * D;
    }
    return (v ? c->vown : c->kown) + (long)(j - c->prefix) * c->own_ts + (long)h * D;
}

/* prepare: nothing per call (key_row finds each key where it is, once a KV head). */
static inline void prepare(const Context *c) { (void)c; }

/* K of one KV head, packed so that vector (block b, pair p) holds pair p of keys 16b..16b+15;
   V packed so that vector (key pair m, dims 16c..16c+15) holds both keys' values, interleaved. */
static void pack(const Context *c, int h, size_t N, size_t npad) {
    /* K: 16 keys at a time, their rows transposed as 32-bit pairs */
    for (size_t j0 = 0; j0 < npad; j0 += 16) {
        __m512i lo[16], hi[16];
        for (int i = 0; i < 16; i++) {
            const bf16 *kr = j0 + i < N ? key_row(c, j0 + i, h, 0) : zero_row;
            lo[i] = _mm512_loadu_si512(kr);
            hi[i] = _mm512_loadu_si512(kr + 32);
        }
        transpose16(lo);
        transpose16(hi);
        uint32_t *kd = kbuf + (j0 / 16) * NP * 16;
        for (int p = 0; p < 16; p++) {
            _mm512_store_si512(kd + p * 16, lo[p]);
            _mm512_store_si512(kd + (p + 16) * 16, hi[p]);
        }
    }
    /* V: two keys at a time, interleaved element by element */
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (size_t j = 0; j < npad; j += 2) {
        const bf16 *va = j < N ? key_row(c, j, h, 1) : zero_row;
        const bf16 *vb = j + 1 < N ? key_row(c, j + 1, h, 1) : zero_row;
        __m512i a0 = _mm512_loadu_si512(va), a1 = _mm512_loadu_si512(va + 32);
        __m512i b0 = _mm512_loadu_si512(vb), b1 = _mm512_loadu_si512(vb + 32);
        bf16 *vd = (bf16 *)vbuf + j * D;
        _mm512_store_si512(vd, _mm512_permutex2var_epi16(a0, lo_idx, b0));
        _mm512_store_si512(vd + 32, _mm512_permutex2var_epi16(a0, hi_idx, b0));
        _mm512_store_si512(vd + 64, _mm512_permutex2var_epi16(a1, lo_idx, b1));
        _mm512_store_si512(vd + 96, _mm512_permutex2var_epi16(a1, hi_idx, b1));
    }
}

/* Rows r0 .. r0 + rt - 1 of KV head h (row = token x G + query head of h; past `rows`
   the last row again, its result dropped) over the packed context: scores, online softmax
   and P x V, 64 keys at a time. rt is a constant where it is called (3 or 4), so each
   variant keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void tile(
        const int rt, int h, int r0, int rows, int G, size_t N, const bf16 *q, long q_ts, int pos0,
        int causal, float scale, bf16 *out, long o_ts) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    const uint32_t *qr[RT];
    long lim[RT];
    float m[RT], l[RT];
    float O[RT][D] __attribute__((aligned(64)));
    bf16 pb[RT][KB] __attribute__((aligned(64)));
    long kmax = 0;
    for (int r = 0; r < rt; r++) {
        int rr = r0 + r < rows ? r0 + r : rows - 1;
        int t = rr / G, g = rr % G;
        qr[r] = (const uint32_t *)(q + t * q_ts + (long)(h * G + g) * D);
        lim[r] = causal ? pos0 + t + 1 : (long)N;
        if (lim[r] > (long)N) lim[r] = N;
        if (lim[r] > kmax) kmax = lim[r];
        m[r] = -INFINITY; l[r] = 0.f;
        memset(O[r], 0, sizeof O[r]);
    }
    for (long kb = 0; kb < kmax; kb += KB) {
        __m512 acc[RT][4];
        for (int r = 0; r < rt; r++)
            for (int s = 0; s < 4; s++) acc[r][s] = _mm512_setzero_ps();
        const uint32_t *kblk = kbuf + (kb / 16) * NP * 16;
        for (int p = 0; p < NP; p++) {
            __m512bh kv0 = (__m512bh)_mm512_load_si512(kblk + p * 16);
            __m512bh kv1 = (__m512bh)_mm512_load_si512(kblk + NP * 16 + p * 16);
            __m512bh kv2 = (__m512bh)_mm512_load_si512(kblk + 2 * NP * 16 + p * 16);
            __m512bh kv3 = (__m512bh)_mm512_load_si512(kblk + 3 * NP * 16 + p * 16);
            for (int r = 0; r < rt; r++) {
                __m512bh b = (__m512bh)_mm512_set1_epi32(qr[r][p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], kv0, b);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], kv1, b);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], kv2, b);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], kv3, b);
            }
        }
        for (int r = 0; r < rt; r++) {
            long left = lim[r] - kb;
            __m512 sv[4];
            for (int s = 0; s < 4; s++) {
                long k = left - 16 * s;
                __mmask16 mk = k >= 16 ? 0xFFFF : k <= 0 ? 0 : (__mmask16)((1u << k) - 1);
                sv[s] = _mm512_mask_mul_ps(neg_inf, mk, acc[r][s], vscale);
            }
            float bm = hmax(sv[0], sv[1], sv[2], sv[3]);
            if (bm == -INFINITY) { memset(pb[r], 0, sizeof pb[r]); continue; }
            float mn = bm > m[r] ? bm : m[r];
            float alpha = expf(m[r] - mn);
            m[r] = mn;
            __m512 vm = _mm512_set1_ps(mn);
            __m512 sum = _mm512_setzero_ps();
            for (int s = 0; s < 4; s += 2) {
                __m512 p0 = exp512(_mm512_sub_ps(sv[s], vm));
                __m512 p1 = exp512(_mm512_sub_ps(sv[s + 1], vm));
                p0 = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(sv[s], neg_inf, _CMP_NEQ_OQ), p0);
                p1 = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(sv[s + 1], neg_inf, _CMP_NEQ_OQ), p1);
                __m512bh pp = _mm512_cvtne2ps_pbh(p1, p0);
                /* the sum of what P x V will weigh: the rounded probabilities */
                sum = _mm512_add_ps(sum, _mm512_dpbf16_ps(_mm512_setzero_ps(), pp,
                                    (__m512bh)_mm512_set1_epi32(0x3F803F80)));
                _mm512_store_si512((void *)(pb[r] + 16 * s), (__m512i)pp);
            }
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            if (alpha != 1.f) {
                __m512 va = _mm512_set1_ps(alpha);
                for (int c = 0; c < 4; c++)
                    _mm512_store_ps(O[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(O[r] + 16 * c), va));
            }
        }
        __m512 o[RT][4];
        for (int r = 0; r < rt; r++)
            for (int c = 0; c < 4; c++) o[r][c] = _mm512_load_ps(O[r] + 16 * c);
        const bf16 *vblk = (const bf16 *)vbuf + (kb / 2) * D * 2;
        for (int mm = 0; mm < KB / 2; mm++) {
            const bf16 *vr = vblk + mm * D * 2;
            __m512bh v0 = (__m512bh)_mm512_load_si512(vr);
            __m512bh v1 = (__m512bh)_mm512_load_si512(vr + 32);
            __m512bh v2 = (__m512bh)_mm512_load_si512(vr + 64);
            __m512bh v3 = (__m512bh)_mm512_load_si512(vr + 96);
            for (int r = 0; r < rt; r++) {
                __m512bh b = (__m512bh)_mm512_set1_epi32(((const uint32_t *)pb[r])[mm]);
                o[r][0] = _mm512_dpbf16_ps(o[r][0], v0, b);
                o[r][1] = _mm512_dpbf16_ps(o[r][1], v1, b);
                o[r][2] = _mm512_dpbf16_ps(o[r][2], v2, b);
                o[r][3] = _mm512_dpbf16_ps(o[r][3], v3, b);
            }
        }
        for (int r = 0; r < rt; r++)
            for (int c = 0; c < 4; c++) _mm512_store_ps(O[r] + 16 * c, o[r][c]);
    }
    for (int r = 0; r < rt && r0 + r < rows; r++) {
        int t = (r0 + r) / G, g = (r0 + r) % G;
        bf16 *dst = out + t * o_ts + (long)(h * G + g) * D;
        __m512 inv = _mm512_set1_ps(1.f / l[r]);
        for (int c = 0; c < 4; c++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(O[r] + 16 * c), inv)));
    }
}

#include "attention_entry.h"

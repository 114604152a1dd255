/* Attention in fp32 on CPUs with AVX-512F: the fp32 counterpart of attention_bf16.c, with the
   same entry points, layouts and semantics (pdd.engine.native_attention).

   A flash-style pass per KV head over a sequence's context, read in place from the paged pool
   through its block table and then from the step's own K/V. K is packed once per call and KV
   head so that one vector holds one dimension of 16 keys: a score row is then 64 FMAs of a
   broadcast query element, with no horizontal sums. A tile of up to 4 query rows (the query
   heads of one KV head, token by token) shares each load. Softmax runs online over blocks of
   64 keys; P x V reads V's rows where they are (a row of one head is 64 contiguous floats), so
   V is never copied. Everything is fp32; each query row's result depends only on its own
   keys, never on which other rows share its tile or call, so a prompt chunk and the same
   tokens decoded one by one give equal bits (the engine's extend-equality tests rely on it). */
#define ELEM float
#define ATTEND pdd_attend_f32
#define ATTEND_STEP pdd_attend_f32_step
#include "attention_common.h"

/* Per thread, grown to the longest context seen: packed K, and each key's K and V row
   (KV head 0; head h is h * D further), looked up once per call instead of per head and key. */
static __thread float *kbuf = NULL;
static __thread const float **krow = NULL, **vrow = NULL;
static __thread size_t cap = 0;

static int grow(size_t keys) {
    if (keys <= cap) return 0;
    free(kbuf); free(krow); free(vrow);
    kbuf = aligned_alloc(64, keys * D * sizeof(float));
    krow = malloc(keys * sizeof *krow);
    vrow = malloc(keys * sizeof *vrow);
    if (!kbuf || !krow || !vrow) {
        free(kbuf); free(krow); free(vrow);
        kbuf = NULL; krow = vrow = NULL; cap = 0;
        return -1;
    }
    cap = keys;
    return 0;
}

/* Each key's K and V rows, looked up once per call for every KV head. */
static void prepare(const Context *c) {
    size_t j = 0;
    for (int b = 0; j < (size_t)c->prefix; b++) {
        long slot = c->table[b] * c->block_size;
        for (int i = 0; i < c->block_size && j < (size_t)c->prefix; i++, j++) {
            krow[j] = c->kpool + (slot + i) * c->pool_ts;
            vrow[j] = c->vpool + (slot + i) * c->pool_ts;
        }
    }
    for (int i = 0; i < c->nown; i++, j++) {
        krow[j] = c->kown + (long)i * c->own_ts;
        vrow[j] = c->vown + (long)i * c->own_ts;
    }
}

/* K of KV head h, keys 0 .. npad - 1 (zeros past N): group g of 16 keys at kbuf + 16 g D,
   dimension d of its keys at + 16 d. */
static void pack(const Context *c, int h, size_t N, size_t npad) {
    (void)c;                       /* its rows were found once for the call (prepare) */
    for (size_t j0 = 0; j0 < npad; j0 += 16) {
        float *kd = kbuf + j0 * D;
        for (int part = 0; part < D / 16; part++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const float *kr = j0 + i < N ? krow[j0 + i] + (long)h * D : zero_row;
                r[i] = _mm512_loadu_si512(kr + 16 * part);
            }
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_si512(kd + (16 * part + i) * 16, r[i]);
        }
    }
}

/* Rows r0 .. r0 + rt - 1 of KV head h (row = token x G + query head of h; past `rows`
   the last row again, its result dropped) over the packed context: scores, online softmax
   and P x V, 64 keys at a time. rt is a constant where it is called (3 or 4), so each
   variant keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void tile(
        const int rt, int h, int r0, int rows, int G, size_t N, const float *q, long q_ts, int pos0,
        int causal, float scale, float *out, long o_ts) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    const float *qr[RT];
    long lim[RT];
    float m[RT], l[RT];
    float O[RT][D] __attribute__((aligned(64)));
    float pb[RT][KB] __attribute__((aligned(64)));
    long kmax = 0;
    for (int r = 0; r < rt; r++) {
        int rr = r0 + r < rows ? r0 + r : rows - 1;
        int t = rr / G, g = rr % G;
        qr[r] = q + t * q_ts + (long)(h * G + g) * D;
        lim[r] = causal ? pos0 + t + 1 : (long)N;
        if (lim[r] > (long)N) lim[r] = N;
        if (lim[r] > kmax) kmax = lim[r];
        m[r] = -INFINITY; l[r] = 0.f;
        memset(O[r], 0, sizeof O[r]);
    }
    for (long kb = 0; kb < kmax; kb += KB) {
        /* scores of 64 keys: acc[r][s] holds keys kb + 16 s .. + 15 */
        __m512 acc[RT][4];
        for (int r = 0; r < rt; r++)
            for (int s = 0; s < 4; s++) acc[r][s] = _mm512_setzero_ps();
        const float *kblk = kbuf + kb * D;
        for (int d = 0; d < D; d++) {
            __m512 k0 = _mm512_load_ps(kblk + d * 16);
            __m512 k1 = _mm512_load_ps(kblk + 16 * D + d * 16);
            __m512 k2 = _mm512_load_ps(kblk + 32 * D + d * 16);
            __m512 k3 = _mm512_load_ps(kblk + 48 * D + d * 16);
            for (int r = 0; r < rt; r++) {
                __m512 b = _mm512_set1_ps(qr[r][d]);
                acc[r][0] = _mm512_fmadd_ps(k0, b, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(k1, b, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(k2, b, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(k3, b, acc[r][3]);
            }
        }
        /* online softmax: the block's max, the weights, the output rescaled if the max moved */
        for (int r = 0; r < rt; r++) {
            long left = lim[r] - kb;
            __m512 sv[4];
            __mmask16 mk[4];
            for (int s = 0; s < 4; s++) {
                long k = left - 16 * s;
                mk[s] = k >= 16 ? 0xFFFF : k <= 0 ? 0 : (__mmask16)((1u << k) - 1);
                sv[s] = _mm512_mask_mul_ps(neg_inf, mk[s], acc[r][s], vscale);
            }
            float bm = hmax(sv[0], sv[1], sv[2], sv[3]);
            if (bm == -INFINITY) { memset(pb[r], 0, sizeof pb[r]); continue; }
            float mn = bm > m[r] ? bm : m[r];
            float alpha = expf(m[r] - mn);
            m[r] = mn;
            __m512 vm = _mm512_set1_ps(mn);
            __m512 sum = _mm512_setzero_ps();
            for (int s = 0; s < 4; s++) {
                __m512 p = _mm512_maskz_mov_ps(mk[s], exp512(_mm512_sub_ps(sv[s], vm)));
                sum = _mm512_add_ps(sum, p);
                _mm512_store_ps(pb[r] + 16 * s, p);
            }
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            if (alpha != 1.f) {
                __m512 va = _mm512_set1_ps(alpha);
                for (int c = 0; c < 4; c++)
                    _mm512_store_ps(O[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(O[r] + 16 * c), va));
            }
        }
        /* P x V over the block's keys that any row of the tile sees (past a row's own
           limit its weights are 0: adding 0 x V leaves its output as it was) */
        __m512 o[RT][4];
        for (int r = 0; r < rt; r++)
            for (int c = 0; c < 4; c++) o[r][c] = _mm512_load_ps(O[r] + 16 * c);
        long kend = kb + KB < kmax ? kb + KB : kmax;
        for (long j = kb; j < kend; j++) {
            const float *vr = vrow[j] + (long)h * D;
            __m512 v0 = _mm512_loadu_ps(vr);
            __m512 v1 = _mm512_loadu_ps(vr + 16);
            __m512 v2 = _mm512_loadu_ps(vr + 32);
            __m512 v3 = _mm512_loadu_ps(vr + 48);
            for (int r = 0; r < rt; r++) {
                __m512 b = _mm512_set1_ps(pb[r][j - kb]);
                o[r][0] = _mm512_fmadd_ps(v0, b, o[r][0]);
                o[r][1] = _mm512_fmadd_ps(v1, b, o[r][1]);
                o[r][2] = _mm512_fmadd_ps(v2, b, o[r][2]);
                o[r][3] = _mm512_fmadd_ps(v3, b, o[r][3]);
            }
        }
        for (int r = 0; r < rt; r++)
            for (int c = 0; c < 4; c++) _mm512_store_ps(O[r] + 16 * c, o[r][c]);
    }
    for (int r = 0; r < rt && r0 + r < rows; r++) {
        int t = (r0 + r) / G, g = (r0 + r) % G;
        float *dst = out + t * o_ts + (long)(h * G + g) * D;
        __m512 inv = _mm512_set1_ps(1.f / l[r]);
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(O[r] + 16 * c), inv));
    }
}

#include "attention_entry.h"

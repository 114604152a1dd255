/* The two attention kernels' entry points and per-sequence driver (attention_bf16.c,
   attention_f32.c). The including file has defined ELEM, ATTEND and ATTEND_STEP (the exported
   names), grow(keys) (its per-thread buffers for `keys` keys), prepare(c) (per call, before
   any KV head), pack(c, h, N, npad) (KV head h's context into those buffers) and tile(). */

/* One sequence: q's n tokens (x H heads x D, token stride q_ts, head stride D) at positions
   pos0.. of the context `c` (causal: token t sees keys 0..pos0+t, else every key) -> out
   (token stride o_ts). */
static int attend_one(const Context *cp, const ELEM *q, long q_ts, int n, int H, int KVH, int pos0,
                      int causal, float scale, ELEM *out, long o_ts) {
    const Context c = *cp;
    size_t N = (size_t)c.prefix + c.nown;
    size_t npad = (N + KB - 1) / KB * KB;
    if (grow(npad)) return -2;
    prepare(&c);
    const int G = H / KVH;
    const int rows = n * G;
    /* a decode of 3 query heads a KV head: tiles of 3, none wasted */
    const int rt = rows % RT && rows % 3 == 0 && rows <= 4 * RT ? 3 : RT;
    for (int h = 0; h < KVH; h++) {
        pack(&c, h, N, npad);
        for (int r0 = 0; r0 < rows; r0 += rt) {
            if (rt == 3) tile(3, h, r0, rows, G, N, q, q_ts, pos0, causal, scale, out, o_ts);
            else tile(4, h, r0, rows, G, N, q, q_ts, pos0, causal, scale, out, o_ts);
        }
    }
    return 0;
}

static int shape_ok(int H, int KVH, int head_dim) {
    return head_dim == D && KVH > 0 && H > 0 && H % KVH == 0;
}

/* One sequence's n queries over `prefix` tokens of the pool (through `table`) and `nown`
   tokens of its own. Returns 0, or < 0 for shapes this kernel does not take (-1) or no
   memory (-2). */
int ATTEND(const ELEM *q, long q_ts, int n, int H, int KVH, int head_dim,
           const ELEM *kpool, const ELEM *vpool, long pool_ts, const int64_t *table,
           int block_size, int prefix, const ELEM *kown, const ELEM *vown, long own_ts, int nown,
           int pos0, int causal, float scale, ELEM *out, long o_ts) {
    if (!shape_ok(H, KVH, head_dim) || n <= 0 || prefix < 0 || nown < 0 || pos0 < 0
        || pos0 + n > prefix + nown || (prefix > 0 && block_size <= 0))
        return -1;
    Context c = {kpool, vpool, pool_ts, table, block_size, prefix, kown, vown, own_ts, nown};
    return attend_one(&c, q, q_ts, n, H, KVH, pos0, causal, scale, out, o_ts);
}

/* A step's sequences in one call (one layer): sequence i's tokens are rows tok[i] ..
   tok[i] + num[i] - 1 of q, k and v (token strides q_ts, own_ts) and of out (o_ts); its
   context is the `start[i]` tokens before them, in the pool through the block ids
   tables[table_off[i]..], then its own tokens, attended causally. */
int ATTEND_STEP(int nseq, const int64_t *tok, const int64_t *num, const int64_t *start,
                const int64_t *tables, const int64_t *table_off, int H, int KVH, int head_dim,
                const ELEM *q, long q_ts, const ELEM *k, const ELEM *v, long own_ts,
                const ELEM *kpool, const ELEM *vpool, long pool_ts, int block_size,
                float scale, ELEM *out, long o_ts) {
    if (!shape_ok(H, KVH, head_dim) || block_size <= 0) return -1;
    for (int i = 0; i < nseq; i++) {
        if (num[i] <= 0 || start[i] < 0) return -1;
        Context c = {kpool, vpool, pool_ts, tables + table_off[i], block_size, (int)start[i],
                     k + tok[i] * own_ts, v + tok[i] * own_ts, own_ts, (int)num[i]};
        int rc = attend_one(&c, q + tok[i] * q_ts, q_ts, (int)num[i], H, KVH, (int)start[i], 1, scale,
                            out + tok[i] * o_ts, o_ts);
        if (rc) return rc;
    }
    return 0;
}

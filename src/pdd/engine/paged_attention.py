"""Attention over the paged KV cache: the callback the model calls per layer.

The model hands over post-RoPE q/k/v for a flat list of T tokens; this module
knows which tokens belong to which sequence, writes their K/V into the cache
slots the scheduler assigned, and attends over each sequence's whole context.
Single-token sequences (decodes) with short contexts are attended in one
padded, masked SDPA call, over the contiguous rows the runner keeps for
running decodes when it has them (`decode_rows.py`, `_decode_rows`: no
gather; an all-decode step writes its K and V, adjacent in the model's qkv
output, with one copy into the pool, `kv_pair`) and otherwise over blocks
gathered from the pool; with long
contexts one sequence at a time (see `_decode_each`); multi-token chunks
(prefill, extend) one SDPA call each in fp32, and in other dtypes, when they
start past 0, as pieces like a long decode's (`_chunk_pieces`: the context
before the chunk unmasked, read in place, the chunk's own K/V causally).

Context K/V are gathered a whole block at a time (index_select over the cache
viewed as [2, num_blocks, block_size, KVH, D]: one memcpy per block, K and V
in one call) rather than slot by slot; a chunk that starts at position 0 needs
no gather at all (its context is exactly the k/v just computed).

Why long decodes go one sequence at a time: a decode step is memory-bound on
the gather (one core copies ~5 GB/s here). One padded gather for the whole
batch lands in a buffer far larger than L2 (25 MB at batch 8 x 2K tokens),
so every byte is written to memory and read back, padding up to the longest
context is gathered and masked too, and SDPA works on transposed views with
GQA (9 query heads over 3 KV heads) left to its CPU fallback.
Per sequence, the gathered K/V (~1.5 MB each at 2K tokens) stays in L2 for
the two matmuls right after, there is no padding to gather or mask, and GQA
is a view (q as [KVH, G, D] against K as [KVH, L, D]) instead of a copy.
Short contexts keep the batched call: there the ~6 small ops per sequence
per layer would cost more than the copies they save.

How a decode is attended in bf16 (or fp16) depends on the CPU, so each
process measures it once (`attention_kernels.decode_kernel`). SDPA's CPU kernels take one
query row per head there; on a CPU with AMX they are the fast choice, but on
an AMD EPYC with AVX-512 bf16 and no AMX one thread took 2.7 ms per layer
for one decode over 2.5K tokens in bf16 against 0.65 ms in fp32 (a padded
batch of 16 x 256: 4.0 against 0.49 ms), so a decode step of 8 such
sequences spent ~0.7 s in attention. The `"fp32"` kernel copies the context's
K and V into fp32 buffers (exact: every bf16 value is an fp32 value) and
attends in fp32, rounding only the output to the dtype, as SDPA's kernel
does: 0.60 ms for that decode, 0.61 ms for the padded batch, copies
included. Prefill chunks keep SDPA in every dtype (many rows a call: bf16
ran as fast as fp32 there).

A decode's query attends to its whole context, so the order of the context
tokens does not matter (softmax and the weighted sum are over a set). Runs of
consecutive block ids (a prompt's blocks come out of the pool as one run,
ascending or, after tail-first release, descending) are therefore read in
place, as views of the cache, and only the rest (blocks added one at a time
during decode, the partial last block) is gathered: the copy, not the
arithmetic, is what a long decode step spends its time on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdd.engine.attention_kernels import (
    Fp32Scratch, _attend_pieces, _attend_pieces_fp32, _attend_pieces_multi, _sdpa_rows, _sdpa_rows_fp32,
)
from pdd.engine import native_attention
from pdd.engine.decode_rows import DecodeRows, RowsPlan


@dataclass
class PrefillChunk:
    start_tok: int              # index range in the flat token list
    end_tok: int
    ctx: int                    # context length (start position + tokens)
    blocks: torch.Tensor | None  # [nblk] block ids of the whole context; None when start == 0
    mask: torch.Tensor | None   # [n, ctx] bool, None when plain causal from 0
    prefix: "DecodeSeq | None" = None    # the context before the chunk as runs + rest (made at first use)


@dataclass
class DecodeSeq:
    """One decode's context split into runs read in place and blocks to gather."""
    ctx: int                           # context length (tokens attended)
    runs: list[tuple[int, int]]        # (first block id, num blocks), full blocks only
    gather: torch.Tensor | None        # [m] the other block ids, the partial last block last
    gather_tokens: int                 # valid tokens in the gathered blocks


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                # [T] where each new token's K/V goes
    decode_tok: torch.Tensor | None = None    # [B] flat indices of single-token seqs
    decode_blocks: torch.Tensor | None = None  # [B * nblk] block table, row-major, padded with 0
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, nblk * block_size] bool
    # per decode seq, set instead of the padded table/mask when the contexts
    # are long enough to attend one by one
    decode_each: list[DecodeSeq] | None = None
    all_decode: bool = False                  # every token is a decode, in order (decode_tok = arange)
    prefills: list[PrefillChunk] | None = None
    block_size: int = 16
    # set instead of the block table when the decodes' contexts are kept as rows (decode_rows.py)
    rows: RowsPlan | None = None
    rows_kv: DecodeRows | None = None
    # set instead of all the above (but slot_mapping): the step for our kernel (bf16 or fp32)
    native: native_attention.StepPlan | None = None


# Padded decode tokens (batch x longest context) from which decodes are
# attended one sequence at a time. Measured on SmolLM2-135M, one thread: up
# to ~4K padded tokens (batch 16 x 128 ... batch 2 x 2K) both paths are within
# 5%; beyond, the per-sequence path wins more the longer and the more uneven
# the contexts (1.5-3x per step at 2.5K tokens, docs/DESIGN.md).
DECODE_EACH_MIN_TOKENS = 4096
# Shortest run of consecutive blocks read in place rather than gathered:
# below it the extra matmul calls cost more than the copy they save.
DECODE_RUN_MIN_BLOCKS = 4
def split_runs(blocks: list[int], ctx: int, bs: int, min_run: int = DECODE_RUN_MIN_BLOCKS) -> DecodeSeq:
    """A decode's blocks -> runs of >= min_run consecutive full blocks + the rest to gather."""
    full = ctx // bs
    ids = sorted(blocks[:full])
    runs: list[tuple[int, int]] = []
    rest: list[int] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i + 1 >= min_run:
            runs.append((ids[i], j - i + 1))
        else:
            rest.extend(ids[i : j + 1])
        i = j + 1
    tokens = len(rest) * bs + ctx % bs
    rest.extend(blocks[full : -(-ctx // bs)])          # the partial last block, if any
    return DecodeSeq(ctx, runs, torch.tensor(rest, dtype=torch.long) if rest else None, tokens)


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int,
    decode_each_min_tokens: int | None = None, rows: tuple[DecodeRows, RowsPlan] | None = None,
    native: bool = False,
) -> AttentionMetadata:
    """seqs: (start_pos, num_tokens, block_ids) per sequence, in flat order.
    decode_each_min_tokens: None for DECODE_EACH_MIN_TOKENS, read at call time.
    rows: the decodes' contexts as rows (DecodeRows.prepare for the same decodes, in order):
    no block table is built for them then.
    native: the step goes to our kernel (`native_attention.StepPlan`, bf16 or fp32), nothing else is built."""
    bs = block_size
    if native:
        slots = [blocks[p // bs] * bs + p % bs for start, n, blocks in seqs for p in range(start, start + n)]
        return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=bs,
                                 native=native_attention.StepPlan(seqs, bs))
    slots: list[int] = []
    dec_tok: list[int] = []
    dec_blocks: list[list[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    tok = 0
    for start, n, blocks in seqs:
        ctx = start + n
        nblk = -(-ctx // bs)
        if n == 1:
            slots.append(blocks[start // bs] * bs + start % bs)
            dec_tok.append(tok)
            dec_blocks.append(blocks[:nblk])
            dec_lens.append(ctx)
        else:
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, ctx))
            mask = blk = None
            if start > 0:
                blk = torch.tensor(blocks[:nblk], dtype=torch.long)
                q_pos = torch.arange(start, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos          # [n, ctx]
            prefills.append(PrefillChunk(tok, tok + n, ctx, blk, mask))
        tok += n
    md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), prefills=prefills,
                           block_size=bs)
    if dec_tok:
        md.decode_tok = torch.tensor(dec_tok, dtype=torch.long)
        md.all_decode = not prefills
        if rows is not None:
            md.rows_kv, md.rows = rows
            return md
        nb = max(len(b) for b in dec_blocks)
        if decode_each_min_tokens is None:
            decode_each_min_tokens = DECODE_EACH_MIN_TOKENS
        if len(dec_tok) * nb * bs >= decode_each_min_tokens:
            md.decode_each = [split_runs(b, n, bs) for b, n in zip(dec_blocks, dec_lens)]
            return md
        table = [b for row in dec_blocks for b in (row + [0] * (nb - len(row)))]
        md.decode_blocks = torch.tensor(table, dtype=torch.long)
        lens = torch.tensor(dec_lens, dtype=torch.long)
        md.decode_mask = (torch.arange(nb * bs).unsqueeze(0) < lens.unsqueeze(1)).view(len(dec_tok), 1, 1, nb * bs)
    return md


def kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v [T, KVH, D] -> both as one [2, T, KVH, D] view where v follows k in memory, token by
    token (the model's fused qkv output), else None."""
    if k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(1) != k.shape[2]:
        return None
    step = k.shape[1] * k.shape[2]
    if v.data_ptr() != k.data_ptr() + step * k.element_size():
        return None
    return k.as_strided((2,) + tuple(k.shape), (step,) + tuple(k.stride()))


class PagedAttention:
    """Callable(layer, q[T,H,D], k[T,KVH,D], v[T,KVH,D]) -> out[T,H,D]."""

    def __init__(self, kv: torch.Tensor, md: AttentionMetadata, progress=None,
                 kv_layers: tuple[torch.Tensor, ...] | None = None, decode_kernel: str = "flash"):
        self.kv = kv  # [L, 2, S, KVH, D]
        # decodes in a dtype other than fp32: "flash" (SDPA on the dtype) or "fp32" (`decode_kernel`)
        self.fp32_decode = decode_kernel == "fp32" and kv.dtype is not torch.float32
        self._f32 = Fp32Scratch() if self.fp32_decode else None
        self._rows_mask32: torch.Tensor | None = None   # the rows' mask in fp32, made once a step
        self.kv_layers = kv.unbind(0) if kv_layers is None else kv_layers   # kv[l] per layer
        self.md = md
        self.progress = progress    # StepProgress: counts the layers whose KV this step has written
        self._dec_buf: torch.Tensor | None = None  # decode gather target, reused by every layer
        self._dec_mask: torch.Tensor | None = None  # decode_mask as SDPA's additive form, made once a step
        self._each_buf: torch.Tensor | None = None  # [2, nblk_max, bs, KVH, D], same for _decode_each

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.md
        kv = self.kv_layers[layer]                            # [2, S, KVH, D]
        if md.native is not None:
            return self._native(layer, kv, q, k, v)
        if md.rows is not None and md.all_decode:
            pair = kv_pair(k, v)
            if pair is not None:                              # the model's qkv output: K and V in one copy each
                return self._decode_rows_pair(layer, kv, q, pair)
        _, S, KVH, D = kv.shape
        bs = md.block_size
        kv[0].index_copy_(0, md.slot_mapping, k)
        kv[1].index_copy_(0, md.slot_mapping, v)
        if self.progress is not None:
            self.progress.wrote(layer + 1)
        paged = kv.view(2, S // bs, bs, KVH, D)               # [2, NB, bs, KVH, D]
        H = q.shape[1]
        if md.rows is not None:
            if md.all_decode:
                return self._decode_rows(layer, q, k, v)
            dt = md.decode_tok
            od = self._decode_rows(layer, q.index_select(0, dt), k.index_select(0, dt), v.index_select(0, dt))
        elif md.all_decode:
            return self._decode(paged, q, KVH, H, D)
        elif md.decode_tok is not None:
            od = self._decode(paged, q.index_select(0, md.decode_tok), KVH, H, D)
        out = torch.empty_like(q)
        if md.decode_tok is not None:
            out.index_copy_(0, md.decode_tok, od)
        for c in md.prefills or ():
            if c.blocks is not None and q.dtype is not torch.float32:
                out[c.start_tok : c.end_tok] = self._chunk_pieces(paged, c, q, k, v)
                continue
            qp = q[c.start_tok : c.end_tok].transpose(0, 1).unsqueeze(0)   # [1, H, n, D]
            if c.blocks is None:        # starts at 0: the context is this chunk's own k/v
                kp = k[c.start_tok : c.end_tok].transpose(0, 1).unsqueeze(0)   # [1, KVH, ctx, D]
                vp = v[c.start_tok : c.end_tok].transpose(0, 1).unsqueeze(0)
            else:
                g = paged.index_select(1, c.blocks).view(2, -1, KVH, D)[:, : c.ctx]   # [2, ctx, KVH, D]
                kp = g[0].transpose(0, 1).unsqueeze(0)
                vp = g[1].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=True
            )
            out[c.start_tok : c.end_tok] = op[0].transpose(0, 1)
        return out

    def _native(self, layer: int, kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """The whole step by our kernel (bf16 or fp32): this step's K/V into the pool (one copy when
        they are the model's fused qkv output), then every sequence over its context read
        in place through its block table and its own tokens (engine/native_attention.py)."""
        md = self.md
        pair = kv_pair(k, v)
        if pair is not None:
            kv.index_copy_(1, md.slot_mapping, pair)
        else:
            kv[0].index_copy_(0, md.slot_mapping, k)
            kv[1].index_copy_(0, md.slot_mapping, v)
        if self.progress is not None:
            self.progress.wrote(layer + 1)
        out = q.new_empty(q.shape)
        return native_attention.attend_step(md.native, q, k, v, (kv[0], kv[1]), out)

    def _chunk_pieces(self, paged: torch.Tensor, c: PrefillChunk, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """A chunk that starts at position p > 0, for dtypes other than fp32: its
        queries over the context before p, read as `_decode_each` reads a decode's
        (runs of blocks in place, the rest gathered: every query sees all of it, no
        mask), and over the chunk's own K/V (causal: square, so SDPA's causal
        alignment is the right one); the pieces merged by their log-sum-exp.
        Gathering the whole context and masking it cost a 9-token extend over a
        2K context 21 ms of a 93 ms bf16 step (measured; fp32 keeps the one masked
        call, the reference for exact-equality tests)."""
        n = c.end_tok - c.start_tok
        if c.prefix is None:            # once a step, for all the layers
            c.prefix = split_runs(c.blocks.tolist(), c.ctx - n, paged.shape[2])
        ks, vs = _context_pieces(paged, c.prefix)
        ks.append(k[c.start_tok : c.end_tok])
        vs.append(v[c.start_tok : c.end_tok])
        return _attend_pieces_multi(q[c.start_tok : c.end_tok], ks, vs)

    def _decode(self, paged: torch.Tensor, qd: torch.Tensor, KVH: int, H: int, D: int) -> torch.Tensor:
        """qd: [B, H, D] single-token queries -> [B, H, D]."""
        md = self.md
        if md.rows is not None:
            raise AssertionError("rows are attended by _decode_rows")
        if md.decode_each is not None:
            return self._decode_each(paged, qd, KVH, H, D)
        B = qd.shape[0]
        if self._dec_buf is None:   # one allocation per step, not per layer
            self._dec_buf = paged.new_empty((2, md.decode_blocks.numel()) + tuple(paged.shape[2:]))
        g = torch.index_select(paged, 1, md.decode_blocks, out=self._dec_buf)
        g = g.view(2, B, -1, KVH, D)                                         # [2, B, Lpad, KVH, D]
        kd = g[0].transpose(1, 2)                                            # [B, KVH, Lpad, D]
        vd = g[1].transpose(1, 2)
        if self._dec_mask is None:
            # SDPA turns a bool mask into this (0 / -inf in the dtype attended in) on every call:
            # once per step instead
            self._dec_mask = torch.zeros(md.decode_mask.shape,
                                         dtype=torch.float32 if self.fp32_decode else qd.dtype).masked_fill_(
                ~md.decode_mask, float("-inf"))
        if self.fp32_decode:
            return _sdpa_rows_fp32(qd, kd, vd, self._dec_mask, self._f32)
        return _sdpa_rows(qd, kd, vd, self._dec_mask)                       # [B, H, D]

    def _decode_rows(self, layer: int, qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor) -> torch.Tensor:
        """qd [B, H, D], kd/vd [B, KVH, D] (this step's decode tokens) -> [B, H, D], over the rows."""
        rp, rows = self.md.rows, self.md.rows_kv
        kr = rows.layer(layer)                                     # [2, cap, KVH, row_len, D]
        D = kr.shape[-1]
        kr[0].view(-1, D).index_copy_(0, rp.slots, kd.reshape(-1, D))   # slots: (row, head, position)
        kr[1].view(-1, D).index_copy_(0, rp.slots, vd.reshape(-1, D))
        return self._attend_rows(layer, qd)

    def _decode_rows_pair(self, layer: int, kv: torch.Tensor, qd: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
        """`_decode_rows` for an all-decode step whose K and V are one [2, B, KVH, D] view:
        one copy into the pool and one into the rows (four, and their views, otherwise)."""
        md = self.md
        rp = md.rows
        kv.index_copy_(1, md.slot_mapping, pair)                   # pool [2, S, KVH, D]
        if self.progress is not None:
            self.progress.wrote(layer + 1)
        rows = md.rows_kv
        rows.layer_flat(layer).index_put_((rp.kv_index,), pair)   # rows, (K/V, row, head, position)
        return self._attend_rows(layer, qd)

    def _attend_rows(self, layer: int, qd: torch.Tensor) -> torch.Tensor:
        """qd [B, H, D] (decode order) over the rows, which hold this step's K/V -> [B, H, D]."""
        rp = self.md.rows
        if rp.to_rows is not None:
            qd = qd.index_select(0, rp.to_rows)                   # decode order -> row order
        if self.fp32_decode:
            if self._rows_mask32 is None:
                self._rows_mask32 = rp.mask.float()
            od = _sdpa_rows_fp32(qd, rp.keys[layer], rp.values[layer], self._rows_mask32, self._f32)
        else:
            od = _sdpa_rows(qd, rp.keys[layer], rp.values[layer], rp.mask)   # [B, H, D]
        return od if rp.to_decodes is None else od.index_select(0, rp.to_decodes)

    def _decode_each(self, paged: torch.Tensor, qd: torch.Tensor, KVH: int, H: int, D: int) -> torch.Tensor:
        """qd: [B, H, D] -> [B, H, D], one sequence at a time (why: module docstring)."""
        seqs = self.md.decode_each
        B, G = qd.shape[0], H // KVH
        if self._each_buf is None:
            nmax = max((d.gather.numel() for d in seqs if d.gather is not None), default=0)
            self._each_buf = paged.new_empty((2, nmax) + tuple(paged.shape[2:]))
        qg = qd.view(B, KVH, G, D)                                 # head h = kvh * G + g
        out = qd.new_empty((B, KVH, G, D))
        scale = D ** -0.5
        for i, d in enumerate(seqs):
            ks, vs = _context_pieces(paged, d, self._each_buf)
            if self.fp32_decode:
                out[i] = _attend_pieces_fp32(qd[i], ks, vs, self._f32).view(KVH, G, D)
                continue
            if qd.dtype is not torch.float32:
                out[i] = _attend_pieces(qd[i], ks, vs).view(KVH, G, D)
                continue
            # strided [KVH, D, n] / [KVH, n, D] views: BLAS takes the row stride as is
            s = torch.cat([torch.bmm(qg[i], k.permute(1, 2, 0)) for k in ks], -1).mul_(scale)  # [KVH, G, ctx]
            p = torch.softmax(s, -1)
            oi = out[i]                                            # [KVH, G, D]
            a = 0
            for j, v in enumerate(vs):
                pj = p[:, :, a : a + v.shape[0]]
                if j == 0:
                    torch.bmm(pj, v.transpose(0, 1), out=oi)
                else:
                    oi.baddbmm_(pj, v.transpose(0, 1))
                a += v.shape[0]
        return out.view(B, H, D)


def _context_pieces(paged: torch.Tensor, seq: DecodeSeq,
                    bufs: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A context (`split_runs`) as pieces of K and of V, [m, KVH, D] each: its runs
    of blocks read in place, then the rest gathered (K and V separately, each into
    a contiguous prefix of `bufs`' [2, nmax, bs, KVH, D] when given)."""
    _, _, bs, KVH, D = paged.shape
    kflat, vflat = paged[0].view(-1, KVH, D), paged[1].view(-1, KVH, D)     # [S, KVH, D]
    ks = [kflat[b * bs : (b + n) * bs] for b, n in seq.runs]
    vs = [vflat[b * bs : (b + n) * bs] for b, n in seq.runs]
    if seq.gather is not None:
        m = seq.gather.numel()
        kout, vout = (bufs[0][:m], bufs[1][:m]) if bufs is not None else (None, None)
        ks.append(torch.index_select(paged[0], 0, seq.gather, out=kout).view(-1, KVH, D)[: seq.gather_tokens])
        vs.append(torch.index_select(paged[1], 0, seq.gather, out=vout).view(-1, KVH, D)[: seq.gather_tokens])
    return ks, vs

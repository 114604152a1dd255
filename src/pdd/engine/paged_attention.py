"""Attention over the paged KV cache: the callback the model calls per layer.

The model hands over post-RoPE q/k/v for a flat list of T tokens; this module
knows which tokens belong to which sequence, writes their K/V into the cache
slots the scheduler assigned, and attends over each sequence's whole context.
Single-token sequences (decodes) are attended in one padded, masked SDPA
call; multi-token chunks (prefill, extend) one SDPA call each.

Context K/V are gathered a whole block at a time (index_select over the cache
viewed as [2, num_blocks, block_size, KVH, D]: one memcpy per block, K and V
in one call) rather than slot by slot; a chunk that starts at position 0 needs
no gather at all (its context is exactly the k/v just computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start_tok: int              # index range in the flat token list
    end_tok: int
    ctx: int                    # context length (start position + tokens)
    blocks: torch.Tensor | None  # [nblk] block ids of the whole context; None when start == 0
    mask: torch.Tensor | None   # [n, ctx] bool, None when plain causal from 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                # [T] where each new token's K/V goes
    decode_tok: torch.Tensor | None = None    # [B] flat indices of single-token seqs
    decode_blocks: torch.Tensor | None = None  # [B * nblk] block table, row-major, padded with 0
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, nblk * block_size] bool
    all_decode: bool = False                  # every token is a decode, in order (decode_tok = arange)
    prefills: list[PrefillChunk] | None = None
    block_size: int = 16


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int
) -> AttentionMetadata:
    """seqs: (start_pos, num_tokens, block_ids) per sequence, in flat order."""
    bs = block_size
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
        nb = max(len(b) for b in dec_blocks)
        table = [b for row in dec_blocks for b in (row + [0] * (nb - len(row)))]
        md.decode_tok = torch.tensor(dec_tok, dtype=torch.long)
        md.decode_blocks = torch.tensor(table, dtype=torch.long)
        lens = torch.tensor(dec_lens, dtype=torch.long)
        md.decode_mask = (torch.arange(nb * bs).unsqueeze(0) < lens.unsqueeze(1)).view(len(dec_tok), 1, 1, nb * bs)
        md.all_decode = not prefills
    return md


class PagedAttention:
    """Callable(layer, q[T,H,D], k[T,KVH,D], v[T,KVH,D]) -> out[T,H,D]."""

    def __init__(self, kv: torch.Tensor, md: AttentionMetadata):
        self.kv = kv  # [L, 2, S, KVH, D]
        self.md = md
        self._dec_buf: torch.Tensor | None = None  # decode gather target, reused by every layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.md
        kv = self.kv[layer]                                   # [2, S, KVH, D]
        _, S, KVH, D = kv.shape
        bs = md.block_size
        kv[0].index_copy_(0, md.slot_mapping, k)
        kv[1].index_copy_(0, md.slot_mapping, v)
        paged = kv.view(2, S // bs, bs, KVH, D)               # [2, NB, bs, KVH, D]
        H = q.shape[1]
        if md.all_decode:
            return self._decode(paged, q, KVH, H, D)
        out = torch.empty_like(q)
        if md.decode_tok is not None:
            od = self._decode(paged, q.index_select(0, md.decode_tok), KVH, H, D)
            out.index_copy_(0, md.decode_tok, od)
        for c in md.prefills or ():
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

    def _decode(self, paged: torch.Tensor, qd: torch.Tensor, KVH: int, H: int, D: int) -> torch.Tensor:
        """qd: [B, H, D] single-token queries -> [B, H, D]."""
        md = self.md
        B = qd.shape[0]
        if self._dec_buf is None:   # one allocation per step, not per layer
            self._dec_buf = paged.new_empty((2, md.decode_blocks.numel()) + tuple(paged.shape[2:]))
        g = torch.index_select(paged, 1, md.decode_blocks, out=self._dec_buf)
        g = g.view(2, B, -1, KVH, D)                                         # [2, B, Lpad, KVH, D]
        kd = g[0].transpose(1, 2)                                            # [B, KVH, Lpad, D]
        vd = g[1].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd.unsqueeze(2), kd, vd, attn_mask=md.decode_mask, enable_gqa=True)
        return od.squeeze(2)                                                 # [B, H, D]

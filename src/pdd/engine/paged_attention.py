"""Attention over the paged KV cache: the callback the model calls per layer.

The model hands over post-RoPE q/k/v for a flat list of T tokens; this module
knows which tokens belong to which sequence, writes their K/V into the cache
slots the scheduler assigned, and attends over each sequence's whole context.
Single-token sequences (decodes) are attended in one padded, masked SDPA
call; multi-token chunks (prefill, extend) one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start_tok: int              # index range in the flat token list
    end_tok: int
    slots: torch.Tensor         # [ctx] cache slots of the whole context
    mask: torch.Tensor | None   # [n, ctx] bool, None when plain causal from 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                # [T] where each new token's K/V goes
    decode_tok: torch.Tensor | None = None    # [B] flat indices of single-token seqs
    decode_slots: torch.Tensor | None = None  # [B, Lmax] context slots (padded with 0)
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, Lmax] bool
    prefills: list[PrefillChunk] | None = None


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int
) -> AttentionMetadata:
    """seqs: (start_pos, num_tokens, block_ids) per sequence, in flat order."""
    slot_parts: list[torch.Tensor] = []
    dec_tok, dec_slots, prefills = [], [], []
    offsets = torch.arange(block_size)
    tok = 0
    for start, n, blocks in seqs:
        ctx = start + n
        nblk = -(-ctx // block_size)
        slots = (torch.tensor(blocks[:nblk]).unsqueeze(1) * block_size + offsets).flatten()[:ctx]
        slot_parts.append(slots[start:])
        if n == 1:
            dec_tok.append(tok)
            dec_slots.append(slots)
        else:
            mask = None
            if start > 0:
                q_pos = torch.arange(start, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos          # [n, ctx]
            prefills.append(PrefillChunk(tok, tok + n, slots, mask))
        tok += n
    md = AttentionMetadata(slot_mapping=torch.cat(slot_parts), prefills=prefills)
    if dec_tok:
        lmax = max(len(s) for s in dec_slots)
        padded = torch.zeros(len(dec_slots), lmax, dtype=torch.long)
        mask = torch.zeros(len(dec_slots), 1, 1, lmax, dtype=torch.bool)
        for i, s in enumerate(dec_slots):
            padded[i, : len(s)] = s
            mask[i, 0, 0, : len(s)] = True
        md.decode_tok, md.decode_slots, md.decode_mask = torch.tensor(dec_tok), padded, mask
    return md


class PagedAttention:
    """Callable(layer, q[T,H,D], k[T,KVH,D], v[T,KVH,D]) -> out[T,H,D]."""

    def __init__(self, kv: torch.Tensor, md: AttentionMetadata):
        self.kv = kv  # [L, 2, S, KVH, D]
        self.md = md

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.md
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]  # [S, KVH, D]
        k_cache.index_copy_(0, md.slot_mapping, k)
        v_cache.index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        if md.decode_tok is not None:
            qd = q.index_select(0, md.decode_tok).unsqueeze(2)          # [B, H, 1, D]
            kd = k_cache[md.decode_slots].transpose(1, 2)               # [B, KVH, L, D]
            vd = v_cache[md.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_mask, enable_gqa=True)
            out.index_copy_(0, md.decode_tok, od.squeeze(2))
        for c in md.prefills or ():
            qp = q[c.start_tok : c.end_tok].transpose(0, 1).unsqueeze(0)   # [1, H, n, D]
            kp = k_cache[c.slots].transpose(0, 1).unsqueeze(0)             # [1, KVH, ctx, D]
            vp = v_cache[c.slots].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=True
            )
            out[c.start_tok : c.end_tok] = op[0].transpose(0, 1)
        return out

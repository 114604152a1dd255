"""Running decodes' K/V kept contiguous, one row per sequence, across steps.

Why: a short-context decode step attends every sequence over its whole
context. Read through the block table, that context has to be gathered out of
the paged cache into a padded [B, L, KVH, D] buffer, for each of the 30
layers, at every step: at batch 16 and ~200-token contexts the copy cost as
much as the attention itself (docs/DESIGN.md). A decode's context only grows
by one token a step, so this module keeps the gathered form between steps:
each running decode owns a row of a [L, 2, rows, KVH, row_len, D] buffer,
filled from the paged cache once when the sequence joins the decode batch;
after that every step appends the new token's K/V to its row (besides the
paged cache, which stays the one source of truth for export, prefix caching
and layer streaming) and attention reads the rows in place, as a strided
view ([B, KVH, ctx, D] per layer: each head's keys contiguous, which SDPA's
CPU kernel read ~7% faster in bf16 than the token-major [B, ctx, KVH, D]).
The new token's K and V are written by one `index_put_`, from the model's
qkv output as it is (`layer_flat`, `RowsPlan.kv_index`).

Lifecycle of a row, decided per step by `prepare` from (request id,
context length) pairs, committed by `commit` once the forward pass succeeded:

    free --(sequence decodes, row not valid)--> refilled from the pool
    valid (holds ctx - 1 tokens of that request) --(decodes again)--> + 1 token
    any --(request did not decode in the last step, or clear())--> free

A row is valid only for the request that decoded in the step just before with
one token less, so preemption, recompute and extend can never leave stale
K/V in a row; a KV import into a block a row was copied from drops that row
(`drop_block`, through the runner's `write_block`). Rows in use
are always 0..B-1 (attention takes the first B rows), which `prepare` keeps by
moving a surviving row down when a lower one frees up.

Memory: `max_tokens` padded tokens (rows x row length; 4096 by default:
94 MB in bf16, 189 MB in fp32 for SmolLM2-135M's 30 layers), made by
`reserve` (a decode instance at start-up) or else at the first decode, and
kept: a new layout (more rows, a longer row) is a view of
the same storage, and an idle engine forgets its rows but keeps the storage
(`release`), so a request's first decode step fills its row without
faulting fresh pages in. A batch that does not fit falls back to gathering
(`prepare` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Padded tokens (rows x row length) the buffer may hold. Batches beyond this
# attend through the block table as before (long contexts go one sequence at a
# time there, reading runs of blocks in place).
DECODE_ROWS_MAX_TOKENS = 4096
# Free tokens a row gets at the end when the rows are (re)laid out, so that
# they are re-made (a full gather) once per this many steps, not every step.
# None: all the storage leaves (attention reads a row only up to the step's
# longest context, so a long row costs nothing but the room).
ROW_HEADROOM: int | None = None


@dataclass
class RowsPlan:
    """What a step's attention needs to use the rows."""
    slots: torch.Tensor               # [B * KVH] flat (row, head, position) of each decode's new token
    num_rows: int                     # B
    row_len: int                      # allocated length of a row
    ctx_max: int                      # longest context this step: the attended length
    mask: torch.Tensor                # [B, 1, 1, ctx_max] 0 / -inf, row order
    to_rows: torch.Tensor | None      # [B] decode index of each row (None: row i is decode i)
    to_decodes: torch.Tensor | None   # [B] row of each decode
    kv_index: torch.Tensor            # [2, B, KVH] flat (K/V, row, head, position) of each new K and V,
                                      # decode order: index_put_ into `layer_flat` writes both at once
    keys: tuple[torch.Tensor, ...] = ()     # per layer, the [B, KVH, ctx_max, D] view attention reads
    values: tuple[torch.Tensor, ...] = ()   # (made for all layers in two calls, not 3 per layer)


class DecodeRows:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_size: int, max_tokens: int = DECODE_ROWS_MAX_TOKENS, headroom: int | None = ROW_HEADROOM):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.headroom = headroom
        self._store: torch.Tensor | None = None   # max_tokens tokens of K/V, made once, kept
        self.buf: torch.Tensor | None = None      # [L, 2, num_rows_cap, KVH, row_len, D], a view of it
        self.layers: list[torch.Tensor] = []      # buf[l] per layer
        self.flat: list[torch.Tensor] = []        # buf[l] as [2 * num_rows_cap * KVH * row_len, D]
        self.row_len = 0
        self.num_rows_cap = 0
        self.held: list[tuple[str, int] | None] = []   # per row: (request id, tokens held) or None
        self.blocks: dict[int, list[int]] = {}     # row -> its request's block table (the live list)
        self._pending: list[tuple[str, int]] | None = None
        self.num_refills = 0                       # rows filled from the pool (for tests and profiles)

    def release(self) -> None:
        """The engine is idle: forget every row, keep the storage. Handing it
        back made the next request's first decode step fault all of it in
        again: 0.25 s of CPU in a deployment's `prepare` (0.5 s of wall time
        beside MD on a shared core) against ~0.06 s to fill a row
        (`results/wb-s18-cpu`, 2-2.7K-token contexts in bf16), on every relayed
        request that found RLD idle."""
        self.clear()
        self.blocks = {}

    def reserve(self) -> None:
        """Make the storage now if it is not made yet: a decode instance does so at
        start-up, so that no request's first decode step pays for it (0.6-1.1 s
        beside MD on the shared core in the deployment, `results/wb-s18-rows`)."""
        if self._store is None:
            L, KVH, D = self.shape
            # zeros, not empty: padding positions are masked with -inf, and 0 * NaN
            # would be NaN; later layouts reuse it, holding only K/V written since
            self._store = torch.zeros(L * 2 * self.max_tokens * KVH * D, dtype=self.dtype)

    def clear(self) -> None:
        """Forget every row (the pool's K/V may have changed under them)."""
        self.held = [None] * self.num_rows_cap
        self._pending = None

    def drop_block(self, block_id: int) -> None:
        """A pool block was overwritten from outside a step (KV import): forget the rows
        copied from it. Imports land in blocks of requests that are not decoding, so
        normally no row is hit and the running batch keeps its rows."""
        for r, blocks in list(self.blocks.items()):
            if block_id in blocks and r < len(self.held):
                self.held[r] = None

    def _alloc(self, num_rows: int, ctx_max: int) -> bool:
        bs = self.block_size
        need = -(-ctx_max // bs) * bs
        if num_rows * need > self.max_tokens:
            return False
        if self.buf is not None and num_rows <= self.num_rows_cap and ctx_max <= self.row_len:
            return True
        rows = max(num_rows, self.num_rows_cap)
        if rows * need > self.max_tokens:
            rows = num_rows
        room = self.max_tokens // rows - need
        if self.headroom is not None:
            room = min(self.headroom, room)
        self.row_len = need + max(0, room) // bs * bs
        self.num_rows_cap = rows
        L, KVH, D = self.shape
        self.reserve()
        self.buf = self._store[: L * 2 * rows * KVH * self.row_len * D].view(L, 2, rows, KVH, self.row_len, D)
        # per layer, the views a step uses, made once here rather than 30 times a step
        self.layers = list(self.buf.unbind(0))                    # [2, rows, KVH, row_len, D] each
        self.flat = [b.view(-1, D) for b in self.layers]          # [2 * rows * KVH * row_len, D] each
        self.held = [None] * rows
        return True

    def prepare(self, decodes: list[tuple[str, int, list[int]]], kv: torch.Tensor) -> RowsPlan | None:
        """decodes: (request id, context length incl. this step's token, block ids) per decode,
        in the step's decode order; kv: the pool [L, 2, S, KVH, D]. Refills rows as needed.
        None when the batch does not fit the buffer (rows are then all freed)."""
        B = len(decodes)
        ctx_max = max(c for _, c, _ in decodes)
        if not self._alloc(B, ctx_max):
            self.clear()
            return None
        want = {rid: c - 1 for rid, c, _ in decodes}
        # keep a row only for a request decoding now with exactly one token less
        for r, h in enumerate(self.held):
            if h is not None and want.get(h[0]) != h[1]:
                self.held[r] = None
        row_of = {h[0]: r for r, h in enumerate(self.held) if h is not None}
        free = [r for r in range(B) if self.held[r] is None]
        buf = self.buf
        rows: list[int] = []
        for rid, c, blocks in decodes:
            r = row_of.get(rid)
            if r is not None and r < B:
                rows.append(r)
                continue
            dst = free.pop(0)
            if r is not None:                # a surviving row above B: move it down
                buf[:, :, dst, :, : c - 1].copy_(buf[:, :, r, :, : c - 1])
                self.held[r] = None
            else:
                self._refill(buf, dst, kv, blocks, c - 1)
            self.held[dst] = (rid, c - 1)
            rows.append(dst)
        self.blocks = {r: blocks for r, (_, _, blocks) in zip(rows, decodes)}
        ctxs = [c for _, c, _ in decodes]
        self._pending = [(rid, c) for rid, c, _ in decodes]
        self._pending_rows = rows
        KVH, n = self.shape[1], self.row_len
        slots = torch.tensor([(r * KVH + h) * n + c - 1 for r, c in zip(rows, ctxs) for h in range(KVH)],
                             dtype=torch.long)
        half = self.num_rows_cap * KVH * n             # the V half of a layer, flattened
        kv_index = torch.stack((slots, slots + half)).view(2, B, KVH)
        row_ctx = [0] * B
        for r, c in zip(rows, ctxs):
            row_ctx[r] = c
        lens = torch.tensor(row_ctx, dtype=torch.long)
        mask = torch.zeros(B, 1, 1, ctx_max, dtype=self.dtype).masked_fill_(
            (torch.arange(ctx_max).unsqueeze(0) >= lens.unsqueeze(1)).view(B, 1, 1, ctx_max), float("-inf"))
        ident = rows == list(range(B))
        to_rows = to_dec = None
        if not ident:
            inv = [0] * B
            for i, r in enumerate(rows):
                inv[r] = i
            to_rows = torch.tensor(inv, dtype=torch.long)
            to_dec = torch.tensor(rows, dtype=torch.long)
        g = buf[:, :, :B, :, :ctx_max]                # [L, 2, B, KVH, ctx_max, D]
        return RowsPlan(slots, B, self.row_len, ctx_max, mask, to_rows, to_dec, kv_index,
                        g[:, 0].unbind(0), g[:, 1].unbind(0))

    def _refill(self, buf: torch.Tensor, row: int, kv: torch.Tensor, blocks: list[int], n: int) -> None:
        """Copy a sequence's first n tokens, all layers, from the pool into a row,
        block by block straight into place. Gathering the blocks first
        (`index_select`) made a temporary as large as the context's whole K/V
        (63 MB for 2.7K tokens in bf16) and copied it twice: 43 ms alone here,
        0.1-0.44 s of CPU in a deployment's first decode of a relayed request
        (RLD's step stalled the user's stream 1.1-1.4 s beside MD, 12-16x the
        median gap, in `results/wan-bound-32` and `s20-occ-pdd`); in place: 13 ms."""
        self.num_refills += 1
        if n == 0:
            return
        bs = self.block_size
        L, _, S, KVH, D = kv.shape
        src = kv.view(L, 2, S // bs, bs, KVH, D)
        dst = buf[:, :, row]                           # [L, 2, KVH, row_len, D]
        for j, b in enumerate(blocks[: -(-n // bs)]):
            m = min(bs, n - j * bs)
            dst[:, :, :, j * bs: j * bs + m].copy_(src[:, :, b, :m].transpose(2, 3))

    def commit(self) -> None:
        """The step's forward pass succeeded: each decode's row now holds its whole context."""
        if self._pending is None:
            return
        for (rid, c), r in zip(self._pending, self._pending_rows):
            self.held[r] = (rid, c)
        # rows of requests that did not decode this step are dropped (lifecycle above)
        used = set(self._pending_rows)
        for r in range(len(self.held)):
            if r not in used:
                self.held[r] = None
        self._pending = None

    def layer(self, layer: int) -> torch.Tensor:
        """[2, rows, KVH, row_len, D] of one layer: the view a step writes and reads."""
        return self.layers[layer]

    def layer_flat(self, layer: int) -> torch.Tensor:
        """One layer's rows as [2 * rows * KVH * row_len, D], what `RowsPlan.kv_index` indexes."""
        return self.flat[layer]

"""The attention kernels the paged cache calls, and which one a decode takes.

`pdd.engine.paged_attention` decides what each sequence attends over (its
pieces of the paged cache, padded rows, a chunk's own K/V); this module does
the attending: SDPA on the dtype as it is (`_sdpa_rows`, `_attend_pieces`,
`_attend_pieces_multi` for a chunk's queries, pieces merged by their
log-sum-exp), or, for decodes in bf16 / fp16, the context copied to fp32 and
attended there (`_sdpa_rows_fp32`, `_attend_pieces_fp32`, buffers reused
across a step's layers in `Fp32Scratch`). Which of the two a process uses for
decodes is `decode_kernel`'s choice ("auto" measures both once per process;
docs/DESIGN.md, "bf16 decode attention on a CPU without AMX").
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pdd.engine.config import DECODE_ATTENTION

# Chunks up to this many tokens attend the context before them with their
# query heads grouped by KV head (`_attend_pieces_multi`).
GROUP_MAX_ROWS = 32

# How decodes are attended in a dtype other than fp32 (`[engine]
# decode_attention`): SDPA's kernels on the dtype as it is, or the context
# copied to fp32 and attended there; "auto" measures both once per process.
DECODE_KERNELS = tuple(k for k in DECODE_ATTENTION if k != "auto")
_CHOSEN: dict[tuple, str] = {}


def decode_kernel(setting: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                  group: int) -> str:
    """The decode kernel to use: `setting` itself unless "auto"; fp32 engines
    always attend in fp32 (the reference paths). "auto" times both kernels on
    a 1,024-token context and a padded batch of 8 x 256 (~30 ms here, alternated,
    best of 5) and keeps the faster for the rest of the process."""
    if setting not in DECODE_ATTENTION:
        raise ValueError(f"decode attention must be auto, flash or fp32, got {setting!r}")
    if dtype is torch.float32:
        return "fp32"
    if setting != "auto":
        return setting
    key = (dtype, num_kv_heads, head_dim, group)
    if key not in _CHOSEN:
        _CHOSEN[key] = _measure(dtype, num_kv_heads, head_dim, group)
    return _CHOSEN[key]


def _measure(dtype: torch.dtype, kvh: int, d: int, group: int) -> str:
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1024, kvh, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(kvh * group, d, generator=g).to(dtype)
    rk, rv = (torch.randn(8, kvh, 256, d, generator=g).to(dtype) for _ in range(2))
    rq = torch.randn(8, kvh * group, d, generator=g).to(dtype)
    mask = torch.zeros(8, 1, 1, 256, dtype=dtype)
    mask32 = mask.float()
    bufs = Fp32Scratch()
    runs = {"flash": lambda: (_attend_pieces(q, [k], [v]), _sdpa_rows(rq, rk, rv, mask)),
            "fp32": lambda: (_attend_pieces_fp32(q, [k], [v], bufs), _sdpa_rows_fp32(rq, rk, rv, mask32, bufs))}
    best = {name: float("inf") for name in runs}
    with torch.inference_mode():
        for _ in range(5):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.get)


class Fp32Scratch:
    """fp32 buffers a step's decode attention reuses across layers (grown, never shrunk)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for x in shape:
            n *= x
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self._bufs[name] = torch.empty(n, dtype=torch.float32)
        return buf[:n].view(shape)


def _sdpa_rows(qd: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """qd [B, H, D] over keys / values [B, KVH, L, D] with an additive mask [B, 1, 1, L] -> [B, H, D]."""
    return F.scaled_dot_product_attention(qd.unsqueeze(2), keys, values, attn_mask=mask,
                                          enable_gqa=True).squeeze(2)


def _sdpa_rows_fp32(qd: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask32: torch.Tensor,
                    bufs: Fp32Scratch) -> torch.Tensor:
    """`_sdpa_rows` in fp32: K and V copied into fp32 buffers, the mask given in fp32 (made
    once a step), the output rounded to qd's dtype."""
    kf = bufs.get("k", tuple(keys.shape))
    vf = bufs.get("v", tuple(values.shape))
    kf.copy_(keys)
    vf.copy_(values)
    return _sdpa_rows(qd.float(), kf, vf, mask32).to(qd.dtype)


def _merge_by_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention over pieces of a context -> over the whole: outputs [H, n, D] and
    their log-sum-exps [H, n] (fp32) weighed by each piece's share of the mass."""
    w = torch.softmax(torch.stack(lses), 0).unsqueeze(-1)              # [pieces, H, n, 1]
    o = torch.stack(outs).float()                                      # [pieces, H, n, D]
    return (o * w).sum(0).to(outs[0].dtype)


def _attend_pieces(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """One decode's query q [H, D] over its context in pieces (k, v [n, KVH, D] each, token-major
    strided views) -> [H, D]; for dtypes other than fp32. SDPA's CPU flash kernel reads the
    strided views as they are, where `torch.bmm` in bf16 first copied each piece to a contiguous
    transpose (4x the time at 1.3K tokens, measured); pieces are merged by their log-sum-exp."""
    H, D = q.shape
    q4 = q.view(1, H, 1, D)
    parts = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0), 0.0, False)[:2]
        for k, v in zip(ks, vs)]
    if len(parts) == 1:
        return parts[0][0].view(H, D)
    return _merge_by_lse([o[0] for o, _ in parts], [lse[0] for _, lse in parts]).view(H, D)


def _attend_pieces_fp32(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                        bufs: Fp32Scratch) -> torch.Tensor:
    """`_attend_pieces` by the fp32 kernel: the pieces copied head-major into one fp32
    [KVH, ctx, D] buffer each for K and V, q's heads grouped by KV head, two fp32 matmuls
    and a softmax; the output rounded to q's dtype."""
    H, D = q.shape
    KVH = ks[0].shape[1]
    ctx = sum(k.shape[0] for k in ks)
    kf = bufs.get("k", (KVH, ctx, D))
    vf = bufs.get("v", (KVH, ctx, D))
    a = 0
    for k, v in zip(ks, vs):
        m = k.shape[0]
        kf[:, a : a + m].copy_(k.transpose(0, 1))
        vf[:, a : a + m].copy_(v.transpose(0, 1))
        a += m
    s = torch.bmm(q.float().view(KVH, H // KVH, D), kf.transpose(1, 2)).mul_(D ** -0.5)   # [KVH, G, ctx]
    return torch.bmm(torch.softmax(s, -1), vf).view(H, D).to(q.dtype)


def _attend_pieces_multi(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """A chunk's queries q [n, H, D] over context pieces (k, v [m, KVH, D] each, token-major
    views) of which the last is the chunk's own K/V, attended causally -> [n, H, D];
    the pieces merged by their log-sum-exp (as `_attend_pieces`)."""
    n, H, D = q.shape
    KVH = ks[-1].shape[1]
    G = H // KVH
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q4 = q.transpose(0, 1).unsqueeze(0)                                  # [1, H, n, D]
    # A short chunk's query heads of one KV head as one group of G x n rows over
    # the pieces it sees whole (no mask): the kernel then reads each KV head's keys
    # once, not once per query head (a 9-token chunk over 2K tokens: 0.43 -> 0.24 ms
    # a layer, the same result; no gain from 64 rows on).
    grouped = n <= GROUP_MAX_ROWS and len(ks) > 1
    qg = q.view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(1, KVH, G * n, D) if grouped else None
    parts = []
    for i, (kp, vp) in enumerate(zip(ks, vs)):
        kk, vv = kp.permute(1, 0, 2).unsqueeze(0), vp.permute(1, 0, 2).unsqueeze(0)
        if i == len(ks) - 1 or not grouped:
            o, lse = flash(q4, kk, vv, 0.0, i == len(ks) - 1)[:2]
        else:
            o, lse = flash(qg, kk, vv, 0.0, False)[:2]
            o, lse = o.reshape(1, H, n, D), lse.reshape(1, H, n)       # row g*n + i of KV head h: head h*G + g
        parts.append((o, lse))
    if len(parts) == 1:
        return parts[0][0][0].transpose(0, 1)
    return _merge_by_lse([o[0] for o, _ in parts], [lse[0] for _, lse in parts]).transpose(0, 1)   # [n, H, D]

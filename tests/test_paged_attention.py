"""PagedAttention against a plain reference: contiguous K/V per sequence, one SDPA each.

Random mixed batches (decodes at different context lengths, partial last
blocks, extends over a cached context, prefills from 0), blocks scattered over
the cache; both decode paths (batched padded SDPA and one sequence at a time)
must equal the reference within 1e-5 in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdd.engine import attention_kernels, paged_attention
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.engine.paged_attention import DecodeSeq, PagedAttention, build_metadata, split_runs
from pdd.model.reference import generate_greedy

KVH, H, D, BS = 3, 9, 64, 16
NUM_BLOCKS = 160
EACH, BATCHED = 0, 1 << 62   # decode_each_min_tokens forcing either decode path


def _free_list(rng: random.Random, layout: str) -> list[int]:
    """Block ids in the order the seqs draw them (from the end): scattered, or in runs
    (ascending and descending, as a pool hands them out) broken up here and there."""
    ids = list(range(NUM_BLOCKS))
    if layout == "scattered":
        rng.shuffle(ids)
        return ids
    out, i = [], 0
    while i < NUM_BLOCKS:
        n = rng.randrange(1, 24)
        run = ids[i:i + n]
        out.extend(run if rng.random() < 0.5 else run[::-1])
        i += n
    return out[::-1]


def _batch(rng: random.Random, kinds: list[str], layout: str) -> list[tuple[int, int, list[int]]]:
    """(start, num_tokens, block_ids) per seq; block ids drawn without reuse."""
    free = _free_list(rng, layout)
    seqs = []
    for kind in kinds:
        if kind == "decode":
            start, n = rng.randrange(1, 300), 1
        elif kind == "extend":
            start, n = rng.randrange(1, 200), rng.randrange(2, 40)
        else:   # prefill from 0
            start, n = 0, rng.randrange(2, 60)
        nblk = -(-(start + n) // BS)
        seqs.append((start, n, [free.pop() for _ in range(nblk)]))
    return seqs


def _reference(kv: torch.Tensor, seqs, q: torch.Tensor) -> torch.Tensor:
    """kv: [2, S, KVH, D] after the step's writes; q: [T, H, D] -> [T, H, D]."""
    out, tok = [], 0
    for start, n, blocks in seqs:
        ctx = start + n
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(ctx)])
        k = kv[0, slots].transpose(0, 1).repeat_interleave(H // KVH, 0)   # [H, ctx, D]
        v = kv[1, slots].transpose(0, 1).repeat_interleave(H // KVH, 0)
        qs = q[tok:tok + n].transpose(0, 1)                                # [H, n, D]
        mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(start, ctx).unsqueeze(1)   # [n, ctx]
        out.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask).transpose(0, 1))
        tok += n
    return torch.cat(out)


def _run(kv0: torch.Tensor, seqs, q, k, v, min_tokens: int,
         kernel: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    kv = kv0.clone()
    md = build_metadata(seqs, BS, min_tokens)
    att = PagedAttention(kv, md, decode_kernel=kernel)
    return att(1, q, k, v), kv


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("seed", range(6))
def test_mixed_batches_equal_contiguous_reference(seed, layout):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kinds = [rng.choice(["decode", "decode", "extend", "prefill"]) for _ in range(rng.randrange(1, 9))]
    if seed % 3 == 0:
        kinds = ["decode"] * rng.randrange(1, 12)     # all-decode steps take their own branch
    seqs = _batch(rng, kinds, layout)
    T = sum(n for _, n, _ in seqs)
    kv0 = torch.randn(3, 2, NUM_BLOCKS * BS, KVH, D)   # [L, 2, S, KVH, D]; stale slots are random too
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    outs = {}
    for path, min_tokens in (("each", EACH), ("batched", BATCHED)):
        out, kv = _run(kv0, seqs, q, k, v, min_tokens)
        if path == "each" and layout == "runs" and "decode" in kinds:
            md = build_metadata(seqs, BS, min_tokens)
            assert any(d.runs for d in md.decode_each), "no run read in place: the layout tests nothing"
        ref = _reference(kv[1], seqs, q)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=f"{path} path, kinds {kinds}")
        outs[path] = (out, kv)
    # both paths write the same cache
    assert torch.equal(outs["each"][1], outs["batched"][1])


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("seed", range(4))
def test_bf16_decodes_one_at_a_time_match_the_fp32_reference(seed, layout):
    """bf16 decodes through `_decode_each` (SDPA's flash kernel per piece, pieces merged by their
    log-sum-exp) against fp32 attention over the same bf16 K/V: within bf16's rounding."""
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    seqs = _batch(rng, ["decode"] * rng.randrange(1, 9), layout)
    T = len(seqs)
    kv0 = torch.randn(3, 2, NUM_BLOCKS * BS, KVH, D).to(torch.bfloat16)
    q, k, v = (torch.randn(T, n, D).to(torch.bfloat16) for n in (H, KVH, KVH))
    out, kv = _run(kv0, seqs, q, k, v, EACH)
    md = build_metadata(seqs, BS, EACH)
    if layout == "runs":
        assert any(d.runs and d.gather is not None for d in md.decode_each), "no two-piece context"
    ref = _reference(kv[1].float(), seqs, q.float())
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=1e-2)     # measured <= 5.4e-3
    batched, _ = _run(kv0, seqs, q, k, v, BATCHED)          # the padded bf16 path, as before
    torch.testing.assert_close(out.float(), batched.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("seed", range(3))
def test_bf16_decodes_by_the_fp32_kernel_round_only_the_output(seed, layout):
    """The fp32 decode kernel (the context copied to fp32, attended there) on both decode
    paths and in a mixed step: the fp32 reference over the same bf16 K/V, rounded once to
    bf16 (within one bf16 step of the output); SDPA's bf16 kernel stays within its own
    rounding of it; the cache written is the same."""
    rng = random.Random(200 + seed)
    torch.manual_seed(seed)
    kinds = ["decode"] * rng.randrange(1, 9) + (["extend", "decode"] if seed == 2 else [])
    seqs = _batch(rng, kinds, layout)
    T = sum(n for _, n, _ in seqs)
    kv0 = torch.randn(3, 2, NUM_BLOCKS * BS, KVH, D).to(torch.bfloat16)
    q, k, v = (torch.randn(T, n, D).to(torch.bfloat16) for n in (H, KVH, KVH))
    for min_tokens in (EACH, BATCHED):
        out, kv = _run(kv0, seqs, q, k, v, min_tokens, "fp32")
        ref = _reference(kv[1].float(), seqs, q.float())
        starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
        dec = torch.tensor([t for t, (_, n, _) in zip(starts, seqs) if n == 1])
        err = (out.float() - ref)[dec].abs()
        assert (err <= ref[dec].abs() / 128 + 1e-6).all(), err.max()     # bf16 keeps 8 bits
        flash, kv_flash = _run(kv0, seqs, q, k, v, min_tokens, "flash")
        torch.testing.assert_close(out.float(), flash.float(), rtol=0, atol=2e-2)
        assert torch.equal(kv, kv_flash)


def test_decode_kernel_choice():
    assert attention_kernels.decode_kernel("auto", torch.float32, KVH, D, H // KVH) == "fp32"
    assert attention_kernels.decode_kernel("flash", torch.bfloat16, KVH, D, H // KVH) == "flash"
    chosen = attention_kernels.decode_kernel("auto", torch.bfloat16, KVH, D, H // KVH)
    assert chosen in attention_kernels.DECODE_KERNELS
    assert attention_kernels._CHOSEN[(torch.bfloat16, KVH, D, H // KVH)] == chosen   # measured once
    with pytest.raises(ValueError, match="decode attention"):
        attention_kernels.decode_kernel("fast", torch.bfloat16, KVH, D, H // KVH)
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="fast")


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("seed", range(4))
def test_bf16_chunks_after_a_context_match_the_fp32_reference(seed, layout, monkeypatch):
    """bf16 chunks that start past 0 (extends, later prefill chunks) through
    `_chunk_pieces`: the context before the chunk in pieces read in place or
    gathered, with the query heads grouped by KV head (short chunks) or not, the
    chunk's own K/V causally, merged by log-sum-exp; against fp32 attention over
    the same bf16 K/V, within bf16's rounding."""
    rng = random.Random(200 + seed)
    torch.manual_seed(seed)
    seqs = _batch(rng, [rng.choice(["extend", "extend", "decode"]) for _ in range(rng.randrange(1, 6))] + ["extend"],
                  layout)
    T = sum(n for _, n, _ in seqs)
    kv0 = torch.randn(3, 2, NUM_BLOCKS * BS, KVH, D).to(torch.bfloat16)
    q, k, v = (torch.randn(T, n, D).to(torch.bfloat16) for n in (H, KVH, KVH))
    calls = []
    real = PagedAttention._chunk_pieces
    monkeypatch.setattr(PagedAttention, "_chunk_pieces", lambda self, *a: calls.append(1) or real(self, *a))
    for group_max in (0, 64):                      # per query head / grouped by KV head
        monkeypatch.setattr(attention_kernels, "GROUP_MAX_ROWS", group_max)
        calls.clear()
        out, kv = _run(kv0, seqs, q, k, v, EACH)
        assert len(calls) == sum(1 for st, n, _ in seqs if n > 1 and st > 0)
        ref = _reference(kv[1].float(), seqs, q.float())
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)     # measured <= 6.5e-3


def test_threshold_picks_the_path_by_padded_tokens():
    seqs = [(2047, 1, list(range(128))), (100, 1, list(range(128, 135)))]
    long = build_metadata(seqs, BS)                         # 2 x 128 blocks x 16 = 4096 padded tokens
    assert long.decode_each is not None and long.decode_blocks is None
    a, b = long.decode_each
    assert (a.ctx, a.runs, a.gather, a.gather_tokens) == (2048, [(0, 128)], None, 0)
    assert (b.ctx, b.runs, b.gather.tolist(), b.gather_tokens) == (101, [(128, 6)], [134], 5)
    short = build_metadata([(100, 1, list(range(7)))], BS)
    assert short.decode_each is None and short.decode_mask is not None


def test_split_runs_reads_long_runs_in_place_and_gathers_the_rest():
    # blocks in allocation order: a descending prompt run, decode blocks, a partial last block
    blocks = [9, 8, 7, 6, 5, 40, 2, 41, 30]
    d = split_runs(blocks, ctx=8 * 16 + 3, bs=16, min_run=4)
    assert d.runs == [(5, 5)]
    assert d.gather.tolist() == [2, 40, 41, 30]          # short runs sorted, the partial block last
    assert d.gather_tokens == 3 * 16 + 3
    full = split_runs([3, 4, 5, 6], ctx=64, bs=16, min_run=4)
    assert (full.runs, full.gather, full.gather_tokens) == ([(3, 4)], None, 0)
    assert isinstance(full, DecodeSeq)


def test_engine_on_the_per_sequence_path_equals_the_reference(tiny_model, monkeypatch):
    """Every decode through _decode_each (threshold 0), with mixed steps, chunked
    prefill and a block pool that has been churned: greedy tokens equal the unpaged
    reference's."""
    monkeypatch.setattr(paged_attention, "DECODE_EACH_MIN_TOKENS", 0)
    model, cfg = tiny_model
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(100, 5000) for _ in range(n)] for i, n in enumerate([5, 17, 70, 130, 33])}
    eng = Engine(model, cfg, EngineConfig(num_blocks=128, block_size=16, max_num_batched_tokens=48,
                                          decode_rows=False, attention="sdpa"))
    calls = []
    real = paged_attention.PagedAttention._decode_each
    monkeypatch.setattr(paged_attention.PagedAttention, "_decode_each",
                        lambda self, *a: calls.append(1) or real(self, *a))
    for rid, p in prompts.items():
        eng.submit(EngineRequest(rid, p, SamplingParams(max_tokens=20, ignore_eos=True)))
    got = {rid: [] for rid in prompts}
    for _ in range(500):
        if not eng.has_work:
            break
        for ev in eng.step():
            if ev.token_id is not None:
                got[ev.request_id].append(ev.token_id)
    assert got == {rid: generate_greedy(model, p, 20) for rid, p in prompts.items()}
    assert calls, "the per-sequence path never ran"

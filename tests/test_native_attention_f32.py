"""Our fp32 attention kernel (pdd.engine.native_attention, csrc/attention_f32.c)
against SDPA in fp32 over the same K/V gathered from the pool, and in the
engine against SDPA's paths.

Tolerance, stated once: the kernel's output within 1e-5 of the largest output
magnitude plus 1e-5 of each value of SDPA's (both fp32, summing in different
orders; measured up to ~2e-6 of the largest here). Exactly equal, bit for
bit: a query row's result whatever else shares its call (a chunk's tokens
against the same tokens decoded one by one, a sequence alone against the
same sequence in a step), which is what fp32's exact-equality tests of the
engine (extend = step by step, catch-up handoff) rest on.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import attention_helpers as helpers
from attention_helpers import BS, D, H, KVH, prompt, run
from pdd.engine import native_attention as na

needs_kernel = pytest.mark.skipif(not na.available(torch.float32),
                                  reason=f"fp32 kernel: {na.unavailable_reason(torch.float32)}")

RTOL = 1e-5
pool_context = partial(helpers.pool_context, dtype=torch.float32)
qkv = partial(helpers.qkv, dtype=torch.float32)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, causal: bool = True) -> torch.Tensor:
    """q [n, H, D] at positions pos0.. over k / v [N, KVH, D] by SDPA in fp32 -> [n, H, D]."""
    n, N = q.shape[0], k.shape[0]
    mask = torch.arange(N)[None] <= pos0 + torch.arange(n)[:, None] if causal else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype is torch.float32 and not got.isnan().any()
    err = (got - want).abs()
    bound = RTOL * (want.abs().max() + want.abs())
    assert (err <= bound).all(), f"max error {err.max().item():.4g}, worst excess {(err - bound).max().item():.4g}"


# odd lengths, and contexts ending just before, at and after the kernel's 64-key blocks
@needs_kernel
@pytest.mark.parametrize("prefix,n", [(0, 1), (0, 7), (0, 63), (0, 64), (0, 65), (0, 130), (1, 1), (37, 5),
                                      (63, 1), (64, 1), (63, 2), (100, 64), (127, 130), (700, 3), (1000, 257),
                                      (1500, 1)])
def test_a_chunk_over_the_pool_and_its_own_tokens(prefix, n):
    gen = torch.Generator().manual_seed(prefix * 1000 + n)
    pool, table, kp, vp = pool_context(gen, prefix)
    q, k, v = qkv(gen, n)
    got = na.attend(q, k, v, (pool[0], pool[1]), table, prefix, BS)
    close(got, reference(q, torch.cat([kp, k]), torch.cat([vp, v]), prefix))


@needs_kernel
def test_peaked_scores_and_non_causal_queries():
    """Large scores (the softmax all but one-hot, the running max moving block to block)
    and queries that see every key."""
    gen = torch.Generator().manual_seed(7)
    pool, table, kp, vp = pool_context(gen, 290)
    pool *= 3
    q, k, v = qkv(gen, 20, scale=3.0)
    kp, vp = kp * 3, vp * 3
    for causal in (True, False):
        got = na.attend(q, k, v, (pool[0], pool[1]), table, 290, BS, causal=causal)
        close(got, reference(q, torch.cat([kp, k]), torch.cat([vp, v]), 290, causal=causal))


def mixed_step(gen: torch.Generator, specs: list[tuple[int, int]], slots: int = 16384):
    """A pool and a step of sequences (start, tokens) with non-contiguous block tables
    (a table may run past its context), the step's K/V already in the pool as
    PagedAttention writes them -> pool, seqs, q, k, v."""
    pool = torch.randn(2, slots, KVH, D, generator=gen)
    perm = torch.randperm(slots // BS, generator=gen).tolist()
    seqs, rows = [], 0
    for start, n in specs:
        nblk = -(-(start + n) // BS)
        blocks, perm = perm[:nblk], perm[nblk:]
        seqs.append((start, n, blocks + [perm.pop()]))
        rows += n
    q, k, v = qkv(gen, rows)
    slot = torch.tensor([b[p // BS] * BS + p % BS for s, n, b in seqs for p in range(s, s + n)])
    pool[0][slot] = k
    pool[1][slot] = v
    return pool, seqs, q, k, v


# prompt chunks from 0 and past cached prefixes, decodes at odd lengths and at 64-key block edges
SPECS = [(0, 33), (200, 1), (15, 1), (64, 40), (1, 1), (500, 1), (63, 1), (127, 2), (130, 67), (1023, 1), (64, 1)]


@needs_kernel
def test_a_step_of_decodes_and_chunks_in_one_call():
    gen = torch.Generator().manual_seed(3)
    pool, seqs, q, k, v = mixed_step(gen, SPECS)
    out = torch.full(q.shape, float("nan"))
    na.attend_step(na.StepPlan(seqs, BS), q, k, v, (pool[0], pool[1]), out)
    row = 0
    for s, n, blocks in seqs:
        idx = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(s + n)])
        close(out[row : row + n], reference(q[row : row + n], pool[0][idx], pool[1][idx], s))
        row += n


@needs_kernel
def test_a_row_gives_the_same_bits_whatever_shares_its_call():
    """A sequence alone equals it in the step; a chunk's tokens equal the same tokens
    attended one at a time (as decodes over the pool): fp32's exact-equality tests rely on it."""
    gen = torch.Generator().manual_seed(5)
    pool, seqs, q, k, v = mixed_step(gen, SPECS)
    out = torch.empty(q.shape)
    na.attend_step(na.StepPlan(seqs, BS), q, k, v, (pool[0], pool[1]), out)
    row = 0
    for s, n, blocks in seqs:
        alone = torch.empty(n, H, D)
        sl = slice(row, row + n)
        na.attend_step(na.StepPlan([(s, n, blocks)], BS), q[sl], k[sl], v[sl], (pool[0], pool[1]), alone)
        assert torch.equal(alone, out[sl])
        for t in range(n):                   # token t as a decode: its own K/V last, the rest from the pool
            one = torch.empty(1, H, D)
            r = row + t
            na.attend_step(na.StepPlan([(s + t, 1, blocks)], BS), q[r : r + 1], k[r : r + 1], v[r : r + 1],
                           (pool[0], pool[1]), one)
            assert torch.equal(one, out[r : r + 1]), (s, n, t)
        row += n


@needs_kernel
def test_layouts_it_does_not_take_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(gen, 4)
    with pytest.raises(ValueError, match="k_own: f32"):
        na.attend(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="q: f32"):
        na.attend(q.transpose(1, 2), k, v)                              # heads not contiguous
    with pytest.raises(ValueError, match="refused"):
        na.attend(q, k[:2], v[:2])                                      # 4 queries, 2 keys
    with pytest.raises(ValueError, match="refused"):
        na.attend(torch.randn(4, H, 32), torch.randn(4, KVH, 32), torch.randn(4, KVH, 32))   # head_dim 32


def test_auto_takes_it_on_one_thread_and_native_insists(monkeypatch):
    if na.available(torch.float32):
        assert na.use_kernel("auto", torch.float32, D)
        assert not na.use_kernel("auto", torch.float32, D, num_threads=2)
        assert not na.use_kernel("sdpa", torch.float32, D)
    kern = na.KERNELS[torch.float32]
    monkeypatch.setattr(kern, "tried", True)
    monkeypatch.setattr(kern, "fn", None)
    monkeypatch.setattr(kern, "why", "the CPU lacks avx512f")
    assert not na.use_kernel("auto", torch.float32, D)
    with pytest.raises(RuntimeError, match="f32 kernel cannot run: the CPU lacks avx512f"):
        na.use_kernel("native", torch.float32, D)


# ---------------------------------------------------------------------- in the engine

@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, smollm2_dir):
    return helpers.tiny64(tmp_path_factory, smollm2_dir, torch.float32)


@needs_kernel
def test_native_steps_match_sdpa_steps(tiny64):
    """The kernel against SDPA's fp32 paths, step by step through the paged cache: a prompt
    in two chunks (the second reads the first back from the pool) with a short one beside it,
    then decodes of both; each side its own pool, the same blocks. Logits within 1e-4 of the
    largest (two fp32 paths through 2 layers), the same top token everywhere."""
    from pdd.engine.paged_attention import PagedAttention, build_metadata

    model, cfg = tiny64
    a, b = prompt(31, 120), prompt(32, 9)
    blocks_a, blocks_b = [7, 3, 12, 0, 9, 4, 15, 1], [5, 11]
    steps = [[(0, 48, a, blocks_a)], [(48, 72, a, blocks_a), (0, 9, b, blocks_b)]]
    for i in range(4):
        steps.append([(120 + i, 1, a + prompt(40 + i, 4), blocks_a), (9 + i, 1, b + prompt(50 + i, 4), blocks_b)])
    pools = {side: torch.zeros(cfg.num_layers, 2, 16 * 16, cfg.num_kv_heads, cfg.head_dim)
             for side in ("sdpa", "native")}
    with torch.inference_mode():
        for step in steps:
            ids = [t for s, n, toks, _ in step for t in toks[s : s + n]]
            pos = [p for s, n, _, _ in step for p in range(s, s + n)]
            seqs = [(s, n, blocks) for s, n, _, blocks in step]
            logits = {}
            for side, kv in pools.items():
                md = build_metadata(seqs, 16, native=side == "native")
                hidden = model(torch.tensor(ids), torch.tensor(pos), PagedAttention(kv, md))
                logits[side] = model.compute_logits(hidden)
            want, got = logits["sdpa"], logits["native"]
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernel
def test_fp32_engine_native_equals_the_reference_and_extends_exactly(tiny64):
    """fp32 with the kernel: greedy output equals the contiguous reference model's, and an
    extend pass (20 tokens made elsewhere) continues with the same tokens. Its KV is not
    bit-equal to step-by-step decoding's (the projections' matmuls over 20 rows and over 1
    sum in different orders, under either attention): within 1e-5 of a block's largest."""
    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.engine.request import EngineRequest, SamplingParams
    from pdd.model.reference import generate_greedy

    model, cfg = tiny64
    p = prompt(5, 40)
    ecfg = EngineConfig(num_blocks=64, attention="native")
    step = EngineRequest("s", p, SamplingParams(max_tokens=30, ignore_eos=True), keep_kv=True)
    e1 = Engine(model, cfg, ecfg)
    assert e1.runner.native and e1.runner.rows is None
    run(e1, [step])
    ref = step.output_token_ids
    assert ref == generate_greedy(model, p, 30)
    ext = EngineRequest("x", p, SamplingParams(max_tokens=30, ignore_eos=True), output_ids=ref[:20], keep_kv=True)
    e2 = Engine(model, cfg, ecfg)
    run(e2, [ext])
    assert ext.output_token_ids == ref
    for i in range((len(p) + len(ref) - 1) // 16):
        a, b = e1.runner._block_view(step.block_ids[i]), e2.runner._block_view(ext.block_ids[i])
        assert (a - b).abs().max() <= RTOL * a.abs().max(), i

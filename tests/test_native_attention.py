"""Our bf16 attention kernel (pdd.engine.native_attention, csrc/attention_bf16.c)
against attention computed in fp32 from the same bf16 values.

Tolerance, stated once: the kernel's output within 1/64 of the largest output
magnitude plus one bf16 rounding of each value (1/128 relative) of the fp32
reference's. Its scores and sums are fp32 like the reference's; it rounds the
probabilities to bf16 before P x V (as GPU flash kernels do) and the output to
bf16, each a relative error of at most 2^-9; the fp32 reference of SDPA's own
bf16 kernel measured within the same bound on these shapes.

The engine-level checks (extend equals step-by-step decoding, greedy agreement
with fp32 on SmolLM2) run the kernel in tests/test_engine_bf16.py. The fp32
kernel: tests/test_native_attention_f32.py.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import attention_helpers as helpers
from attention_helpers import BS, D, H, KVH
from pdd.engine import native_attention as na
from pdd.engine.config import EngineConfig

needs_kernel = pytest.mark.skipif(not na.available(), reason=f"bf16 kernel: {na.unavailable_reason()}")
pool_context = partial(helpers.pool_context, dtype=torch.bfloat16)
qkv = partial(helpers.qkv, dtype=torch.bfloat16)



def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, causal: bool = True) -> torch.Tensor:
    """q [n, H, D] at positions pos0.. over k / v [N, KVH, D], in fp32 -> [n, H, D]."""
    n, N = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = qf @ kf.transpose(1, 2) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.arange(N)[None] > pos0 + torch.arange(n)[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(0, 1)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want).abs()
    bound = want.abs().max() / 64 + want.abs() / 128
    assert (err <= bound).all(), f"max error {err.max().item():.4g}, worst excess {(err - bound).max().item():.4g}"


@needs_kernel
@pytest.mark.parametrize("prefix,n", [(0, 1), (0, 7), (0, 130), (37, 1), (37, 5), (100, 64), (700, 3), (1000, 257)])
def test_a_chunk_over_the_pool_and_its_own_tokens(prefix, n):
    gen = torch.Generator().manual_seed(prefix * 1000 + n)
    pool, table, kp, vp = pool_context(gen, prefix)
    q, k, v = qkv(gen, n)
    got = na.attend(q, k, v, (pool[0], pool[1]), table, prefix, BS)
    close(got, reference(q, torch.cat([kp, k]), torch.cat([vp, v]), prefix))


@needs_kernel
def test_non_causal_queries_see_every_key():
    gen = torch.Generator().manual_seed(7)
    pool, table, kp, vp = pool_context(gen, 90)
    q, k, v = qkv(gen, 20)
    got = na.attend(q, k, v, (pool[0], pool[1]), table, 90, BS, causal=False)
    close(got, reference(q, torch.cat([kp, k]), torch.cat([vp, v]), 90, causal=False))


@needs_kernel
def test_a_step_of_decodes_and_chunks_in_one_call():
    """The engine's call: sequences in flat order, each its own start, table and tokens."""
    gen = torch.Generator().manual_seed(3)
    slots = 8192
    pool = torch.randn(2, slots, KVH, D, generator=gen).bfloat16()
    perm = torch.randperm(slots // BS, generator=gen).tolist()
    specs = [(0, 33), (200, 1), (15, 1), (64, 40), (1, 1), (500, 1)]     # (start, tokens)
    seqs, row = [], 0
    for start, n in specs:
        nblk = -(-(start + n) // BS)
        blocks, perm = perm[:nblk], perm[nblk:]
        seqs.append((start, n, blocks + [perm.pop()]))    # a table may run past the context
        row += n
    q, k, v = qkv(gen, row)
    # the step's own K/V go into the pool first, as PagedAttention does
    slot = torch.tensor([b[p // BS] * BS + p % BS for s, n, b in seqs for p in range(s, s + n)])
    pool[0][slot] = k
    pool[1][slot] = v
    out = torch.full((row, H, D), float("nan"), dtype=torch.bfloat16)
    na.attend_step(na.StepPlan(seqs, BS), q, k, v, (pool[0], pool[1]), out)
    row = 0
    for s, n, blocks in seqs:
        idx = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(s + n)])
        close(out[row : row + n], reference(q[row : row + n], pool[0][idx], pool[1][idx], s))
        row += n


@needs_kernel
def test_shapes_it_does_not_take_are_refused_clearly():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, H, 32, generator=gen).bfloat16()             # head_dim 32
    k = torch.randn(4, KVH, 32, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="refused"):
        na.attend(q, k, k)
    q, k, v = qkv(gen, 4)
    with pytest.raises(ValueError, match="k_own: f32"):
        na.attend(q.float(), k, v)                                     # an fp32 query, bf16 keys
    with pytest.raises(ValueError, match="no kernel"):
        na.attend(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="refused"):
        na.attend(q, k[:2], v[:2])                                     # 4 queries, 2 keys


def test_auto_falls_back_to_sdpa_where_the_kernel_cannot_run(monkeypatch):
    kern = na.KERNELS[torch.bfloat16]
    monkeypatch.setattr(kern, "tried", True)
    monkeypatch.setattr(kern, "fn", None)
    monkeypatch.setattr(kern, "why", "the CPU lacks avx512_bf16")
    assert not na.use_kernel("auto", torch.bfloat16, D)
    with pytest.raises(RuntimeError, match="lacks avx512_bf16"):
        na.use_kernel("native", torch.bfloat16, D)
    assert not na.use_kernel("sdpa", torch.bfloat16, D)


@needs_kernel
def test_auto_leaves_an_engine_of_several_threads_to_sdpa():
    """The kernel runs on the calling thread; SDPA uses torch's threads."""
    assert na.use_kernel("auto", torch.bfloat16, D, num_threads=1)
    assert not na.use_kernel("auto", torch.bfloat16, D, num_threads=2)
    assert na.use_kernel("native", torch.bfloat16, D, num_threads=2)


def test_fp16_and_other_head_sizes_never_take_it():
    assert not na.use_kernel("auto", torch.float16, D)
    assert not na.use_kernel("native", torch.float16, D)     # no fp16 kernel: SDPA
    assert not na.use_kernel("auto", torch.bfloat16, 128)
    with pytest.raises(RuntimeError, match="head_dim 128"):
        na.use_kernel("native", torch.bfloat16, 128)


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="bf16_attention"):
        EngineConfig(bf16_attention="fast")
    with pytest.raises(ValueError, match="engine.attention"):
        EngineConfig(attention="fast")


def test_bf16_attention_is_the_older_name_of_attention():
    """Deployment files written before the fp32 kernel say `bf16_attention`: it sets
    `attention` (for every dtype with a kernel), and a copy with another `attention`
    (dataclasses.replace, as deployment specs make) takes the new value."""
    import dataclasses

    assert EngineConfig().attention == "auto"
    old = EngineConfig(bf16_attention="sdpa")
    assert (old.attention, old.bf16_attention) == ("sdpa", None)
    assert dataclasses.replace(old, attention="native").attention == "native"
    assert EngineConfig(attention="native", bf16_attention="native").attention == "native"
    assert EngineConfig(attention="native", bf16_attention="auto").attention == "native"
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig(attention="native", bf16_attention="sdpa")

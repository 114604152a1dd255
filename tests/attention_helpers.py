"""What the attention kernels' tests share (test_native_attention.py for bf16,
test_native_attention_f32.py, test_engine_bf16.py): random paged contexts in
the kernels' layout, a tiny model with the kernels' 64-wide heads, and a
bounded engine loop."""

from __future__ import annotations

import random

import torch

H, KVH, D, BS = 9, 3, 64, 16


def pool_context(gen: torch.Generator, prefix: int, dtype: torch.dtype, slots: int = 4096):
    """A pool [2, slots, KVH, D] in `dtype`, a shuffled block table covering
    `prefix` tokens, and those tokens' K / V read through it."""
    pool = torch.randn(2, slots, KVH, D, generator=gen).to(dtype)
    nblk = -(-prefix // BS)
    table = torch.randperm(slots // BS, generator=gen)[:nblk].long()
    idx = (table.repeat_interleave(BS) * BS + torch.arange(BS).repeat(nblk))[:prefix]
    return pool, table, pool[0][idx], pool[1][idx]


def qkv(gen: torch.Generator, n: int, dtype: torch.dtype, scale: float = 1.0):
    """q, k, v as the model makes them: views of one fused [n, H + 2 KVH, D] output."""
    out = (torch.randn(n, H + 2 * KVH, D, generator=gen) * scale).to(dtype)
    return out[:, :H], out[:, H : H + KVH], out[:, H + KVH :]


def tiny64(tmp_path_factory, smollm2_dir, dtype: torch.dtype):
    """A tiny random Llama whose heads are 64 wide (the kernels' head size; the tiny
    model's are 16): 4 query heads over 2 KV heads, 2 layers, SmolLM2's vocabulary."""
    from pdd.model.loader import load_model, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny64") / "m", seed=3, hidden_size=256, num_heads=4,
                           num_kv_heads=2, intermediate_size=256, tokenizer_from=smollm2_dir)
    return load_model(path, dtype)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def run(engine, reqs, max_steps: int = 500) -> None:
    """Submit `reqs` and step until the engine is idle, at most `max_steps` steps."""
    for r in reqs:
        engine.submit(r)
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine did not finish within the step bound")

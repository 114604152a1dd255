"""Greedy and seeded temperature / top-p sampling.

A seeded request draws each token from a generator seeded by (seed, position),
so the same request gives the same tokens on any instance: a relay decoder and
a main decoder that take turns produce what one engine alone would.
"""

from __future__ import annotations

import hashlib

import torch

from pdd.engine.request import SamplingParams


def _position_seed(seed: int, position: int) -> int:
    d = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: [N, V] fp32; positions: index of the token being sampled."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p       # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        gen = torch.Generator().manual_seed(
            _position_seed(p.seed, positions[i]) if p.seed is not None else torch.seed()
        )
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out

"""Greedy and seeded temperature / top-p sampling, numerically safe per row.

A seeded request draws each token from a generator seeded by (seed, position),
so the same request gives the same tokens on any instance: a relay decoder and
a main decoder that take turns produce what one engine alone would.

Every row is sampled on its own and can never fail: the distribution is built
in float64 log space, the top token always survives top-p, and a row whose
distribution still comes out degenerate (NaN, inf, all zero) is decoded
greedily. One request's extreme parameters thus never raise inside a batch.
"""

from __future__ import annotations

import hashlib
import math

import torch

from pdd.engine.request import SamplingParams


def _position_seed(seed: int, position: int) -> int:
    d = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: [N, V] fp32 or bf16 (each row upcast to float64 where sampled); positions: index
    of the token being sampled."""
    out = greedy(logits)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _distribution(logits[i], p)
        if probs is None:
            continue                      # degenerate row: keep the greedy token
        gen = torch.Generator().manual_seed(
            _position_seed(p.seed, positions[i]) if p.seed is not None else torch.seed()
        )
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


def greedy(logits: torch.Tensor) -> list[int]:
    """logits [N, V] -> the first maximal entry of each row (a NaN counts as maximal, as in torch.max).
    On the CPU this is numpy's argmax over fp32, which is vectorised: over a 49K vocab 3.5 us a row
    against 27 for torch.max (97 vs 380 us at 16 rows), the same indices (first maximum, first NaN).
    bf16 / fp16 rows are upcast first (exact, so the same indices): 275 vs 548 us at 16 rows."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return logits.float().numpy().argmax(-1).tolist()
    return logits.max(dim=-1).indices.tolist()


def _distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """row: [V] logits -> [V] float64 probabilities, or None if they are unusable."""
    if not math.isfinite(p.temperature) or p.temperature <= 0:
        return None
    logp = torch.log_softmax(row.double() / p.temperature, dim=-1)   # [V], max entry is 0
    probs = logp.exp()
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True       # the top token survives any top_p, however small
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0 or bool(torch.isnan(probs).any()):
        return None
    return probs

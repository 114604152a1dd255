"""Mooncake trace replay: JSONL of {timestamp ms, input_length, output_length,
hash_ids of 512-token blocks} -> an open-loop Workload of real token ids.

Token ids are synthesized per hash id: the ids of block `h` come from a
generator seeded by blake2b(seed, h), so equal hash ids give equal tokens and
two requests sharing their first k ids share k blocks of prompt, as in the
production service. The last block may be partial (input_length is not a
multiple of 512); a partial block is a prefix of the full block's tokens.

Scaling, to fit a small machine:
* `length_scale`: a 512-token block becomes round(512 x scale) tokens (and
  input_length is scaled the same way); pick it so that the scaled block is a
  multiple of the engine's block size, or shared prefixes lose a partial block.
* `output_scale` (default: `length_scale`) scales output_length.
* `max_input_tokens` truncates a prompt (keeping its prefix, so sharing stays),
  `max_output_tokens` caps max_tokens; every request keeps >= 1 of each.
* `time_scale` stretches time: arrival_s = (timestamp - first) / 1000 x time_scale.
* `start_index` skips requests, `num_requests` keeps that many.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pdd.measure.workload import RequestKind, Workload, WorkloadRequest, token_id_range

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceConfig:
    path: str
    time_scale: float = 1.0
    length_scale: float = 1.0
    output_scale: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    num_requests: int | None = None
    start_index: int = 0
    vocab_size: int = 49152
    seed: int = 0

    def __post_init__(self) -> None:
        if self.time_scale < 0 or self.length_scale <= 0:
            raise ValueError("time_scale >= 0 and length_scale > 0 required")
        if self.output_scale is not None and self.output_scale <= 0:
            raise ValueError("output_scale must be > 0")
        for name in ("max_input_tokens", "max_output_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.start_index < 0 or (self.num_requests is not None and self.num_requests < 0):
            raise ValueError("start_index and num_requests must be >= 0")
        token_id_range(self.vocab_size)

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


@lru_cache(maxsize=4096)
def _block(hash_id: int, n: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    digest = hashlib.blake2b(f"{seed}:{hash_id}".encode(), digest_size=16).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    lo, hi = token_id_range(vocab_size)
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def block_token_ids(hash_id: int, num_tokens: int, block_tokens: int, vocab_size: int,
                    seed: int = 0) -> list[int]:
    """The first `num_tokens` (<= block_tokens) ids of block `hash_id`."""
    return list(_block(hash_id, block_tokens, vocab_size, seed)[:num_tokens])


def synthesize_prompt(hash_ids: list[int], input_length: int, cfg: TraceConfig) -> list[int]:
    """Prompt ids for one trace row, scaled and capped by `cfg`."""
    b = cfg.block_tokens
    length = min(round(input_length * cfg.length_scale), len(hash_ids) * b)
    if cfg.max_input_tokens is not None:
        length = min(length, cfg.max_input_tokens)
    length = max(1, length)
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= length:
            break
        out.extend(block_token_ids(h, min(b, length - len(out)), b, cfg.vocab_size, cfg.seed))
    if not out:  # a row without hash ids: one private block, seeded by its position
        out = block_token_ids(-1 - input_length, 1, b, cfg.vocab_size, cfg.seed)
    return out


def read_rows(path: str | Path, start_index: int = 0, num_requests: int | None = None) -> list[dict]:
    rows: list[dict] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start_index or not line.strip():
                continue
            if num_requests is not None and len(rows) >= num_requests:
                break
            rows.append(json.loads(line))
    return rows


def load(cfg: TraceConfig, block_size: int = 16) -> Workload:
    rows = read_rows(cfg.path, cfg.start_index, cfg.num_requests)
    out_scale = cfg.length_scale if cfg.output_scale is None else cfg.output_scale
    t0 = rows[0]["timestamp"] if rows else 0
    requests = []
    for i, row in enumerate(rows):
        max_tokens = max(1, round(row["output_length"] * out_scale))
        if cfg.max_output_tokens is not None:
            max_tokens = min(max_tokens, cfg.max_output_tokens)
        requests.append(WorkloadRequest(
            request_id=f"r{cfg.start_index + i:05d}",
            arrival_s=(row["timestamp"] - t0) / 1000.0 * cfg.time_scale,
            prompt_token_ids=synthesize_prompt(row.get("hash_ids", []), row["input_length"], cfg),
            max_tokens=max_tokens,
            kind=RequestKind.TRACE,
        ))
    settings = {"kind": "trace", "path": str(cfg.path), "time_scale": cfg.time_scale,
                "length_scale": cfg.length_scale, "output_scale": out_scale,
                "scaled_block_tokens": cfg.block_tokens,
                "max_input_tokens": cfg.max_input_tokens, "max_output_tokens": cfg.max_output_tokens,
                "start_index": cfg.start_index, "vocab_size": cfg.vocab_size, "seed": cfg.seed}
    return Workload(name="trace", requests=requests, settings=settings, block_size=block_size)

"""Workload requests, arrival processes and the theoretical prefix-hit histogram.

A workload is a list of `WorkloadRequest` in submission order. An open-loop
request is sent at its `arrival_s`. A closed-loop request (`depends_on` set)
is sent `think_time_s` after the request it depends on has finished; its
`arrival_s` is then only a nominal time that orders the workload (and the
theoretical hit-rate computation), not a send time.

The hit-rate histogram uses the report's bins (0-90, 90-95, 95-97, 97-98,
98-99, 99-100 %) and an unbounded prefix cache at block granularity: the
best any server-side prefix cache could do on this workload.
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from dataclasses import dataclass, field

# Ids below this are left alone: special tokens (BOS/EOS/padding) live there.
MIN_TOKEN_ID = 100

# (label, low, high): low <= rate < high; the last bin also holds 1.0.
HIT_RATE_BINS: tuple[tuple[str, float, float], ...] = (
    ("0-90%", 0.00, 0.90),
    ("90-95%", 0.90, 0.95),
    ("95-97%", 0.95, 0.97),
    ("97-98%", 0.97, 0.98),
    ("98-99%", 0.98, 0.99),
    ("99-100%", 0.99, 1.00),
)


class RequestKind(enum.Enum):
    TURN = "turn"          # one turn of a multi-turn agentic session
    ABNORMAL = "abnormal"  # very long input, very short output
    TRACE = "trace"        # replayed from a trace file


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    session_id: str | None = None
    turn: int = 0
    depends_on: str | None = None    # request_id of the previous turn (closed loop)
    think_time_s: float = 0.0        # delay after `depends_on` finished (closed loop)
    kind: RequestKind = RequestKind.TURN
    # Closed loop: the prompt repeats `depends_on`'s prompt, then its answer
    # from this position on (`depends_on`'s max_tokens long). The workload
    # holds stand-in ids there; the bench client sends the ids the model
    # produced (`prompt_to_send`), as an agent's next turn quotes its answer.
    answer_at: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prompt_to_send(req: WorkloadRequest, parent: WorkloadRequest | None, parent_sent: list[int] | None,
                   produced: list[int] | None) -> list[int]:
    """The prompt of `req` as an agent sends it: its parent's prompt as it
    was sent, the answer the model produced, then the rest of `req`'s own
    prompt. The stand-in answer stays where the parent's answer is unknown
    (it failed, or stopped short of its max_tokens), so the shape holds."""
    if req.answer_at is None or parent is None or parent_sent is None:
        return list(req.prompt_token_ids)
    if req.answer_at != parent.prompt_tokens or len(parent_sent) != parent.prompt_tokens:
        raise ValueError(f"{req.request_id}: answer_at {req.answer_at} is not where {parent.request_id}'s "
                         f"prompt ({parent.prompt_tokens} tokens) ends")
    end = req.answer_at + parent.max_tokens
    answer = produced if answer_complete(parent, produced) else req.prompt_token_ids[req.answer_at:end]
    return list(parent_sent) + list(answer) + list(req.prompt_token_ids[end:])


def answer_complete(parent: WorkloadRequest, produced: list[int] | None) -> bool:
    """The parent's answer is known in full (its next turn quotes it)."""
    return produced is not None and len(produced) == parent.max_tokens


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    settings: dict = field(default_factory=dict)   # how it was generated (JSON-able)
    block_size: int = 16                             # for the theoretical hit rates

    def hit_rates(self) -> list[float]:
        """Theoretical hit rate of each request, in `requests` order."""
        return theoretical_hit_rates(self.requests, self.block_size)

    def describe(self) -> dict:
        """The `workload` entry of summary.json."""
        rates = self.hit_rates()
        inputs = [r.prompt_tokens for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        total_in = sum(inputs)
        hit_tokens = sum(h * n for h, n in zip(rates, inputs))
        return {
            "name": self.name,
            "settings": self.settings,
            "num_requests": len(self.requests),
            "num_sessions": len({r.session_id for r in self.requests if r.session_id}),
            "num_abnormal": sum(r.kind is RequestKind.ABNORMAL for r in self.requests),
            "closed_loop": any(r.depends_on for r in self.requests),
            "block_size": self.block_size,
            "input_tokens": _int_stats(inputs),
            "output_tokens": _int_stats(outputs),
            "theoretical_hit_rate": hit_tokens / total_in if total_in else 0.0,
            "hit_rate_histogram": hit_rate_histogram(rates),
        }


def _int_stats(xs: list[int]) -> dict:
    if not xs:
        return {"min": 0, "p50": 0, "max": 0, "mean": 0.0}
    return {"min": min(xs), "p50": statistics.median(xs), "max": max(xs),
            "mean": statistics.fmean(xs)}


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) range of synthetic token ids for a model vocabulary."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size too small: {vocab_size}")
    return min(MIN_TOKEN_ID, vocab_size // 2), vocab_size


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = token_id_range(vocab_size)
    return [rng.randrange(lo, hi) for _ in range(n)]


def poisson_arrivals(num: int, rate_per_s: float, seed: int, start_s: float = 0.0) -> list[float]:
    """`num` arrival times of a Poisson process (seeded); rate <= 0 -> all at start."""
    if rate_per_s <= 0 or math.isinf(rate_per_s):
        return [start_s] * num
    rng = random.Random(f"poisson:{seed}")
    t, out = start_s, []
    for _ in range(num):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def with_poisson_arrivals(workload: Workload, rate_per_s: float, seed: int) -> Workload:
    """Re-time an open-loop workload as a Poisson process, keeping its order."""
    times = poisson_arrivals(len(workload.requests), rate_per_s, seed)
    for req, t in zip(workload.requests, times):
        req.arrival_s = t
    workload.settings = {**workload.settings, "arrival": "poisson", "arrival_rate_per_s": rate_per_s}
    return workload


def warmup_requests(workload: Workload, n: int) -> list[WorkloadRequest]:
    """`n` short requests of fresh random ids (within the workload's id range, so
    valid for its vocabulary) that share no prefix with the workload: what
    `pdd bench --warmup` sends before each mode's run, and what the
    simulator's replay routes before the run as that router did."""
    ids = [t for r in workload.requests for t in (min(r.prompt_token_ids), max(r.prompt_token_ids))]
    if not ids or n <= 0:
        return []
    lo, hi = min(ids), max(ids)
    rng = random.Random("warmup")
    return [WorkloadRequest(f"warmup-{i}", 0.0, [rng.randint(lo, hi) for _ in range(32)], 4)
            for i in range(n)]


def theoretical_hit_rates(requests: list[WorkloadRequest], block_size: int) -> list[float]:
    """Prefix hit rate of each request against an unbounded block prefix cache.

    Requests are served in (arrival_s, list position) order. A block hits when
    it and every block before it were in an earlier prompt. Like a real
    engine, the last prompt token is always computed, so at most
    (n - 1) // block_size blocks can hit. Only prompts enter the cache.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    children: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, block) -> node
    rates = [0.0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    for i in order:
        ids = requests[i].prompt_token_ids
        n = len(ids)
        lookup_blocks = (n - 1) // block_size if n else 0
        node, hit_blocks, matching = 0, 0, True
        for b in range(n // block_size):
            key = (node, tuple(ids[b * block_size:(b + 1) * block_size]))
            nxt = children.get(key)
            if nxt is None:
                matching = False
                nxt = children[key] = len(children) + 1
            elif matching and b < lookup_blocks:
                hit_blocks += 1
            node = nxt
        rates[i] = hit_blocks * block_size / n if n else 0.0
    return rates


def hit_rate_bin(rate: float) -> str:
    for label, lo, hi in HIT_RATE_BINS:
        if lo <= rate < hi:
            return label
    return HIT_RATE_BINS[-1][0] if rate >= 1.0 else HIT_RATE_BINS[0][0]


def hit_rate_histogram(rates: list[float]) -> dict[str, float]:
    """Fraction of requests in each of the report's hit-rate bins."""
    counts = {label: 0 for label, _, _ in HIT_RATE_BINS}
    for r in rates:
        counts[hit_rate_bin(r)] += 1
    total = len(rates)
    return {k: (v / total if total else 0.0) for k, v in counts.items()}


def fraction_above(rates: list[float], threshold: float) -> float:
    return sum(r >= threshold for r in rates) / len(rates) if rates else 0.0


def validate_token_ids(requests: list[WorkloadRequest], vocab_size: int) -> None:
    lo, hi = token_id_range(vocab_size)
    for r in requests:
        if r.max_tokens < 1:
            raise ValueError(f"{r.request_id}: max_tokens must be >= 1")
        if not r.prompt_token_ids:
            raise ValueError(f"{r.request_id}: empty prompt")
        if min(r.prompt_token_ids) < lo or max(r.prompt_token_ids) >= hi:
            raise ValueError(f"{r.request_id}: token id outside [{lo}, {hi})")

"""Facts the data plane reports, as the policy sees them.

Every policy function takes a snapshot built from these frozen dataclasses;
none of them reads a clock or a socket. The router builds them from the
instances' stats endpoints, the simulator from its own state, so both feed
the very same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class Role(Enum):
    PREFILL = "prefill"        # P: computes prompt KV, emits the first token
    DECODE = "decode"          # D of a plain (in-DC or naive cross-DC) PD pair
    COLOCATED = "colocated"    # prefill and decode on one instance (baseline)
    RELAY = "relay"            # RLD: beside P, decodes eagerly while MD's KV is in flight
    MAIN = "main"              # MD: remote datacenter, decodes the bulk of the tokens


@dataclass(frozen=True)
class InstanceView:
    instance_id: str
    role: Role
    datacenter: str
    num_running: int
    num_waiting: int
    max_batch: int
    kv_free_blocks: int
    kv_total_blocks: int
    # Recent mean wall time of one decode step (a measured fact); None when the
    # instance has not decoded yet and the policy should use its prior.
    step_time_s: float | None = None
    # Recent prompt tokens per second of its prefill steps (P): how long a
    # prompt computes, i.e. how much of its transfer streams behind it.
    prefill_tokens_s: float | None = None
    # The same steps as a fixed cost per step and a cost per prompt token
    # (`fit_prefill_cost`); None without steps of different sizes. A step's
    # fixed cost (the weights streamed once, the context's attention) makes a
    # warm turn's 50-token step ~3x slower per token than a cold prompt's
    # 512-token chunks, so the mean rate alone mispredicts a cold prompt.
    prefill_step_s: float | None = None
    prefill_token_s: float | None = None
    # ... and a cost per token per token of context it attends to (seconds;
    # 0: not fitted): a chunk at the end of a long prompt costs more than the
    # same chunk at its start (`prefill_attention`).
    prefill_attn_s: float = 0.0
    # The largest of those steps, in prompt tokens (0: none or not known): how
    # far the fit may be stretched (`prefill_compute_s`).
    prefill_largest_step: int = 0
    # Prompt tokens one engine step computes at most (its chunk); 0: unknown.
    chunk_tokens: int = 0
    # Slices a chunk's KV streams in while the chunk computes (P sends each
    # layer's KV as the step passes it: the model's layer count); 1: a chunk's
    # blocks exist only once its step is over.
    kv_layer_slices: int = 1

    def __post_init__(self) -> None:
        if min(self.num_running, self.num_waiting, self.kv_free_blocks) < 0:
            raise ValueError(f"{self.instance_id}: negative load or free blocks")
        if self.max_batch <= 0:
            raise ValueError(f"{self.instance_id}: max_batch must be positive")
        if not 0 <= self.kv_free_blocks <= self.kv_total_blocks:
            raise ValueError(f"{self.instance_id}: kv_free_blocks outside [0, total]")

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    def prefill_compute_s(self, new_tokens: int, start_tokens: int = 0) -> float | None:
        """How long this P computes a prompt's `new_tokens` past the
        `start_tokens` it has cached (`prefill_compute_s`)."""
        return prefill_compute_s(new_tokens, self.chunk_tokens, self.prefill_step_s, self.prefill_token_s,
                                 self.prefill_tokens_s, self.prefill_largest_step, self.prefill_attn_s,
                                 start_tokens)

    @property
    def load_fraction(self) -> float:
        """Requests held per batch slot; above 1.0 the instance queues."""
        return self.num_requests / self.max_batch

    @property
    def kv_used_fraction(self) -> float:
        if self.kv_total_blocks == 0:
            return 1.0
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks


# A P's measured steps speak for steps up to this many times the largest of
# them. Its step costs are fitted on recent steps; right after start-up those
# are a warm-up's few tokens (32 and 59 in `heldout-agentic-26s1`), whose
# per-step cost, stretched to a cold prompt's 512-token chunks, made 1,179
# tokens take 3.7 s (they took 0.8): the copy was judged hidden behind the
# prefill, sent direct, and its user waited 4.0 s for the line.
PREFILL_FIT_REACH = 4

# A P's step costs are fitted on its last this many prefill steps (engine and
# simulator alike). Sixteen were too few to tell the attention term from the
# per-token one: a run of warm turns over similar long contexts makes the two
# collinear (`results/wan-bound-62x`, a0003: 5.0 s predicted over 16 steps,
# 2.7 over 64, 2.6 measured).
PREFILL_FIT_STEPS = 64


def prefill_attention(start_tokens: int, new_tokens: int) -> float:
    """The attention work of computing prompt tokens start..start+new: each
    token attends to the context before it and itself, so the sum over those
    tokens of their positions, (end^2 - start^2) / 2 (in token x context
    units). A step's is the sum over its chunks; a prompt's whole is its
    chunks' sum, whatever the chunking."""
    end = start_tokens + max(new_tokens, 0)
    return (end * end - start_tokens * start_tokens) / 2.0


def prefill_compute_s(new_tokens: int, chunk_tokens: int, step_s: float | None, token_s: float | None,
                      tokens_s: float | None, largest_step: int = 0, attn_s: float = 0.0,
                      start_tokens: int = 0) -> float | None:
    """How long a P computes `new_tokens` prompt tokens past `start_tokens`
    it has cached, in chunks of `chunk_tokens`: from its fitted step, token
    and attention costs (`fit_prefill_cost`) where it has some, else its
    mean rate `tokens_s`; None when it has measured neither, or when its
    steps (the largest: `largest_step` prompt tokens, 0 where not known)
    were all far smaller than this prompt's steps will be
    (`PREFILL_FIT_REACH`): then nothing is assumed hidden."""
    if new_tokens <= 0:
        return 0.0
    if largest_step > 0 and chunk_tokens > 0 and PREFILL_FIT_REACH * largest_step < min(chunk_tokens, new_tokens):
        return None
    if token_s is not None and (token_s > 0 or attn_s > 0) and chunk_tokens > 0:
        return (-(-new_tokens // chunk_tokens) * max(step_s or 0.0, 0.0) + new_tokens * token_s
                + max(attn_s, 0.0) * prefill_attention(start_tokens, new_tokens))
    if tokens_s and tokens_s > 0:
        return new_tokens / tokens_s
    return None


def fit_prefill_cost(steps: list[tuple]) -> tuple[float, float, float] | None:
    """(seconds per step, per prompt token, per unit of attention) fitted to
    recent prefill steps, the engine's and the simulator's alike: (prompt
    tokens, seconds) or (prompt tokens, seconds, attention), the attention
    being `prefill_attention` summed over the step's chunks. Least squares
    with every cost >= 0 (the best fit over the subsets of the three terms
    whose unconstrained solution is non-negative), so noise cannot make a
    term negative and a longer prompt cheaper. None without two step sizes
    or when bigger steps were not slower (no positive per-token or attention
    cost in the unconstrained fit).

    The attention term is what a fit over tokens alone misses: where recent
    steps were warm turns' few tokens over long contexts (~3 ms a token
    here, most of it attention), such a fit priced a cold prompt's chunks
    at the start of its context at 2x what they took (results/wan-bound-62x,
    a0003: 5.3 s predicted for 1,740 tokens that took 2.6), judged its WAN
    copy hidden behind the prefill and sent it direct; its user waited
    6.6 s for the line."""
    pts = [(float(t[0]), float(t[1]), float(t[2]) if len(t) > 2 and t[2] is not None else None)
           for t in steps if t[0] > 0 and t[1] > 0]
    if len({n for n, _, _ in pts}) < 2:
        return None
    with_attn = all(a is not None for _, _, a in pts)
    rows = [((1.0, n, a if with_attn else 0.0), w) for n, w, a in pts]
    ys = [w for _, w in rows]
    terms = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (1,), (2,)) if with_attn else ((0, 1), (1,))
    fits = {cols: _least_squares([[x[c] for c in cols] for x, _ in rows], ys) for cols in terms}
    whole = fits[terms[0]]
    if whole is not None and all(c <= 0 for c in whole[1:]):
        return None                       # bigger steps were not slower: nothing to fit
    best: tuple[float, tuple[float, float, float]] | None = None
    for cols, coef in fits.items():
        if coef is None or any(c < 0 or not math.isfinite(c) for c in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for c, v in zip(cols, coef):
            full[c] = v
        if full[1] <= 0 and full[2] <= 0:
            continue
        sse = sum((w - sum(f * xi for f, xi in zip(full, x))) ** 2 for x, w in rows)
        if best is None or sse < best[0] - 1e-15:
            best = (sse, (full[0], full[1], full[2]))
    return None if best is None else best[1]


def prefill_rate(steps: list[tuple]) -> float | None:
    """Prompt tokens per second over (prompt tokens, wall s, ...) steps:
    their tokens over their time, token-weighted (a mean of per-step rates
    would weigh a prompt's short tail chunk, mostly fixed cost, as much as a
    full one). What an engine's stats report as `prefill_tokens_s`, the
    engine's and the simulator's P alike."""
    wall = sum(s[1] for s in steps)
    return sum(s[0] for s in steps) / wall if wall > 0 else None


def _least_squares(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Ordinary least squares by the normal equations (at most 3 columns),
    the columns scaled to unit size first; None when singular."""
    k = len(x[0])
    scale = [max(abs(r[j]) for r in x) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in x]
    a = [[sum(r[i] * r[j] for r in xs) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * yi for r, yi in zip(xs, y)) for i in range(k)]
    # Gaussian elimination with partial pivoting
    for i in range(k):
        piv = max(range(i, k), key=lambda r: abs(a[r][i]))
        if abs(a[piv][i]) < 1e-12:
            return None
        a[i], a[piv], b[i], b[piv] = a[piv], a[i], b[piv], b[i]
        for r in range(i + 1, k):
            f = a[r][i] / a[i][i]
            for c in range(i, k):
                a[r][c] -= f * a[i][c]
            b[r] -= f * b[i]
    sol = [0.0] * k
    for i in reversed(range(k)):
        sol[i] = (b[i] - sum(a[i][c] * sol[c] for c in range(i + 1, k))) / a[i][i]
    return [v / s for v, s in zip(sol, scale)]


@dataclass(frozen=True)
class LinkEstimate:
    """What a link is believed to deliver to one new transfer right now."""

    throughput_bytes_s: float
    rtt_s: float
    up: bool = True
    # Fixed cost of one transfer beyond the round trip: the receiver putting
    # the blocks into its pool between its engine steps, connection work.
    overhead_s: float = 0.0
    # Bytes already on their way over the line from P, that a new transfer
    # waits behind: foreground ones (a direct request's KV) and background
    # copies (which yield to foreground transfers, shortest first).
    queued_bytes: float = 0.0
    queued_background_bytes: float = 0.0
    # Foreground transfers those queued bytes belong to (0: unknown, then the
    # bytes count as all ahead): they share the line with a new one.
    queued_flows: int = 0
    # Background copies the background bytes belong to (0: unknown, all ahead).
    queued_background_flows: int = 0

    def __post_init__(self) -> None:
        if min(self.throughput_bytes_s, self.rtt_s, self.overhead_s, self.queued_bytes,
               self.queued_background_bytes, self.queued_flows, self.queued_background_flows) < 0:
            raise ValueError("link estimate must be non-negative")

    @property
    def usable(self) -> bool:
        return self.up and self.throughput_bytes_s > 0

    def bytes_s(self, num_bytes: int) -> float:
        """A transfer's own size in line time: its bytes alone at the line's rate
        (no round trip, no fixed cost, nothing ahead)."""
        if not self.usable:
            return math.inf
        return num_bytes / self.throughput_bytes_s

    def transfer_s(self, num_bytes: int, background: bool = False) -> float:
        """One handshake round trip, the fixed overhead, the bytes at the
        estimated rate behind what is queued ahead: the foreground bytes, and
        for a background copy the other copies too. A foreground transfer
        shares the line with the foreground ones in flight: while its bytes
        cross, each of `queued_flows` others sends about as much (less if it
        ends first), not all it has left (a cold prompt's copy streams for as
        long as P computes it). Background copies go one at a time, fewest
        bytes left first: one with more left than this copy waits for it, so
        each of `queued_background_flows` puts at most this copy's bytes ahead."""
        if not self.usable:
            return math.inf
        fg = self.queued_bytes
        if self.queued_flows > 0 and not background:
            fg = min(fg, self.queued_flows * float(num_bytes))
        bg = self.queued_background_bytes if background else 0.0
        if background and self.queued_background_flows > 0:
            bg = min(bg, self.queued_background_flows * float(num_bytes))
        ahead = fg + bg
        return self.rtt_s + self.overhead_s + (ahead + num_bytes) / self.throughput_bytes_s


@dataclass(frozen=True)
class RequestFacts:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    kv_bytes_per_token: int
    block_size: int

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0 or self.max_tokens <= 0:
            raise ValueError(f"{self.request_id}: prompt and max_tokens must be positive")
        if self.kv_bytes_per_token <= 0 or self.block_size <= 0:
            raise ValueError(f"{self.request_id}: kv_bytes_per_token and block_size must be positive")

    @property
    def num_prompt_blocks(self) -> int:
        return -(-self.num_prompt_tokens // self.block_size)

    def missing_kv_bytes(self, num_matched_tokens: int) -> int:
        """KV bytes a holder of `num_matched_tokens` cached prefix tokens lacks.

        Counted in whole blocks, as they travel: only full blocks are cached
        and sent; the receiver computes the prompt's partial last block itself.
        """
        matched_blocks = min(max(num_matched_tokens, 0), self.num_prompt_tokens) // self.block_size
        missing_blocks = max(self.num_prompt_tokens // self.block_size - matched_blocks, 0)
        return missing_blocks * self.block_size * self.kv_bytes_per_token


@dataclass(frozen=True)
class ClusterView:
    instances: tuple[InstanceView, ...]
    # instance_id -> longest cached prefix of *this request* the instance holds, in tokens
    matched_tokens: Mapping[str, int]
    wan: LinkEstimate
    now: float
    # P -> RLD inside the datacenter; None: not measured (no relay-gain rule).
    local: LinkEstimate | None = None
    _by_id: dict[str, InstanceView] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_id = {inst.instance_id: inst for inst in self.instances}
        if len(by_id) != len(self.instances):
            raise ValueError("duplicate instance_id in ClusterView")
        object.__setattr__(self, "_by_id", by_id)

    def with_role(self, *roles: Role) -> tuple[InstanceView, ...]:
        return tuple(i for i in self.instances if i.role in roles)

    def instance(self, instance_id: str) -> InstanceView:
        return self._by_id[instance_id]

    def matched(self, instance_id: str) -> int:
        return self.matched_tokens.get(instance_id, 0)

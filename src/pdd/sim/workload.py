"""Request streams: a synthetic agentic workload and the Mooncake trace.

Agentic (closed loop per session): sessions arrive as a Poisson process;
each turn's prompt is the whole session context (a shared system prompt, the
session's history, the previous output and a tool result), so consecutive
turns share a long prefix and most requests hit > 95%. The low-hit tail
comes from first turns and from context compactions (the history replaced by
a fresh summary when it outgrows `context_limit_tokens`). A small share of
single-turn sessions carries a very long fresh input and a very short output:
the abnormal traffic the filter exists for. The next turn arrives a think
time after the previous one ends, so a slow system sees fewer requests, as
agents do.

Block ids are chained per session and epoch (a compaction starts a new
epoch); the system prompt's full blocks carry global ids shared by everyone.
Each session draws from its own seeded generator, so the stream does not
depend on the order in which the simulator asks for turns.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pdd.sim.request import RequestSpec


@dataclass(frozen=True)
class AgenticWorkload:
    duration_s: float = 600.0
    session_rate_per_s: float = 0.1
    system_prompt_tokens: int = 4096
    initial_context_tokens: int = 32768
    context_limit_tokens: int = 65536
    compacted_tokens: int = 8192
    append_tokens_mean: int = 1536
    output_tokens_mean: int = 1024
    turns_mean: float = 12.0
    think_time_s_mean: float = 3.0
    abnormal_fraction: float = 0.035          # of requests
    abnormal_input_tokens: int = 65536
    abnormal_output_max: int = 16
    max_tokens_slack: float = 1.0             # max_tokens = ceil(output * slack)
    block_size: int = 512
    seed: int = 1

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.session_rate_per_s <= 0 or self.block_size <= 0:
            raise ValueError("duration_s, session_rate_per_s and block_size must be > 0")
        if not 0 <= self.abnormal_fraction < 1 or self.turns_mean < 1:
            raise ValueError("abnormal_fraction in [0, 1) and turns_mean >= 1 required")
        if self.max_tokens_slack < 1:
            raise ValueError("max_tokens_slack must be >= 1")


class _Session:
    __slots__ = ("sid", "rng", "context", "epoch", "turns_left", "abnormal")


class AgenticStream:
    def __init__(self, w: AgenticWorkload) -> None:
        self.w = w
        self.block_size = w.block_size
        self._sessions: dict[int, _Session] = {}
        f, t = w.abnormal_fraction, w.turns_mean
        self._p_abnormal_session = f * t / (1 - f + f * t)

    def initial(self) -> list[RequestSpec]:
        w = self.w
        rng = random.Random(w.seed)
        out, t, sid = [], 0.0, 0
        while True:
            t += rng.expovariate(w.session_rate_per_s)
            if t >= w.duration_s:
                return out
            s = _Session()
            s.sid, s.rng, s.epoch = sid, random.Random(w.seed * 1_000_003 + sid), 0
            s.abnormal = s.rng.random() < self._p_abnormal_session
            if s.abnormal:
                s.turns_left = 1
                s.context = w.system_prompt_tokens + _around(s.rng, w.abnormal_input_tokens)
            else:
                s.turns_left = 1 + _geometric(s.rng, w.turns_mean - 1)
                s.context = w.system_prompt_tokens + _around(s.rng, w.initial_context_tokens)
            self._sessions[sid] = s
            out.append(self._turn(s, t, 0))
            sid += 1

    def next_after(self, spec: RequestSpec, done_s: float, failed: bool) -> RequestSpec | None:
        s = self._sessions.get(spec.session)
        if s is None:
            return None
        s.turns_left -= 1
        arrival = done_s + s.rng.expovariate(1.0 / self.w.think_time_s_mean)
        if failed or s.turns_left <= 0 or arrival >= self.w.duration_s:
            del self._sessions[spec.session]
            return None
        w = self.w
        s.context = spec.prompt_tokens + spec.output_tokens + _around(s.rng, w.append_tokens_mean)
        if s.context > w.context_limit_tokens:
            s.epoch += 1
            s.context = w.system_prompt_tokens + w.compacted_tokens
        return self._turn(s, arrival, spec.turn + 1)

    def _turn(self, s: _Session, arrival: float, turn: int) -> RequestSpec:
        w = self.w
        if s.abnormal:
            out = s.rng.randint(1, w.abnormal_output_max)
        else:
            out = max(1, min(4 * w.output_tokens_mean,
                             round(s.rng.gammavariate(4.0, w.output_tokens_mean / 4.0))))
        bs = w.block_size
        shared = w.system_prompt_tokens // bs
        base = ((s.sid + 1) << 28) | (s.epoch << 20)

        def ids(n_tokens: int) -> tuple[int, ...]:
            n = n_tokens // bs
            return tuple(i if i < shared else base | i for i in range(n))

        return RequestSpec(
            request_id=f"s{s.sid}-t{turn}", arrival_s=arrival, prompt_tokens=s.context,
            output_tokens=out, max_tokens=math.ceil(out * w.max_tokens_slack),
            block_ids=ids(s.context), session=s.sid, turn=turn,
            full_block_ids=ids(s.context + out))


@dataclass(frozen=True)
class TraceWorkload:
    """Open-loop replay of a Mooncake-format JSONL trace (timestamps in ms)."""

    path: str
    block_size: int = 512
    time_scale: float = 1.0        # < 1 compresses time (a higher rate)
    duration_s: float = math.inf
    max_requests: int | None = None
    max_tokens_slack: float = 1.0


class TraceStream:
    def __init__(self, w: TraceWorkload) -> None:
        self.w = w
        self.block_size = w.block_size

    def initial(self) -> list[RequestSpec]:
        w, out = self.w, []
        with Path(w.path).open() as f:
            for i, line in enumerate(f):
                if w.max_requests is not None and i >= w.max_requests:
                    break
                d = json.loads(line)
                t = d["timestamp"] / 1000.0 * w.time_scale
                if t >= w.duration_s:
                    break
                n_in, n_out = int(d["input_length"]), max(1, int(d["output_length"]))
                ids = tuple(d["hash_ids"][: n_in // w.block_size])
                out.append(RequestSpec(f"r{i}", t, n_in, n_out,
                                       math.ceil(n_out * w.max_tokens_slack), ids,
                                       full_block_ids=ids))
        return out

    def next_after(self, spec: RequestSpec, done_s: float, failed: bool) -> RequestSpec | None:
        return None

    @property
    def duration_s(self) -> float:
        return self.w.duration_s


@dataclass(frozen=True)
class FixedHitWorkload:
    """Closed-loop users whose later turns hit a fixed share of their prompt.

    For sweeps over the prefix-hit rate (the bathtub, WAN need vs hit rate).
    `num_users` users each run sessions of `turns` turns back to back (think
    time between turns). Every prompt has `prompt_tokens` tokens: the
    session's context (`hit_rate` of the prompt, the same blocks every turn)
    then fresh blocks. A session's first turn finds its context cold, so the
    average hit rate is about hit_rate x (turns - 1) / turns, less whatever
    the caches evict. Fixed lengths keep every request's uncached tail the
    same size, so tail-chunk effects show undiluted.
    """

    duration_s: float = 600.0
    num_users: int = 64
    prompt_tokens: int = 32768
    output_tokens: int = 256
    hit_rate: float = 0.5
    turns: int = 8
    think_time_s: float = 1.0
    block_size: int = 512
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate < 1.0 or self.turns < 1 or self.num_users < 1:
            raise ValueError("hit_rate in [0, 1), turns >= 1, num_users >= 1 required")
        if self.prompt_tokens < self.block_size or self.output_tokens < 1:
            raise ValueError("prompt_tokens >= block_size and output_tokens >= 1 required")


class FixedHitStream:
    def __init__(self, w: FixedHitWorkload) -> None:
        self.w = w
        self.block_size = w.block_size
        self._next_session = 0
        self._rng = random.Random(w.seed)

    def initial(self) -> list[RequestSpec]:
        # Users start spread over one think time, so they do not arrive in lockstep.
        return [self._turn(self._new_session(), 0, self._rng.uniform(0, max(self.w.think_time_s, 1.0)))
                for _ in range(self.w.num_users)]

    def _new_session(self) -> int:
        self._next_session += 1
        return self._next_session

    def next_after(self, spec: RequestSpec, done_s: float, failed: bool) -> RequestSpec | None:
        arrival = done_s + self._rng.expovariate(1.0 / self.w.think_time_s) if self.w.think_time_s else done_s
        if arrival >= self.w.duration_s:
            return None
        if spec.turn + 1 >= self.w.turns:
            return self._turn(self._new_session(), 0, arrival)
        return self._turn(spec.session, spec.turn + 1, arrival)

    def _turn(self, session: int, turn: int, arrival: float) -> RequestSpec:
        w, bs = self.w, self.w.block_size
        n_blocks = w.prompt_tokens // bs
        n_ctx = round(w.hit_rate * w.prompt_tokens) // bs
        base = (session << 24) | (turn << 16)
        ids = tuple((session << 24) | i for i in range(n_ctx)) + tuple(
            base | (1 << 15) | i for i in range(n_blocks - n_ctx))
        out = tuple(base | (1 << 14) | i for i in range((w.prompt_tokens + w.output_tokens) // bs - n_blocks))
        return RequestSpec(f"u{session}-t{turn}", arrival, w.prompt_tokens, w.output_tokens,
                           w.output_tokens, ids, session=session, turn=turn,
                           full_block_ids=ids + out)


def _around(rng: random.Random, mean: int) -> int:
    """A draw within +-50% of mean, uniform."""
    return max(1, round(rng.uniform(0.5, 1.5) * mean))


def _geometric(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))

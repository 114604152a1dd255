"""An instance's prompt steps as the engine's stats and the router read them
(the simulator's P and colocated instances, `pdd.sim.instance`)."""

from __future__ import annotations

from collections import deque

from pdd.policy.views import PREFILL_FIT_STEPS, fit_prefill_cost, prefill_rate


class PrefillMeter:
    """An instance's last `PREFILL_FIT_STEPS` steps that computed prompts
    (prompt tokens, seconds, attention work): the engine's stats read their
    tokens over their time (`tokens_s`, token-weighted as the engine: a mean
    of per-step rates made P look ~15% slower than it reports), the router
    fits its cost on them (`cost`, `fit_prefill_cost`)."""

    __slots__ = ("steps", "tokens_s", "cost")

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float, float]] = deque(maxlen=PREFILL_FIT_STEPS)
        self.tokens_s: float | None = None
        self.cost: tuple[float, float, float] | None = None

    def record(self, tokens: int, seconds: float, attn: float) -> None:
        self.steps.append((tokens, seconds, attn))
        self.tokens_s = prefill_rate(self.steps)
        self.cost = fit_prefill_cost(list(self.steps))

    @property
    def largest_step(self) -> int:
        return max((s[0] for s in self.steps), default=0)

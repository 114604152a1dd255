"""Which prompt work shares a step with prompts that complete in it.

An engine step on a CPU takes about a fixed cost plus a cost per token it
computes (a + b x tokens), and nothing in it is seen before the whole step
ends. Prompt work is taken shortest remaining first, so the first prompts
of a step are the short ones: warm turns that compute a few dozen tokens.
A longer prompt's last chunk that still fits the token budget used to join
them, and a 26-token warm turn that arrived during a cold turn's first
chunk then waited for the cold turn's 293-token remainder as well
(`results/wan-bound-53`, pd-wan-drc: 1.14 s on P where its own step takes
~0.1 s).

Adding `remaining` tokens to a step delays each of the `completing` prompts
already in it by b x remaining; running them in the next step instead
delays only the one that waits, by a step of what is already planned
(a + b x planned). So it joins when

    completing x remaining <= planned + overhead_tokens

where `overhead_tokens` is a / b, the step's fixed cost in tokens (~60 on
this CPU in bf16: a 32-token step 0.15 s, a 512-token one 0.94 s). Two
short prompts still share a step; a long prompt's chunk goes next, alone
(it waits only while short prompts keep arriving, which they do at far
less than the budget). Decode rows are in every step either way and are
counted in `planned`.

Pure: the engine's scheduler (`pdd.engine.scheduler`) and the simulator's
instance (`pdd.sim.instance`) ask the same question with the same numbers.
"""

from __future__ import annotations

# a / b of a CPU step (see above): where the steps' fixed cost is not known
STEP_OVERHEAD_TOKENS = 64


def joins_step(remaining: int, budget_left: int, planned: int, completing: int,
               overhead_tokens: int = STEP_OVERHEAD_TOKENS) -> bool:
    """Whether prompt work with `remaining` tokens to compute joins a step
    that has `planned` tokens already (decode rows and prompt chunks),
    `budget_left` of its token budget free, and `completing` prompts that
    end in it. Callers go through their prompt work shortest remaining
    first and stop at the first False: a longer one would not join either."""
    if remaining < 0 or budget_left < 0 or planned < 0 or completing < 0 or overhead_tokens < 0:
        raise ValueError("joins_step: negative count")
    if budget_left == 0:
        return False
    if completing == 0:
        return True              # nothing ends in this step yet: take what fits
    if remaining > budget_left:
        return False             # a chunk that does not end its prompt never joins ending ones
    return completing * remaining <= planned + overhead_tokens

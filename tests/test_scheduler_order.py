"""Prompt work is scheduled shortest-remaining first (pure scheduler, no model)."""

from __future__ import annotations

from pdd.engine.block_pool import BlockPool
from pdd.engine.config import EngineConfig
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.engine.scheduler import Scheduler

CFG = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)


def make() -> Scheduler:
    return Scheduler(CFG, BlockPool(CFG.num_blocks, CFG.block_size, True), b"ns")


def req(rid: str, n: int, t: float, base: int = 100) -> EngineRequest:
    return EngineRequest(rid, list(range(base, base + n)), SamplingParams(max_tokens=4), arrival_s=t)


def step(s: Scheduler) -> dict[str, int]:
    plan = s.schedule()
    s.postprocess(plan)
    for x in plan.seqs:
        if x.sample:                      # as the engine does with the sampled token
            x.request.token_ids.append(7)
    return {x.request.request_id: x.num_tokens for x in plan.seqs}


def test_a_short_prompt_overtakes_a_long_one_in_progress():
    s = make()
    s.add(req("cold", 2000, 0.0))
    assert step(s) == {"cold": 256}
    s.add(req("warm", 40, 1.0, base=5000))
    # The newcomer computes all of its 40 tokens at once, in a step of its own.
    assert step(s) == {"warm": 40}
    assert step(s) == {"warm": 1, "cold": 255}     # its decode goes first


def test_the_cached_prefix_counts_as_done():
    s = make()
    first = req("first", 320, 0.0)
    s.add(first)
    assert step(s) == {"first": 256} and step(s) == {"first": 64}
    s.remove(first)                   # finished: its blocks stay in the prefix cache
    s.add(req("long", 1000, 1.0, base=9000))
    assert step(s) == {"long": 256}
    # 336 tokens, 320 of them cached (20 blocks): 16 to compute, ahead of the long one.
    s.add(req("follow", 336, 2.0))
    assert step(s) == {"follow": 16}


def test_equal_work_keeps_arrival_order_and_decodes_go_first():
    s = make()
    s.add(req("a", 200, 0.0))
    s.add(req("b", 200, 1.0, base=3000))
    assert step(s) == {"a": 200}                # completes a: no chunk of b beside it
    out = step(s)                               # a decodes first, then b
    assert list(out) == ["a", "b"] and out == {"a": 1, "b": 200}


def test_a_handoffs_final_extend_runs_alone_then_the_batch_resumes():
    s = make()
    for k, rid in enumerate(("a", "b", "md")):
        s.add(req(rid, 40, float(k), base=1000 * (k + 1)))
    while any(x.num_uncomputed > 1 for x in s.running) or s.waiting:
        step(s)
    handed = next(r for r in s.running if r.request_id == "md")
    # The final batch of a handoff: two token ids RLD produced, to sample after.
    handed.token_ids.extend([11, 12])
    handed.hold, handed.urgent = False, True
    assert step(s) == {"md": 3}              # its last own token and the two, nothing else
    assert not handed.urgent
    assert step(s) == {"a": 1, "b": 1, "md": 1}


def test_a_final_extend_that_finds_its_request_not_yet_admitted_runs_alone_too():
    s = make()
    for k, rid in enumerate(("a", "b")):
        s.add(req(rid, 40, float(k), base=1000 * (k + 1)))
    while any(x.num_uncomputed > 1 for x in s.running) or s.waiting:
        step(s)
    s.add(req("other", 60, 5.0, base=7000))       # prompt work that would share the step
    md = req("md", 40, 6.0, base=9000)             # MD's request, submitted as its KV landed
    md.hold = True
    s.add(md)
    # The router's final batch arrives before the next step: two of RLD's tokens.
    md.token_ids.extend([11, 12])
    md.hold, md.urgent = False, True
    assert step(s) == {"md": 42}                  # admitted at once, alone: no decodes, no other prompt
    assert not md.urgent
    out = step(s)
    assert out["md"] == 1 and out["a"] == 1 and out["b"] == 1


def test_a_longer_prompts_last_chunk_does_not_join_a_step_that_ends_a_short_one():
    """The cold prompt's remainder (194 tokens) fits the step's budget, but the
    warm turn would wait for it: the warm turn runs alone, the remainder next."""
    s = make()
    s.add(req("cold", 450, 0.0))
    assert step(s) == {"cold": 256}
    s.add(req("warm", 40, 1.0, base=5000))
    assert step(s) == {"warm": 40}
    assert step(s) == {"warm": 1, "cold": 194}


def test_short_prompts_still_share_a_step_and_a_short_remainder_joins_them():
    s = make()
    s.add(req("cold", 290, 0.0))
    assert step(s) == {"cold": 256}
    s.add(req("w1", 30, 1.0, base=5000))
    s.add(req("w2", 40, 1.1, base=6000))
    # w1 (30) ends; w2 (40 <= 30 + 64) joins; then cold's 34 tokens: 2 x 34 <= 70 + 64.
    assert step(s) == {"w1": 30, "w2": 40, "cold": 34}


def test_the_step_overhead_setting_moves_the_line():
    cfg = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256,
                       step_overhead_tokens=200)
    s = Scheduler(cfg, BlockPool(cfg.num_blocks, cfg.block_size, True), b"ns")
    s.add(req("cold", 450, 0.0))
    assert step(s) == {"cold": 256}
    s.add(req("warm", 40, 1.0, base=5000))
    assert step(s) == {"warm": 40, "cold": 194}      # 194 <= 40 + 200: as cheap to carry as to wait

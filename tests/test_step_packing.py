"""The shared rule for what joins a step that ends prompts (pure)."""

from __future__ import annotations

import pytest

from pdd.engine.config import EngineConfig
from pdd.policy import Role
from pdd.policy.step_packing import joins_step
from pdd.sim.cost_model import CostModel
from pdd.sim.hardware import get_profile
from pdd.sim.instance import Job, JobKind, SimInstance
from pdd.sim.model_shape import get_model
from pdd.sim.request import RequestSpec, SimRequest


def test_nothing_ending_yet_takes_what_fits():
    assert joins_step(2000, 512, 0, 0)
    assert joins_step(2000, 100, 412, 0)
    assert not joins_step(10, 0, 512, 0)


def test_a_step_that_ends_prompts_takes_only_what_they_can_wait_for():
    assert joins_step(40, 400, 30, 1)                  # 40 <= 30 + 64
    assert not joins_step(194, 216, 40, 1)             # 194 > 40 + 64
    assert joins_step(194, 216, 40, 1, overhead_tokens=160)
    assert not joins_step(60, 400, 60, 3)              # three waiting on it: 180 > 124
    assert not joins_step(300, 200, 10, 1, overhead_tokens=10_000)   # a chunk that does not end never joins


def test_negative_counts_are_refused():
    with pytest.raises(ValueError):
        joins_step(-1, 10, 0, 0)
    with pytest.raises(ValueError):
        EngineConfig(step_overhead_tokens=-1)


def test_the_simulator_packs_steps_as_the_engine_does():
    """The same arrivals as tests/test_scheduler_order.py's, on a simulated P
    with our engine's order: the warm turn alone, the cold remainder next."""
    cost = CostModel(get_model("llama3-8b"), get_profile("gpu_a"))
    i = SimInstance("p", Role.PREFILL, "a", cost, max_batch=8, token_budget=256, block_size=16,
                    kv_blocks=10_000, cache=True, packing="short_first")
    cold = SimRequest(RequestSpec("cold", 0.0, 450, 4, 4, tuple(range(29))))
    i.add_job(Job(cold, JobKind.PREFILL, 450, 0, 29))
    t = i.start_step(0.0)
    assert i.current_chunks == (("cold", 256),)
    warm = SimRequest(RequestSpec("warm", 0.0, 40, 4, 4, (900, 901, 902)))
    i.add_job(Job(warm, JobKind.PREFILL, 40, 0, 3))
    i.end_step(t)
    t = i.start_step(t)
    assert i.current_chunks == (("warm", 40),)
    i.end_step(t)
    i.start_step(t)
    assert i.current_chunks == (("cold", 194),)

"""The engine thread sleeps while its engine has nothing to do, and does not
spin while it has work it cannot schedule: an idle instance on a core P
shares with RLD takes nothing from P's steps (`EngineLoop._run`). A command
still reaches an idle engine at once."""

from __future__ import annotations

import asyncio
import time

from pdd.server.engine_loop import EngineLoop


class CountingEngine:
    """What EngineLoop reads of an engine, counted: `has_work` as set,
    each step planning nothing (no events, no step booked) unless `runs`."""

    def __init__(self, has_work: bool = False, runs: bool = False):
        self._has_work = has_work
        self.runs = runs
        self.reads = 0
        self.steps = 0
        self.num_steps = 0
        self.pool_lock = _NoLock()

    @property
    def has_work(self) -> bool:
        self.reads += 1
        return self._has_work

    def step(self):
        self.steps += 1
        if self.runs:
            self.num_steps += 1
        return []


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_for(engine, seconds: float, action=None):
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            out = await action(loop) if action else None
            await asyncio.sleep(seconds)
            return out
        finally:
            loop.stop()
    return asyncio.run(main())


def test_an_idle_engine_thread_sleeps_instead_of_polling():
    engine = CountingEngine(has_work=False)
    _run_for(engine, 0.5)
    # a 10 ms poll read it ~100 times in 0.5 s; sleeping on the queue, a
    # couple of times (each wake-up reads it twice)
    assert engine.reads <= 6, engine.reads
    assert engine.steps == 0


def test_work_it_cannot_schedule_is_retried_at_a_bounded_rate_not_spun_on():
    engine = CountingEngine(has_work=True, runs=False)
    _run_for(engine, 0.3)
    # stuck_wait_s = 10 ms between empty steps: ~30, not tens of thousands
    assert 5 <= engine.steps <= 60, engine.steps


def test_steps_that_run_follow_each_other_without_waiting():
    engine = CountingEngine(has_work=True, runs=True)
    _run_for(engine, 0.2)
    assert engine.steps > 100, engine.steps


def test_a_command_reaches_an_idle_engine_at_once():
    engine = CountingEngine(has_work=False)

    async def call(loop):
        await asyncio.sleep(0.2)                 # the thread is asleep by now
        t0 = time.monotonic()
        got = await loop.call(lambda e: e is engine)
        return got, time.monotonic() - t0

    got, waited = _run_for(engine, 0.0, call)
    assert got is True
    assert waited < 0.2, waited                  # not the 1 s idle bound

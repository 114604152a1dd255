"""Readers of the engine's progress wait for it to move instead of polling
(`EngineLoop.moved`): woken by each layer's KV written and each step, never
losing a move that happened while they were busy."""

from __future__ import annotations

import asyncio
import threading
import time

from pdd.engine.request import EngineRequest, SamplingParams
from pdd.server.engine_loop import EngineLoop, EngineMoved
from test_engine import make_engine, prompt


def test_a_move_while_the_reader_was_busy_is_not_lost_and_a_quiet_engine_times_out():
    async def main():
        moved = EngineMoved(asyncio.get_running_loop())
        seen = moved.version
        threading.Thread(target=moved.notify_threadsafe).start()    # from another thread, as the engine
        await asyncio.sleep(0.05)                                    # ... while the reader was busy
        t0 = time.monotonic()
        await moved.wait(seen, 5.0)
        assert time.monotonic() - t0 < 0.05 and moved.version == seen + 1
        t0 = time.monotonic()
        await moved.wait(moved.version, 0.2)                         # nothing moves: the timeout
        assert 0.18 < time.monotonic() - t0 < 1.0
        # A waiter already waiting wakes on the move, long before its timeout.
        seen = moved.version
        threading.Timer(0.1, moved.notify_threadsafe).start()
        t0 = time.monotonic()
        await moved.wait(seen, 5.0)
        assert 0.05 < time.monotonic() - t0 < 1.0
    asyncio.run(main())


def test_each_layer_written_wakes_a_waiting_reader(tiny_model):
    """One prefill step: a reader waiting on `moved` is woken once per layer
    (coalesced wake-ups may merge some), and sees layers_written grow."""
    engine = make_engine(tiny_model)
    layers = engine.runner.num_layers

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            q = await loop.submit(EngineRequest("r", prompt(5, 60), SamplingParams(max_tokens=1)))
            seen_layers, wakes = set(), 0
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                seen = loop.moved.version
                prog = engine.runner.progress
                if prog is not None:
                    seen_layers.add(prog.layers_written)
                if not q.empty():
                    break
                await loop.moved.wait(seen, 5.0)
                wakes += loop.moved.version != seen
            assert wakes >= 2 and max(seen_layers) == layers
        finally:
            loop.stop()
    asyncio.run(main())

"""Readers of the engine's progress wait for it to move instead of polling
(`EngineLoop.moved`): woken by each layer's KV written and each step, never
losing a move that happened while they were busy."""

from __future__ import annotations

import asyncio
import threading
import time

from pdd.engine import kv_codec
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


def test_the_runner_reports_each_step_start_and_each_part_of_layers_written(tiny_model, monkeypatch):
    """What `EngineLoop.moved` is fed: one call at a step's start (its spans
    known) and one each time a streamed part's layers are written (every
    `layers_per_part` layers, and the last), with layers_written counting up,
    on the engine's own thread."""
    for part_bytes, expect in ((1, [1, 2]), (kv_codec.STREAM_PART_MIN_BYTES, [2])):
        monkeypatch.setattr(kv_codec, "STREAM_PART_MIN_BYTES", part_bytes)
        engine = make_engine(tiny_model)
        assert engine.runner.num_layers == 2
        seen = []
        engine.runner.on_step_start = lambda: seen.append(("start", dict(engine.runner.progress.spans)))
        engine.runner.on_progress = lambda: seen.append(("layer", engine.runner.progress.layers_written))
        engine.submit(EngineRequest("r", prompt(5, 60), SamplingParams(max_tokens=1)))
        engine.step()
        assert seen[0] == ("start", {"r": (0, 60)})
        assert seen[1:] == [("layer", n) for n in expect], part_bytes


def test_an_engine_loop_wakes_a_reader_waiting_on_it(tiny_model):
    engine = make_engine(tiny_model)

    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            seen = loop.moved.version
            q = await loop.submit(EngineRequest("r", prompt(5, 60), SamplingParams(max_tokens=1)))
            await loop.moved.wait(seen, 5.0)
            assert loop.moved.version > seen
            while await asyncio.wait_for(q.get(), 10) is not None:
                pass
        finally:
            loop.stop()
        assert engine.runner.on_progress is None      # unhooked when the loop stops
    asyncio.run(main())

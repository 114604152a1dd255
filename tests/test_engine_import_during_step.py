"""KV import runs during an engine step (under the pool lock), not after it:
a receiver's HAVE and block writes must not wait for a long prefill chunk."""

from __future__ import annotations

import asyncio
import threading

from pdd.engine.request import EngineRequest, SamplingParams
from pdd.server.engine_loop import EngineLoop
from test_engine import drain, make_engine, prompt
from test_kv_export import GREEDY, alone, prefill


def test_blocks_import_while_a_step_runs_and_tokens_match(tiny_model):
    src = make_engine(tiny_model)
    p = prompt(7, 40)
    first = prefill(src, "r", p)
    manifest = src.kv_manifest("r")
    blocks = [src.read_block("r", i) for i in range(len(manifest.block_hashes))]

    dst = make_engine(tiny_model)
    in_step, release = threading.Event(), threading.Event()
    real_execute = dst.runner.execute

    def gated(plan):                       # the model is "running" until released
        in_step.set()
        assert release.wait(10)
        return real_execute(plan)

    dst.runner.execute = gated

    async def go():
        loop = EngineLoop(dst, asyncio.get_running_loop())
        loop.start()
        try:
            q = await loop.submit(EngineRequest("other", prompt(3, 20), SamplingParams(max_tokens=2)))
            assert await asyncio.to_thread(in_step.wait, 10)
            # The step is under way: the import must go through now, not after it.
            imp = loop.call_now(lambda e: e.begin_import(manifest.to_meta(), list(manifest.block_hashes),
                                                         pin_for="r"))
            for i, payload in enumerate(blocks):
                loop.call_now(lambda e, i=i, payload=payload: imp.add_block(i, payload))
            assert not release.is_set() and imp.num_written == len(blocks)
            release.set()
            while (ev := await asyncio.wait_for(q.get(), 10)) is not None:
                pass
        finally:
            release.set()
            loop.stop()

    asyncio.run(go())
    dst.runner.execute = real_execute
    # The imported blocks are the prompt's KV: resuming there equals decoding alone.
    dst.submit(EngineRequest("r", p, GREEDY, output_ids=[first]))
    out = [first] + [e.token_id for e in drain(dst) if e.token_id is not None and e.request_id == "r"]
    assert out == alone(tiny_model, p)
    assert dst.scheduler.prefix_hit_tokens >= len(blocks) * dst.cfg.block_size

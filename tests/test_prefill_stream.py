"""P's streamed KV source (`PrefillJob._layer_slices`): what it reads from the
KV cache ahead of the line stays bounded, and the bytes it yields are the
blocks' own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdd.engine.request import EngineRequest, SamplingParams
from pdd.server import prefill_job
from pdd.server.prefill_job import PrefillJob
from test_engine import drain, make_engine, prompt


class _NeverMoves:
    """The engine's step counter, for a prompt that is already computed: the
    source must not wait on it (each wait would cost STREAM_WAIT_S)."""
    version = 0
    waits = 0

    async def wait(self, seen, timeout):
        self.waits += 1
        await asyncio.sleep(0)


def test_a_streamed_copy_reads_a_bounded_window_ahead_of_the_line(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    p = prompt(7, 400)                                  # 25 blocks
    engine.submit(EngineRequest("r", p, SamplingParams(max_tokens=1), keep_kv=True))
    drain(engine)
    block_bytes = engine.layout.block_bytes
    monkeypatch.setattr(prefill_job, "READ_AHEAD_BYTES", 3 * block_bytes)
    moved = _NeverMoves()
    job = PrefillJob(SimpleNamespace(engine=engine, loop=SimpleNamespace(moved=moved)), "r", p, None, [])

    runner, read_total = engine.runner, [0]
    real_read = runner.read_block_layers

    def counting_read(block_id, lo, hi):
        data = real_read(block_id, lo, hi)
        read_total[0] += len(data)
        return data
    monkeypatch.setattr(runner, "read_block_layers", counting_read)

    async def pull():
        job.prefilled = asyncio.get_running_loop().create_future()
        job.prefilled.set_result(0)                      # P has its first token
        got, ahead, taken = {}, [], 0
        async for item in job._layer_slices(len(p) // 16, held={2}):
            i, offset, total, data = item
            taken += len(data)
            ahead.append(read_total[0] - taken)          # read but not yet taken by the sender
            got[i] = got.get(i, b"") + data
            assert offset + len(data) <= total == block_bytes
        return got, max(ahead)

    got, most_ahead = asyncio.run(pull())
    blocks = engine.requests["r"].block_ids
    assert sorted(got) == [i for i in range(25) if i != 2]          # the held block is skipped
    assert all(got[i] == runner.read_block(blocks[i]) for i in got)
    # Before the bound, the whole prompt (24 blocks) was read in one go.
    assert most_ahead < 3 * block_bytes, (most_ahead, block_bytes)
    assert moved.waits == 0


def test_the_copies_that_stream_and_those_that_wait_for_the_prefill():
    """A target the router marks `"stream": false` (the copy to RLD, unless
    `PolicyConfig.stream_relay_copy`) and a warm push leave once the prefill
    has ended (`run` sends every target not yet under way); the others stream
    while P computes."""
    targets = [{"name": "rld0", "stream": False}, {"name": "md0", "stream": True},
               {"name": "md1", "warm_blocks": 2}, {"name": "d0"}]
    job = PrefillJob(None, "r", [1] * 40, None, targets)
    assert [t["name"] for t in job._streamed_targets()] == ["md0", "d0"]

"""The decode side's receiver handler (`KVArrivals`) takes a transfer's pool
blocks at BEGIN and gives back what never landed: when the transfer fails,
and when its arrival is dropped mid-way. Nothing leaks; what landed stays
in the prefix cache."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pdd.deploy.spec import load_spec
from pdd.engine.kv_codec import BLOCK_DIGEST, seal_block
from pdd.policy import PolicyConfig
from pdd.server.engine_loop import EngineLoop
from pdd.server.instance_metrics import InstanceMetrics
from pdd.server.kv_arrivals import KVArrivals
from pdd.transport.state import TransferStatus
from test_engine import make_engine, prompt
from test_kv_export import prefill

SPEC = load_spec(Path(__file__).resolve().parents[1] / "examples" / "pdd.toml")


def exported(tiny_model, p: list[int]):
    src = make_engine(tiny_model)
    prefill(src, "r", p)
    m = src.kv_manifest("r")
    return m, [src.read_block("r", i) for i in range(len(m.block_hashes))]


async def settle(loop: EngineLoop) -> None:
    for _ in range(3):                      # the spawned releases run on the engine thread
        await asyncio.sleep(0.05)
        await loop.call(lambda e: None)


def run_case(tiny_model, end_how: str) -> None:
    manifest, blocks = exported(tiny_model, prompt(21, 120))
    hashes = list(manifest.block_hashes)
    engine = make_engine(tiny_model)
    base = engine.pool.num_used

    async def go():
        arrivals = KVArrivals(SPEC, engine, PolicyConfig(), InstanceMetrics("md0", "main"))
        loop = arrivals.loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            held = await arrivals.on_begin("r", manifest.to_meta() | {"block_digest": BLOCK_DIGEST}, hashes)
            assert held == set()
            assert engine.pool.num_used == base + len(blocks)          # every block's slot taken at BEGIN
            for i in range(2):
                await arrivals.on_block("r", i, hashes[i], seal_block(blocks[i]))
            if end_how == "fails":
                status = TransferStatus("r", num_blocks=len(blocks))
                status.fail("connection reset mid-transfer", time.monotonic())
                await arrivals.on_end("r", status)
            else:
                arrivals.drop("r")                                     # the request was aborted
            await settle(loop)
            assert engine.pool.num_used == base, (engine.pool.num_used, base)
            assert len(engine.pool.lookup_prefix(hashes)) == 2         # what landed stays cached
            assert len(arrivals) == (1 if end_how == "fails" else 0)   # a failed one waits for its decode call
        finally:
            loop.stop()

    asyncio.run(go())


def test_a_failed_transfer_gives_back_the_blocks_it_never_wrote(tiny_model):
    run_case(tiny_model, "fails")


def test_a_dropped_arrival_gives_back_the_blocks_it_never_wrote(tiny_model):
    run_case(tiny_model, "dropped")


def test_a_follow_up_waits_for_a_sibling_copy_however_long_it_queues(tiny_model):
    # The next turn's copy lacks what the previous turn's copy is still
    # bringing: HAVE waits for that copy's end, not a fixed part of the KV
    # deadline (half of it until session 13: past it, every later turn of the
    # conversation resent the shared context and the line's backlog fed on
    # itself, results/overload-13).
    import dataclasses

    first = prompt(21, 120)
    manifest, blocks = exported(tiny_model, first)
    follow_manifest, _ = exported(tiny_model, first + prompt(22, 40))
    hashes, follow = list(manifest.block_hashes), list(follow_manifest.block_hashes)
    assert follow[:len(hashes)] == hashes
    engine = make_engine(tiny_model)
    spec = dataclasses.replace(SPEC, kv_deadline_s=0.2)      # the old bound would be 0.1 s

    async def go():
        arrivals = KVArrivals(spec, engine, PolicyConfig(), InstanceMetrics("md0", "main"))
        loop = arrivals.loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        meta = manifest.to_meta() | {"block_digest": BLOCK_DIGEST}
        try:
            assert await arrivals.on_begin("t0", meta, hashes) == set()
            waiting = asyncio.ensure_future(arrivals.on_begin(
                "t1", follow_manifest.to_meta() | {"block_digest": BLOCK_DIGEST}, follow))
            await asyncio.sleep(0.5)
            assert not waiting.done()                          # still waiting for t0's copy
            for i, h in enumerate(hashes):
                await arrivals.on_block("t0", i, h, seal_block(blocks[i]))
            status = TransferStatus("t0", num_blocks=len(hashes))
            status.succeed(time.monotonic())
            await arrivals.on_end("t0", status)
            held = await asyncio.wait_for(waiting, 5)
            assert held == set(range(len(hashes)))             # only the new blocks still to cross
            arrivals.drop("t0")
            arrivals.drop("t1")
            await settle(loop)
        finally:
            loop.stop()

    asyncio.run(go())


def test_waiters_on_a_copy_that_ends_early_do_not_all_send_the_rest(tiny_model):
    # Two follow-ups wait on the first turn's copy; it fails with two blocks
    # landed. The first follow-up to look again begins and brings the rest;
    # the second now waits on it and then lacks nothing of the shared part
    # (results/overload-s29: eleven turns each sent the same 20 blocks).
    first = prompt(21, 120)
    manifest, blocks = exported(tiny_model, first)
    f1, f1_blocks = exported(tiny_model, first + prompt(22, 40))
    f2, _ = exported(tiny_model, first + prompt(22, 40) + prompt(23, 40))
    hashes, h1, h2 = list(manifest.block_hashes), list(f1.block_hashes), list(f2.block_hashes)
    assert h2[:len(h1)] == h1 and h1[:len(hashes)] == hashes
    engine = make_engine(tiny_model)

    async def go():
        arrivals = KVArrivals(SPEC, engine, PolicyConfig(), InstanceMetrics("md0", "main"))
        loop = arrivals.loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        meta = lambda m: m.to_meta() | {"block_digest": BLOCK_DIGEST}
        try:
            assert await arrivals.on_begin("t0", meta(manifest), hashes) == set()
            w1 = asyncio.ensure_future(arrivals.on_begin("t1", meta(f1), h1))
            w2 = asyncio.ensure_future(arrivals.on_begin("t2", meta(f2), h2))
            await asyncio.sleep(0.2)
            assert not w1.done() and not w2.done()             # both wait for t0's copy
            for i in range(2):
                await arrivals.on_block("t0", i, hashes[i], seal_block(blocks[i]))
            status = TransferStatus("t0", num_blocks=len(hashes))
            status.fail("cancelled", time.monotonic())
            await arrivals.on_end("t0", status)
            held1 = await asyncio.wait_for(w1, 5)               # the first to look again begins
            assert held1 == {0, 1}
            await asyncio.sleep(0.2)
            assert not w2.done()                                # the second now waits on t1's copy
            for i in range(len(h1)):
                if i not in held1:
                    await arrivals.on_block("t1", i, h1[i], seal_block(f1_blocks[i]))
            status = TransferStatus("t1", num_blocks=len(h1))
            status.succeed(time.monotonic())
            await arrivals.on_end("t1", status)
            held2 = await asyncio.wait_for(w2, 5)
            assert held2 == set(range(len(h1)))                 # only its own new blocks still to cross
            for rid in ("t0", "t1", "t2"):
                arrivals.drop(rid)
            await settle(loop)
        finally:
            loop.stop()

    asyncio.run(go())

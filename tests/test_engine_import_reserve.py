"""An incoming transfer takes its pool blocks at BEGIN, in one allocation:
its KV lands in consecutive blocks even when transfers and other
allocations interleave block by block (a slow line), and what never lands
goes back to the pool."""

from __future__ import annotations

from pdd.engine.paged_attention import split_runs
from pdd.engine.request import EngineRequest
from test_engine import drain, make_engine, prompt
from test_kv_export import GREEDY, alone, prefill


def exported(tiny_model, rid: str, p: list[int]):
    src = make_engine(tiny_model)
    first = prefill(src, rid, p)
    m = src.kv_manifest(rid)
    return first, m, [src.read_block(rid, i) for i in range(len(m.block_hashes))]


def begin(dst, rid, manifest, held=()):
    imp = dst.begin_import(manifest.to_meta(), list(manifest.block_hashes), pin_for=rid)
    imp.reserve(i for i in range(len(manifest.block_hashes)) if i not in held)
    return imp


def test_interleaved_transfers_land_in_consecutive_blocks_and_decode_right(tiny_model):
    pa, pb = prompt(11, 130), prompt(12, 120)
    first_a, ma, blocks_a = exported(tiny_model, "a", pa)
    _, mb, blocks_b = exported(tiny_model, "b", pb)
    dst = make_engine(tiny_model)
    ia, ib = begin(dst, "a", ma), begin(dst, "b", mb)
    strays = []
    for i in range(max(len(blocks_a), len(blocks_b))):
        # what a slow line looks like to the pool: the two transfers' blocks
        # and other allocations (decode growing its sequences) alternate
        for imp, blocks in ((ia, blocks_a), (ib, blocks_b)):
            if i < len(blocks):
                imp.add_block(i, blocks[i])
        strays += dst.pool.allocate(1)
    for m in (ma, mb):
        ids = [dst.pool.hash_to_block[h] for h in m.block_hashes]
        assert ids == list(range(ids[0], ids[0] + len(ids))), ids
        # decode reads such a context in place: one run, nothing to gather
        seq = split_runs(ids, len(ids) * dst.cfg.block_size, dst.cfg.block_size)
        assert len(seq.runs) == 1 and seq.gather is None
    dst.pool.free(strays)
    dst.submit(EngineRequest("a", pa, GREEDY, output_ids=[first_a]))
    out = [first_a] + [e.token_id for e in drain(dst) if e.token_id is not None and e.request_id == "a"]
    assert out == alone(tiny_model, pa)


def test_blocks_reserved_and_never_written_go_back(tiny_model):
    _, m, blocks = exported(tiny_model, "r", prompt(13, 100))
    dst = make_engine(tiny_model)
    used = dst.pool.num_used
    imp = begin(dst, "r", m)
    assert dst.pool.num_used == used + len(blocks)            # all taken at BEGIN
    for i in range(2):
        imp.add_block(i, blocks[i])
    imp.close()                                               # the transfer broke after two blocks
    assert dst.pool.num_used == used + 2                      # the two written, pinned for "r"
    imp.close()                                               # closing twice gives back nothing more
    assert dst.pool.num_used == used + 2
    dst._release_pins("r")
    assert dst.pool.num_used == used
    assert len(dst.pool.lookup_prefix(list(m.block_hashes))) == 2   # what landed stays cached


def test_a_block_another_transfer_landed_first_frees_its_reservation(tiny_model):
    _, m, blocks = exported(tiny_model, "r", prompt(14, 64))
    dst = make_engine(tiny_model)
    used = dst.pool.num_used
    first, second = begin(dst, "x", m), begin(dst, "y", m)   # the same prefix, two copies in flight
    for i, payload in enumerate(blocks):
        first.add_block(i, payload)
    for i, payload in enumerate(blocks):
        second.add_block(i, payload)                          # already there: shares, gives its own back
    assert second.num_written == 0
    second.close()
    assert dst.pool.num_used == used + len(blocks)
    dst._release_pins("x")
    dst._release_pins("y")
    assert dst.pool.num_used == used


def test_without_room_for_the_whole_transfer_blocks_are_taken_as_they_land(tiny_model):
    _, m, blocks = exported(tiny_model, "r", prompt(15, 100))
    dst = make_engine(tiny_model, num_blocks=len(blocks) + 2)
    hog = dst.pool.allocate(4)                                # fewer free blocks than the transfer needs
    imp = begin(dst, "r", m)
    assert imp.reserved == {}
    dst.pool.free(hog)
    for i, payload in enumerate(blocks):
        imp.add_block(i, payload)
    assert imp.num_written == len(blocks)

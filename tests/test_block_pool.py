"""Block pool and prefix cache: exact behaviour and Hypothesis properties."""

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdd.engine.block_pool import BlockPool, NoFreeBlocks
from pdd.engine.hashing import hash_block, hash_blocks


def test_hash_chain_is_stable_and_prefix_sensitive():
    a = hash_blocks(list(range(40)), 16)
    b = hash_blocks(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] == b[1]
    c = hash_blocks([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]          # a change in block 0 changes block 1 too
    assert a[0] == hash_block(None, list(range(16)))
    assert hash_blocks(list(range(32)), 16, b"model-x") != hash_blocks(list(range(32)), 16, b"model-y")


def test_allocate_free_and_lru_eviction_order():
    pool = BlockPool(4, 16)
    b = pool.allocate(3)
    assert b == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    for i, blk in enumerate(b):
        assert pool.commit(blk, bytes([i]) * 16)
    pool.free(b)                    # released tail first: 2, 1, 0 -> evictable in that order
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.lookup_prefix([b"\x00" * 16, b"\x01" * 16, b"\x09" * 16]) == [0, 1]
    got = pool.allocate(2)          # block 3 (never used) first, then evict block 2 (the tail)
    assert got == [3, 2]
    assert not pool.holds(b"\x02" * 16) and pool.holds(b"\x00" * 16)
    assert pool.num_evictions == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)


def test_acquire_cached_block_and_double_free_is_an_error():
    pool = BlockPool(2, 4)
    (blk,) = pool.allocate(1)
    pool.commit(blk, b"h" * 16)
    pool.free([blk])
    pool.acquire([blk])             # a cache hit takes it back
    assert pool.ref_counts[blk] == 1 and pool.num_used == 1
    pool.free([blk])
    with pytest.raises(ValueError):
        pool.free([blk])


def test_disabled_prefix_cache_never_matches():
    pool = BlockPool(2, 4, enable_prefix_cache=False)
    (blk,) = pool.allocate(1)
    assert not pool.commit(blk, b"h" * 16)
    assert pool.lookup_prefix([b"h" * 16]) == []


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / commit / free / acquire sequences against a brute-force model."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8, 4)
        self.held: list[list[int]] = []     # sequences of blocks we hold a reference on
        self.counter = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if self.pool.can_allocate(n):
            blocks = self.pool.allocate(n)
            for b in blocks:
                assert all(b not in s for s in self.held), "referenced block handed out again"
            self.held.append(blocks)
        else:
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(n)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def commit(self, i):
        blocks = self.held[i % len(self.held)]
        for b in blocks:
            if self.pool.block_hashes[b] is None:
                self.counter += 1
                self.pool.commit(b, self.counter.to_bytes(16, "little"))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.pool.free(self.held.pop(i % len(self.held)))

    @rule(k=st.integers(1, 40), prefix=st.integers(0, 4))
    def lookup_and_acquire(self, k, prefix):
        query = [(k + j).to_bytes(16, "little") for j in range(prefix)]
        got = self.pool.lookup_prefix(query)
        brute = []
        for h in query:
            owners = [b for b in range(self.pool.num_blocks) if self.pool.block_hashes[b] == h]
            if not owners:
                break
            brute.append(owners[0])
        assert got == brute
        if got:
            self.pool.acquire(got)
            self.held.append(got)

    @invariant()
    def accounting(self):
        p = self.pool
        assert all(r >= 0 for r in p.ref_counts)
        assert p.num_free + p.num_used == p.num_blocks
        assert p.num_used == sum(1 for r in p.ref_counts if r > 0)
        refs = [0] * p.num_blocks
        for s in self.held:
            for b in s:
                refs[b] += 1
        assert refs == p.ref_counts
        for h, b in p.hash_to_block.items():
            assert p.block_hashes[b] == h


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 3), min_size=0, max_size=64), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_hash_blocks_counts_only_full_blocks(tokens, bs):
    hs = hash_blocks(tokens, bs)
    assert len(hs) == len(tokens) // bs
    assert len(set(hs)) == len(hs)   # chained: never repeats within one sequence

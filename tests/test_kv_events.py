"""KV events: the engine's prefix cache as a router-side index, without a round trip."""

from pdd.engine.block_pool import BlockPool
from pdd.engine.hashing import hash_blocks
from pdd.engine.kv_events import KvEventLog
from pdd.server.cache_index import CacheIndex

NS = "m"


def pool_with_log(num_blocks=4, capacity=64):
    log = KvEventLog(capacity)
    return BlockPool(num_blocks, 2, events=log), log


def commit_prompt(pool, ids):
    hashes = hash_blocks(ids, pool.block_size, NS.encode())
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        pool.commit(b, h)
    pool.free(blocks)
    return hashes


def poll(index, pool, log):
    kv = log.read(index.seq, index.epoch, lambda: list(pool.hash_to_block))
    index.apply(kv | {"block_size": pool.block_size, "namespace": NS}, now=0.0)
    return kv


def test_index_follows_publish_and_eviction():
    pool, log = pool_with_log()
    index = CacheIndex()
    assert poll(index, pool, log)["reset"]           # a first poll starts from a snapshot
    a = [1, 2, 3, 4, 5]
    commit_prompt(pool, a)
    kv = poll(index, pool, log)
    assert not kv["reset"] and len(kv["events"]) == 2
    assert index.matched_tokens(index.block_hashes(a + [9, 9])) == 4
    # Three new blocks in a pool of four: the least recently freed cached ones go.
    commit_prompt(pool, [7, 7, 8, 8, 6, 6])
    poll(index, pool, log)
    assert index.hashes == set(pool.hash_to_block)
    assert index.matched_tokens(index.block_hashes(a)) < 4


def test_a_reader_too_far_behind_or_of_another_epoch_gets_a_snapshot():
    pool, log = pool_with_log(num_blocks=64, capacity=3)
    index = CacheIndex()
    poll(index, pool, log)
    commit_prompt(pool, list(range(12)))             # six events, the log keeps three
    kv = poll(index, pool, log)
    assert kv["reset"] and index.hashes == set(pool.hash_to_block) and len(index.hashes) == 6
    restarted = KvEventLog()                         # an instance that came back
    kv = restarted.read(index.seq, index.epoch, lambda: [])
    assert kv["reset"] and kv["events"] == []


def test_a_landed_transfer_counts_before_the_next_poll():
    pool, log = pool_with_log()
    index = CacheIndex()
    poll(index, pool, log)
    ids = [4, 4, 5, 5, 6]
    index.landed(index.block_hashes(ids))
    assert index.matched_tokens(index.block_hashes(ids)) == 4

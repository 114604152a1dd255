"""Decode rows (engine/decode_rows.py): running decodes' K/V kept contiguous between steps.

* unit: a row holds exactly its request's K/V as the pool has it, survives
  while its request decodes step after step, is refilled after a gap, moves
  down when a lower row frees, and a batch too large for the buffer falls back;
* engine, fp32: greedy tokens with rows equal the unpaged reference and the
  gathering path, over mixed steps, chunked prefill, requests that finish at
  different times (rows move) and preemption; rows are refilled only when a
  request joins the decode batch, not every step;
* a KV import (write_block) drops the rows copied from the block it writes,
  and only those.
"""

from __future__ import annotations

import random

import torch

from pdd.engine import paged_attention
from pdd.engine.config import EngineConfig
from pdd.engine.decode_rows import DecodeRows
from pdd.engine.engine import Engine
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.model.reference import generate_greedy

L, KVH, D, BS = 2, 3, 4, 4


def _pool(num_blocks: int = 32) -> torch.Tensor:
    return torch.randn(L, 2, num_blocks * BS, KVH, D)   # [L, 2, S, KVH, D]


def _row(rows: DecodeRows, r: int, n: int) -> torch.Tensor:
    return rows.buf[:, :, r, :, :n].transpose(2, 3)          # [L, 2, n, KVH, D] like the pool


def _slots(rows: DecodeRows, pairs: list[tuple[int, int]]) -> list[int]:
    """(row, position) per decode -> the flat (row, head, position) indices of its K/V."""
    return [(r * KVH + h) * rows.row_len + p for r, p in pairs for h in range(KVH)]


def _ctx(kv: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n)])
    return kv[:, :, slots]


def test_rows_hold_the_pool_kv_and_survive_only_consecutive_decodes():
    kv = _pool()
    rows = DecodeRows(L, KVH, D, torch.float32, BS, max_tokens=256, headroom=8)
    rows.reserve()                                      # a decode instance at start-up
    store = rows._store.data_ptr()
    a, b = [3, 9, 1], [20, 4]
    plan = rows.prepare([("a", 10, a), ("b", 6, b)], kv)
    assert rows.buf.data_ptr() == store                 # the first layout is a view of it
    assert plan.num_rows == 2 and plan.to_rows is None and rows.num_refills == 2
    assert torch.equal(_row(rows, 0, 9), _ctx(kv, a, 9)) and torch.equal(_row(rows, 1, 5), _ctx(kv, b, 5))
    assert plan.slots.tolist() == _slots(rows, [(0, 9), (1, 5)])
    assert plan.mask.shape == (2, 1, 1, 10)
    assert torch.isinf(plan.mask[1, 0, 0, 6:]).all() and not plan.mask[1, 0, 0, :6].any()
    rows.commit()
    rows.prepare([("a", 11, a), ("b", 7, b)], kv)       # both grew by one: nothing refilled
    assert rows.num_refills == 2
    rows.commit()
    rows.prepare([("b", 8, b)], kv)     # a left: b moves down to row 0 (its refilled 5 tokens; steps write the rest)
    assert rows.num_refills == 2 and rows.held[0] == ("b", 7) and torch.equal(_row(rows, 0, 5), _ctx(kv, b, 5))
    rows.commit()
    plan = rows.prepare([("a", 12, a), ("b", 9, b)], kv)   # a skipped a step: refilled, not trusted
    assert rows.num_refills == 3 and torch.equal(_row(rows, 1, 11), _ctx(kv, a, 11))
    # a sits in row 1, b in row 0: queries go to rows and outputs come back in decode order
    assert plan.to_rows.tolist() == [1, 0] and plan.to_decodes.tolist() == [1, 0]
    assert plan.slots.tolist() == _slots(rows, [(1, 11), (0, 8)])
    rows.commit()
    plan = rows.prepare([("b", 10, b), ("a", 13, a)], kv)  # decode order = row order
    assert rows.num_refills == 3 and plan.to_rows is None


def test_an_uncommitted_step_is_not_trusted_and_a_large_batch_falls_back():
    kv = _pool()
    rows = DecodeRows(L, KVH, D, torch.float32, BS, max_tokens=64, headroom=8)
    rows.prepare([("a", 10, [3, 9, 1])], kv)
    rows.clear()                                        # the forward pass failed
    rows.prepare([("a", 11, [3, 9, 1])], kv)
    assert rows.num_refills == 2
    assert rows.prepare([(f"r{i}", 20, [i, i + 8]) for i in range(4)], kv) is None   # 4 x 20 > 64
    assert all(h is None for h in rows.held)


def _run(engine: Engine, prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.submit(EngineRequest(rid, p, SamplingParams(max_tokens=max_tokens[rid], ignore_eos=True)))
    got = {rid: [] for rid in prompts}
    for _ in range(500):
        if not engine.has_work:
            break
        for ev in engine.step():
            if ev.token_id is not None:
                got[ev.request_id].append(ev.token_id)
    return got


def test_engine_with_rows_equals_the_reference_and_the_gathering_path(tiny_model, monkeypatch):
    model, cfg = tiny_model
    rng = random.Random(11)
    lens = [5, 17, 70, 130, 33, 48]
    prompts = {f"r{i}": [rng.randrange(100, 5000) for _ in range(n)] for i, n in enumerate(lens)}
    max_tokens = {rid: 8 + 5 * i for i, rid in enumerate(prompts)}   # they finish one by one
    used = []
    for name in ("_decode_rows", "_decode_rows_pair"):   # mixed steps, all-decode steps
        real = getattr(paged_attention.PagedAttention, name)
        monkeypatch.setattr(paged_attention.PagedAttention, name,
                            lambda self, *a, _n=name, _f=real: used.append(_n) or _f(self, *a))
    # SDPA's paths (our kernels keep no rows: they read the pool in place)
    kw = dict(num_blocks=128, block_size=16, max_num_batched_tokens=48, attention="sdpa")
    with_rows = Engine(model, cfg, EngineConfig(**kw))
    with_rows.reserve_decode_rows()                     # a decode instance at start-up
    store = with_rows.runner.rows._store.data_ptr()
    got = _run(with_rows, prompts, max_tokens)
    assert set(used) == {"_decode_rows", "_decode_rows_pair"}, "a rows path never ran"
    want = {rid: generate_greedy(model, p, max_tokens[rid]) for rid, p in prompts.items()}
    assert got == want
    assert _run(Engine(model, cfg, EngineConfig(decode_rows=False, **kw)), prompts, max_tokens) == want
    # a row is filled when its request joins the decode batch (and again after a
    # mixed step's chunking or a reallocation), never once per decoded token
    assert with_rows.runner.rows.num_refills < sum(max_tokens.values()) // 4
    # out of work: the rows are forgotten but the storage is kept (re-making it
    # faulted its pages in again on the next request's first decode), and the
    # next batch refills its rows in it
    rows = with_rows.runner.rows
    refills = rows.num_refills
    assert all(h is None for h in rows.held)
    again = {"x": prompts["r1"]}
    assert _run(with_rows, again, {"x": 6}) == {"x": want["r1"][:6]}
    assert rows._store.data_ptr() == store and rows.num_refills > refills


def test_rows_survive_preemption_with_identical_tokens(tiny_model):
    model, cfg = tiny_model
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(100, 5000) for _ in range(40)] for i in range(4)}
    max_tokens = {rid: 40 for rid in prompts}
    # 4 x (40 + 40) tokens need 20 blocks: 14 force preemption and recompute
    eng = Engine(model, cfg, EngineConfig(num_blocks=14, block_size=16))
    got = _run(eng, prompts, max_tokens)
    assert got == {rid: generate_greedy(model, p, 40) for rid, p in prompts.items()}
    assert sum(r.num_preemptions for r in eng.requests.values()) > 0


def test_a_kv_import_drops_only_the_rows_copied_from_its_block(tiny_model):
    model, cfg = tiny_model
    eng = Engine(model, cfg, EngineConfig(num_blocks=32, block_size=16, attention="sdpa"))   # rows: SDPA's
    for rid, start in (("a", 100), ("b", 300)):
        eng.submit(EngineRequest(rid, list(range(start, start + 30)), SamplingParams(max_tokens=10, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    rows = eng.runner.rows
    held = {h[0]: r for r, h in enumerate(rows.held) if h is not None}
    assert set(held) == {"a", "b"}
    used = set(eng.requests["a"].block_ids) | set(eng.requests["b"].block_ids)
    free = next(b for b in range(32) if b not in used)
    eng.runner.write_block(free, eng.runner.read_block(free))          # another request's import
    assert {h[0] for h in rows.held if h is not None} == {"a", "b"}
    b0 = eng.requests["b"].block_ids[0]
    eng.runner.write_block(b0, eng.runner.read_block(b0))              # b's own block rewritten
    assert {h[0] for h in rows.held if h is not None} == {"a"}
    refills = rows.num_refills
    eng.step()
    assert rows.num_refills == refills + 1                             # only b is refilled


def test_k_and_v_of_one_qkv_output_are_written_in_one_copy_with_the_same_result():
    """An all-decode step whose k and v lie side by side (the model's qkv output) writes both
    with one copy into the pool and one into the rows: the same pool, rows and output as
    k and v given apart."""
    H = 2 * KVH
    kv = _pool()
    decodes = [("a", 10, [3, 9, 1]), ("b", 6, [20, 4]), ("c", 3, [7])]
    seqs = [(c - 1, 1, blocks) for _, c, blocks in decodes]
    qkv = torch.randn(len(decodes), H + 2 * KVH, D)
    q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
    pair = paged_attention.kv_pair(k, v)
    assert pair is not None and torch.equal(pair, torch.stack((k, v)))
    assert paged_attention.kv_pair(k.clone(), v.clone()) is None
    results = []
    for k_, v_ in ((k, v), (k.clone(), v.clone())):
        pool = kv.clone()
        rows = DecodeRows(L, KVH, D, torch.float32, BS, max_tokens=256, headroom=8)
        md = paged_attention.build_metadata(seqs, BS, rows=(rows, rows.prepare(decodes, pool)))
        out = paged_attention.PagedAttention(pool, md)(1, q, k_, v_)
        results.append((out, pool, rows.buf.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)

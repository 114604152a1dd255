"""Mooncake trace replay: token synthesis from hash ids, scaling and caps."""

import json
from pathlib import Path

import pytest

from pdd.measure import trace
from pdd.measure.workload import RequestKind, validate_token_ids

ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 512, "output_length": 500, "hash_ids": [4]},
    {"timestamp": 9000, "input_length": 2048, "output_length": 1, "hash_ids": [0, 1, 3, 5]},
]


@pytest.fixture
def trace_file(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(p)


def test_equal_hash_ids_give_equal_tokens(trace_file):
    w = trace.load(trace.TraceConfig(trace_file, vocab_size=1000))
    a, b, c, d = (r.prompt_token_ids for r in w.requests)
    assert [len(x) for x in (a, b, c, d)] == [1200, 1100, 512, 2048]
    assert a[:1024] == b[:1024]                 # blocks 0 and 1 shared
    assert a[1024:1100] != b[1024:1100]         # block 2 vs block 3
    assert b == d[:1100]                        # partial block 3 is a prefix of the full one
    assert c[:512] != a[:512]
    validate_token_ids(w.requests, 1000)
    assert all(r.kind is RequestKind.TRACE for r in w.requests)
    # Same tokens across loads, different with another seed.
    assert trace.load(trace.TraceConfig(trace_file, vocab_size=1000)).requests[0].prompt_token_ids == a
    assert trace.load(trace.TraceConfig(trace_file, vocab_size=1000, seed=1)).requests[0].prompt_token_ids != a


def test_scaling_and_caps(trace_file):
    cfg = trace.TraceConfig(trace_file, length_scale=1 / 16, time_scale=2.0, max_input_tokens=100,
                            max_output_tokens=20, vocab_size=1000)
    assert cfg.block_tokens == 32
    w = trace.load(cfg)
    lens = [r.prompt_tokens for r in w.requests]
    assert lens == [75, 69, 32, 100]            # 1200/16, 1100/16 (rounded), 512/16, capped 128 -> 100
    assert [r.max_tokens for r in w.requests] == [6, 1, 20, 1]   # scaled, capped, at least 1
    assert [r.arrival_s for r in w.requests] == [0.0, 0.0, 6.0, 18.0]
    a, b, _, d = (r.prompt_token_ids for r in w.requests)
    assert a[:64] == b[:64] and a[64:69] != b[64:69]
    assert d[:69] == b                          # truncation keeps the shared prefix
    hit = w.hit_rates()
    assert hit[1] == pytest.approx(64 / 69)     # 16-token engine blocks, 2 scaled blocks shared


def test_start_index_and_num_requests(trace_file):
    w = trace.load(trace.TraceConfig(trace_file, start_index=1, num_requests=2, output_scale=1.0,
                                     vocab_size=1000))
    assert [r.request_id for r in w.requests] == ["r00001", "r00002"]
    assert [r.arrival_s for r in w.requests] == [0.0, 3.0]      # rebased to the first kept row
    assert [r.max_tokens for r in w.requests] == [7, 500]


def test_real_trace_head_loads():
    path = Path("/work/shared/traces/mooncake_conversation.jsonl")
    if not path.exists():
        pytest.skip("trace not present")
    w = trace.load(trace.TraceConfig(str(path), length_scale=1 / 32, num_requests=50,
                                     max_input_tokens=1024, max_output_tokens=32))
    assert len(w.requests) == 50
    assert max(r.prompt_tokens for r in w.requests) <= 1024
    assert 0.0 < w.describe()["theoretical_hit_rate"] < 1.0   # hash id 0 is a shared prefix


def test_bad_config():
    with pytest.raises(ValueError):
        trace.TraceConfig("x", length_scale=0)
    with pytest.raises(ValueError):
        trace.TraceConfig("x", max_input_tokens=0)

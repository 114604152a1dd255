"""KV export / import: resume a request in another engine (and another
process) with no prefill, and refuse KV that does not belong."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.kv_codec import KVImportError
from pdd.engine.request import EngineRequest, SamplingParams
from test_engine import drain, make_engine, prompt

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def prefill(engine: Engine, rid: str, p: list[int], sp=GREEDY) -> int:
    engine.submit(EngineRequest(rid, p, SamplingParams(**{**sp.__dict__, "max_tokens": 1}), keep_kv=True))
    (ev,) = [e for e in drain(engine) if e.token_id is not None]
    return ev.token_id


def resume(engine: Engine, rid: str, p: list[int], first: list[int], sp=GREEDY) -> list[int]:
    engine.submit(EngineRequest(rid, p, sp, output_ids=first))
    return first + [e.token_id for e in drain(engine) if e.token_id is not None]


def alone(tiny_model, p, sp=GREEDY) -> list[int]:
    eng = make_engine(tiny_model)
    eng.submit(EngineRequest("solo", p, sp))
    return [e.token_id for e in drain(eng) if e.token_id is not None]


def test_export_import_resumes_without_prefill(tiny_model):
    p = prompt(30, 100)
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    t1 = prefill(a, "r", p)
    blob = a.export_kv("r")
    assert b.import_kv(blob, pin_for="r") == 6
    got = resume(b, "r", p, [t1])
    assert got == alone(tiny_model, p)
    assert b.requests["r"].num_cached_tokens == 96
    assert b.step_log[0].num_prefill_tokens == 5      # 4-token tail + t1, one pass
    a.release_kv("r")
    assert a.pool.num_used == 0 and b.pool.num_used == 0


def test_only_missing_blocks_are_exported_and_bytes_survive(tiny_model):
    p = prompt(31, 80)
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    prefill(a, "x", p)
    b.import_kv(a.export_kv("x", num_tokens=48))             # receiver already has 3 blocks
    held = b.held_block_indices(list(a.kv_manifest("x").block_hashes))
    assert held == {0, 1, 2}
    skip = {h for i, h in enumerate(a.kv_manifest("x").block_hashes) if i in held}
    blob = a.export_kv("x", skip_hashes=skip)
    assert len(blob) < len(a.export_kv("x")) * 0.5
    assert b.import_kv(blob) == 2
    for i, h in enumerate(a.kv_manifest("x").block_hashes):   # identical bytes on both sides
        assert b.runner.read_block(b.pool.hash_to_block[h]) == a.read_block("x", i)


def test_seeded_sampling_continues_identically_across_engines(tiny_model):
    sp = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    p = prompt(32, 50)
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    t1 = prefill(a, "s", p, sp)
    b.import_kv(a.export_kv("s"), pin_for="s")
    assert resume(b, "s", p, [t1], sp) == alone(tiny_model, p, sp)


def test_foreign_or_corrupted_kv_is_refused(tiny_model, tiny_model_dir, tmp_path):
    from pdd.model.loader import load_model, make_tiny_model

    p = prompt(33, 64)
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    prefill(a, "r", p)
    blob = bytearray(a.export_kv("r"))
    blob[-10] ^= 0xFF
    with pytest.raises(KVImportError, match="checksum"):
        b.import_kv(bytes(blob))
    other = load_model(make_tiny_model(tmp_path / "other", seed=1))
    c = Engine(*other, EngineConfig(num_blocks=64))
    with pytest.raises(KVImportError, match="model_id"):
        c.import_kv(a.export_kv("r"))
    d = make_engine(tiny_model, block_size=32)
    with pytest.raises(KVImportError, match="block_size"):
        d.import_kv(a.export_kv("r"))
    with pytest.raises(KVImportError, match="magic"):
        b.import_kv(b"garbage")
    assert b.pool.num_used == 0 and b.pool.num_cached == 0   # nothing half-imported
    assert resume(b, "ok", p, [prefill(a, "r2", p)]) == alone(tiny_model, p)   # still serving


def test_kv_exported_in_another_process_continues_exactly(tiny_model, tiny_model_dir, tmp_path):
    p = prompt(34, 90)
    out = tmp_path / "kv.bin"
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        from pdd.model.loader import load_model
        from pdd.engine.config import EngineConfig
        from pdd.engine.engine import Engine
        from pdd.engine.request import EngineRequest, SamplingParams
        e = Engine(*load_model({str(tiny_model_dir)!r}), EngineConfig(num_blocks=256, block_size=16))
        e.submit(EngineRequest("r", {p!r}, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True))
        toks = []
        while e.has_work:
            toks += [ev.token_id for ev in e.step() if ev.token_id is not None]
        open({str(out)!r}, "wb").write(e.export_kv("r"))
        print(toks[0])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    t1 = int(res.stdout.strip().splitlines()[-1])
    b = make_engine(tiny_model)
    b.import_kv(out.read_bytes(), pin_for="r")
    assert resume(b, "r", p, [t1]) == alone(tiny_model, p)
    assert b.requests["r"].num_cached_tokens == 80


def test_a_streamed_block_goes_in_parts_of_at_least_64_kib():
    from pdd.engine.kv_codec import STREAM_PART_MIN_BYTES, KVLayout, layers_per_part
    bf16 = KVLayout("smollm2", "bfloat16", 16, 30, 3, 64)        # 368,640 bytes a block
    fp32 = KVLayout("smollm2", "float32", 16, 30, 3, 64)
    assert (bf16.layers_per_part, bf16.stream_slices) == (6, 5)  # 12,288 bytes a layer
    assert (fp32.layers_per_part, fp32.stream_slices) == (3, 10)
    for lay in (bf16, fp32):
        assert lay.layers_per_part * lay.block_bytes // lay.num_layers >= STREAM_PART_MIN_BYTES
    assert layers_per_part(512 * 10**6, 60) == 1                 # report-scale blocks: every layer
    assert layers_per_part(1000, 4) == 4                          # never more than the model has


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_of_a_strided_block_round_trip_in_one_copy_each_way(dtype):
    import warnings

    import torch

    from pdd.engine.kv_codec import open_block, seal_block
    from pdd.engine.runner import read_kv_bytes, read_kv_bytes_into, write_kv_bytes

    pool = torch.randn(4, 2, 64, 3, 8).to(getattr(torch, dtype))        # [L, 2, S, KVH, D], blocks of 16
    block = pool[:, :, 16:32]                                            # strided, as a pool block is
    data = read_kv_bytes(block)
    assert data.readonly and data.ndim == 1 and len(data) == block.numel() * block.element_size()
    assert bytes(data) == block.contiguous().view(torch.uint8).numpy().tobytes()
    pool[:, :, 16:32] = 0                                                # the copy does not follow the pool
    assert bytes(data) != bytes(read_kv_bytes(block))
    dst = torch.zeros_like(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                   # a read-only payload, no warning
        write_kv_bytes(dst[:, :, 48:64], open_block(memoryview(seal_block(bytes(data))), 0))
    assert dst[:, :, 48:64].view(torch.uint8).numpy().tobytes() == bytes(data)
    assert not dst[:, :, :48].any() and dst[:, :, 48:64].any()         # only the block written
    # read straight into a buffer (a same-host segment's slot): the same bytes
    out = bytearray(len(data) + 8)
    read_kv_bytes_into(dst[:, :, 48:64], memoryview(out)[4:4 + len(data)])
    assert bytes(out[4:-4]) == bytes(data) and out[:4] == out[-4:] == bytes(4)

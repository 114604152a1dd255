"""`pdd bench engine --quick` on the tiny random Llama, HF baseline included:
the JSON has every number it promises (positive, finite). Speed targets are
not asserted here: this checks the harness, not the machine."""

from __future__ import annotations

import argparse
import json
import math

from pdd.engine import bench


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_bench_engine_quick_writes_all_numbers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--model", str(tiny_model_dir), "--repeats", "2",
                              "--threads", "1", "--out", str(out)])
    assert bench.run(args) == 0
    r = json.loads(out.read_text())

    assert _positive(r["decode_speedup_b16"])
    assert _positive(r["prefix_hit_speedup"])
    assert r["settings"]["threads"] == 1 and r["settings"]["quick"] is True
    assert r["torch_version"] and r["method"]

    for L in r["settings"]["prefill_lens"]:
        e = r["prefill"][str(L)]
        for side in ("ours", "hf"):
            assert _positive(e[side]["tok_s"]) and len(e[side]["samples_s"]) == 2
        assert _positive(e["speedup"])

    assert "16" in r["decode"]
    for N in r["settings"]["decode_batches"]:
        e = r["decode"][str(N)]
        for side in ("ours", "hf_dynamic", "hf_static"):
            assert _positive(e[side]["tok_s"]) and all(_positive(s) for s in e[side]["samples_s"])
            assert e[side]["tokens"] == N * r["settings"]["decode_tokens"]
        assert e["ours"]["mean_batch"] == N      # continuous batching ran all N in every step
        assert e["hf_best"] in ("hf_dynamic", "hf_static")
        assert _positive(e["speedup"])

    p = r["prefix_hit"]
    assert p["cached_tokens"] % r["settings"]["block_size"] == 0
    assert 0.8 <= p["hit_fraction"] <= 0.9
    assert _positive(p["cold"]["median_s"]) and _positive(p["hit"]["median_s"])
    assert math.isclose(p["speedup"], r["prefix_hit_speedup"])

    assert set(r["long_decode"]) == {"pool", "scattered"}
    for by_batch in r["long_decode"].values():
        assert set(by_batch) == {str(N) for N in r["settings"]["decode_batches"]}
        for e in by_batch.values():
            for path in ("per_seq", "batched"):
                assert len(e[path]["step"]["samples_s"]) == 2 and _positive(e[path]["step"]["median_s"])
                assert 0 < e[path]["attention"]["median_s"] < e[path]["step"]["median_s"]
            assert _positive(e["speedup"]) and _positive(e["cpu_speedup"])

    printed = capsys.readouterr().out
    assert "decode_speedup_b16" in printed and "prefix hit" in printed and "per-seq" in printed
